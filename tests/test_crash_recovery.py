"""Crash safety (issue 6, test 3): kill -9 the server at random moments, ten times, and resume.

A training client (its own process) saves state every 2 steps. The server is killed -9 at a
random moment while it trains, then restarted on the same data directory; the client resumes
from the last checkpoint it saw acknowledged. In the end: every acknowledged checkpoint loads,
the SQLite file is intact, and every step's loss equals the uninterrupted run's.
"""

from __future__ import annotations

import json
import os
import random
import sqlite3
import subprocess
import sys
import time
from pathlib import Path

import pytest

from helpers import database
from server_process import ServerProcess

pytestmark = pytest.mark.e2e
TOTAL = 16
KILLS = 10
HERE = Path(__file__).parent


def run_client(base_url: str, resume: str, start: int, out: Path) -> subprocess.Popen:
    # helpers.py imports hosted_tinker: this checkout's, as the server runs (a script's own folder, not the
    # working directory, starts its path: without it the editable install's checkout would be imported)
    pythonpath = os.pathsep.join(p for p in (str(HERE), str(HERE.parent), os.environ.get("PYTHONPATH")) if p)
    env = {**os.environ, "PYTHONPATH": pythonpath, "TINKER_TELEMETRY": "0"}
    return subprocess.Popen([sys.executable, str(HERE / "crash_client.py"), base_url, resume, str(start), str(TOTAL),
                             str(out)], env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)


def records(out: Path) -> list[dict]:
    return [json.loads(line) for line in out.read_text().splitlines()] if out.exists() else []


def test_ten_random_kills(tmp_path):
    rng = random.Random(7)
    srv = ServerProcess(tmp_path / "crashy").start()
    out = tmp_path / "crashy.jsonl"
    acknowledged: list[tuple[str, int]] = []
    losses: dict[int, list[float]] = {}
    kills = 0
    try:
        # the uninterrupted reference, on the first of the server's processes (a model of its own: its
        # losses do not depend on what else the server trained)
        ref_out = tmp_path / "ref.jsonl"
        assert run_client(srv.base_url, "-", 0, ref_out).wait(600) == 0
        reference = {r["step"]: r["loss"] for r in records(ref_out) if "step" in r}
        assert len(reference) == TOTAL
        while True:
            if not srv.alive():
                srv.start()
            with sqlite3.connect(database(srv.data_dir)) as db:
                assert db.execute("PRAGMA integrity_check").fetchone()[0] == "ok"
            resume, start = acknowledged[-1] if acknowledged else ("-", 0)
            seen = len(records(out))
            client = run_client(srv.base_url, resume, start, out)
            if kills == KILLS:
                assert client.wait(600) == 0
                break
            # kill at a random moment once this segment is really training
            deadline = time.monotonic() + 120
            while len(records(out)) == seen and client.poll() is None and time.monotonic() < deadline:
                time.sleep(0.05)
            time.sleep(rng.uniform(0.0, 1.5))
            srv.kill9()
            kills += 1
            client.kill()
            client.wait(30)
            for r in records(out)[seen:]:
                if "checkpoint" in r:
                    acknowledged.append((r["checkpoint"], r["after_step"]))
        for r in records(out):
            if "step" in r:
                losses.setdefault(r["step"], []).append(r["loss"])
            elif "checkpoint" in r and (r["checkpoint"], r["after_step"]) not in acknowledged:
                acknowledged.append((r["checkpoint"], r["after_step"]))

        # every step's loss, in every segment that ran it, equals the uninterrupted run's
        assert set(losses) == set(range(TOTAL))
        for step, seen_losses in losses.items():
            for loss in seen_losses:
                assert loss == pytest.approx(reference[step], rel=1e-6), (step, seen_losses, reference[step])
        # every acknowledged checkpoint loads
        with srv.client("tml-crash") as sc:  # closed before the server
            for path, _ in acknowledged:
                tc = sc.create_training_client_from_state_with_optimizer(path).result()
                assert tc.get_info().lora_rank == 8
    finally:
        srv.stop()
    assert kills == KILLS and len(acknowledged) >= TOTAL // 2
