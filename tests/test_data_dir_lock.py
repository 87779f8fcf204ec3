"""One data dir, one server (issue 10): two real server processes on one --data-dir."""

from __future__ import annotations

import subprocess
import sys

import pytest

from helpers import BASE_MODEL, sft_batch
from server_process import ServerProcess, free_port

pytestmark = pytest.mark.e2e
ANSWER_WITHIN = 300  # hang guard: a start-up refused at once, results that come at once


def test_a_second_server_on_one_data_dir_exits_before_touching_it(tmp_path):
    """A second server on a live server's data dir used to run its start-up repair on the shared
    SQLite (failing the first one's running requests, marking its live models unloaded: 404).
    Now it exits at once with one error line naming the data dir and the holder's pid, and the
    first server's model trains on."""
    first = ServerProcess(tmp_path / "srv").start()
    try:
        with first.client("tml-lock") as sc:
            tc = sc.create_lora_training_client(base_model=BASE_MODEL, rank=4).result(timeout=ANSWER_WITHIN)
            second = subprocess.run(
                [sys.executable, "-m", "hosted_tinker", "serve", "--port", str(free_port()),
                 "--data-dir", str(first.data_dir)],
                env=first.env, capture_output=True, text=True, timeout=ANSWER_WITHIN)
            assert second.returncode == 2
            errors = [line for line in second.stderr.splitlines() if "error:" in line]
            assert errors == [
                f"hosted-tinker serve: error: data dir {first.data_dir.resolve()} is in use by another "
                f"hosted-tinker server (pid {first.proc.pid}); stop it or pass another --data-dir"]
            out = tc.forward_backward(sft_batch(2), "cross_entropy").result(timeout=ANSWER_WITHIN)
            assert out.metrics["loss:sum"] > 0
    finally:
        first.stop()
    second = ServerProcess(first.data_dir).start()  # the lock went with the first server
    second.stop()
