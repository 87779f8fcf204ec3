"""Every request gets an answer (issue 10): a real server process, the real SDK.

A fault is injected after the fused pass through a fault point (hosted_tinker/faults.py) armed
in the server's environment: a real process, failing at a known point, every time.
"""

from __future__ import annotations

import sqlite3

import pytest
import tinker
from tinker import types
from tinker.types.request_error_category import RequestErrorCategory

from helpers import BASE_MODEL, database, sft_batch
from server_process import ServerProcess

pytestmark = pytest.mark.e2e
ANSWER_WITHIN = 120  # bound on a result that comes at once; a hung future fails the test here


def test_a_fault_after_the_fused_pass_fails_that_request_and_the_server_goes_on(tmp_path):
    """An exception after runtime.forward_backward (in encoding, SQLite...) used to escape the
    cycle with the request already off the queue: its future stayed pending until a restart.
    Now it fails with category "server" and a message, and the next request is served."""
    srv = ServerProcess(tmp_path / "srv", env={"HOSTED_TINKER_FAULTS": "after_forward_backward:1"}).start()
    try:
        with srv.client("tml-fault") as sc:
            tc = sc.create_lora_training_client(base_model=BASE_MODEL, rank=4).result(timeout=ANSWER_WITHIN)
            with pytest.raises(tinker.RequestFailedError) as failed:
                tc.forward_backward(sft_batch(2), "cross_entropy").result(timeout=ANSWER_WITHIN)
            assert failed.value.category is RequestErrorCategory.Server
            assert "InjectedFault" in failed.value.message and "after_forward_backward" in failed.value.message
            out = tc.forward_backward(sft_batch(2, seed=1), "cross_entropy").result(timeout=ANSWER_WITHIN)
            assert out.metrics["loss:sum"] > 0
            assert tc.optim_step(types.AdamParams()).result(timeout=ANSWER_WITHIN).metrics["grad_norm"] > 0
    finally:
        srv.stop()
    with sqlite3.connect(database(srv.data_dir)) as db:
        assert db.execute("SELECT COUNT(*) FROM futures WHERE status='pending'").fetchone()[0] == 0
