"""Resume after a crash (issue 2, test 4): save_state at step k, kill -9, restart, continue.

The resumed run (create_training_client_from_state_with_optimizer on the restarted server)
must give the same losses for steps k+1.. as a run that was never interrupted, and every
future acknowledged before the crash must still be retrievable.
"""

from __future__ import annotations

import sqlite3

import httpx
import pytest
from tinker import types

from helpers import BASE_MODEL, database, sft_batch
from server_process import ServerProcess

pytestmark = pytest.mark.e2e
KEY = "tml-resume"
ADAM = types.AdamParams(learning_rate=2e-2, weight_decay=0.01, grad_clip_norm=5.0)


def _step(tc, i: int) -> float:
    fb = tc.forward_backward(sft_batch(4, seed=100 + i), "cross_entropy")
    tc.optim_step(ADAM).result()
    return fb.result().metrics["loss:sum"]


def test_kill9_restart_resume(tmp_path):
    k, total = 3, 7
    srv = ServerProcess(tmp_path / "srv").start()
    try:
        sc = srv.client(KEY)
        tc = sc.create_lora_training_client(base_model=BASE_MODEL, rank=8, seed=1).result()
        for i in range(k):
            _step(tc, i)
        save_future = tc.save_state("step-3")
        path = save_future.result().path
        uninterrupted = [_step(tc, i) for i in range(k, total)]
        srv.kill9()
        with sqlite3.connect(database(srv.data_dir)) as db:
            (save_request_id,) = db.execute("SELECT request_id FROM futures WHERE model_id=? AND kind='save_weights'",
                                            (tc.model_id,)).fetchone()

        srv.start()  # same data directory, new process
        sc2 = srv.client(KEY)
        resumed_tc = sc2.create_training_client_from_state_with_optimizer(path).result()
        resumed = [_step(resumed_tc, i) for i in range(k, total)]
        assert resumed == pytest.approx(uninterrupted, rel=1e-6), (resumed, uninterrupted)

        # the acknowledged save's future is still answered after the crash
        r = httpx.post(f"{srv.base_url}/api/v1/retrieve_future", json={"request_id": save_request_id},
                       headers={"X-API-Key": KEY}, timeout=30)
        assert r.status_code == 200 and r.json()["path"] == path
        # the old model id is gone with the process, and says so clearly
        r = httpx.post(f"{srv.base_url}/api/v1/optim_step", headers={"X-API-Key": KEY}, timeout=30,
                       json={"model_id": tc.model_id, "seq_id": 99, "adam_params": {"learning_rate": 0.1}})
        assert r.status_code == 404 and "checkpoint" in r.json()["detail"]
    finally:
        srv.stop()
