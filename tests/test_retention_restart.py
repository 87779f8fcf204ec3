"""The data dir's bounds on a real server (issue 41 item 6): a restart after the tightest retention
still answers every result the SDK has not fetched and restores every checkpoint, and /metrics
shows the data dir by kind.

A server trains through the SDK, saves a checkpoint and a sampler checkpoint by name and two
snapshots (save_weights_and_get_sampling_client), and answers a request whose result nobody
fetches. It restarts with every size bound at 0 and a sweep a second; the test waits for two
sweeps (a counter in /metrics, not a sleep): the older snapshot is gone, the rest is there and
works; /metrics and the dashboard show the data dir by kind. test_retention.py checks each rule
on its own, with a clock it steps.
"""

from __future__ import annotations

import re
import sqlite3

import httpx
import pytest
import tinker
from tinker import types

from helpers import BASE_MODEL, checkpoint_dir, database, metric, read_adapter, sft_batch, wait_until
from server_process import ServerProcess

KEY = "tml-retention"
ADAM = types.AdamParams(learning_rate=1e-2)
PROMPT = types.ModelInput.from_ints([1, 2, 3])
TIGHT = ("--retention-sweep-s", "1", "--sampler-snapshot-retention-bytes", "0",
         "--request-history-retention-bytes", "0")


def snapshot_of(srv: ServerProcess, sampling_session_id: str) -> str:
    with sqlite3.connect(database(srv.data_dir)) as db:
        return db.execute("SELECT model_path FROM sampling_sessions WHERE sampling_session_id=?",
                          (sampling_session_id,)).fetchone()[0]


def status_of(srv: ServerProcess, request_id: str) -> str | None:
    with sqlite3.connect(database(srv.data_dir)) as db:
        row = db.execute("SELECT status FROM futures WHERE request_id=?", (request_id,)).fetchone()
    return None if row is None else row[0]


def data_dir_bytes(srv: ServerProcess) -> dict[str, float]:
    text = httpx.get(f"{srv.base_url}/metrics", timeout=30).text
    return {k: float(v) for k, v in re.findall(r'^hosted_tinker_data_dir_bytes\{kind="([^"]+)"\} (\S+)$', text, re.M)}


def test_a_restart_after_the_tightest_retention_answers_what_is_unfetched_and_restores_every_checkpoint(tmp_path):
    srv = ServerProcess(tmp_path, args=("--retention-sweep-s", "1"))
    srv.start()
    try:
        sc = srv.client(KEY)
        tc = sc.create_lora_training_client(base_model=BASE_MODEL, rank=8, seed=3).result()
        for seed in range(2):
            tc.forward_backward(sft_batch(3, seed=seed), "cross_entropy").result()
            tc.optim_step(ADAM).result()
        kept = tc.save_state("kept").result().path
        named = tc.save_weights_for_sampler("named").result().path
        with pytest.raises(tinker.BadRequestError, match="ephemeral-<number> are the server's"):
            tc.save_weights_for_sampler("ephemeral-9").result()  # the snapshots' names are not a user's
        older = tc.save_weights_and_get_sampling_client().result()
        older.sample(PROMPT, 1, types.SamplingParams(max_tokens=4)).result()
        tc.forward_backward(sft_batch(3, seed=7), "cross_entropy").result()
        tc.optim_step(ADAM).result()
        newer = tc.save_weights_and_get_sampling_client().result()
        newer.sample(PROMPT, 1, types.SamplingParams(max_tokens=4)).result()
        # A request answered but never fetched: the SDK may still ask for it after the restart.
        idle = sc.create_lora_training_client(base_model=BASE_MODEL, rank=4).result()
        unfetched = httpx.post(f"{srv.base_url}/api/v1/optim_step", headers={"X-API-Key": KEY}, timeout=30, json={
            "model_id": idle.model_id, "seq_id": 1, "adam_params": {"learning_rate": 0.01}}).json()["request_id"]
        wait_until(lambda: status_of(srv, unfetched) == "done", "the unfetched optim_step answered")
        adapter = read_adapter(srv, kept)
        older_dir = checkpoint_dir(srv, snapshot_of(srv, older._sampling_session_id))
        newer_dir = checkpoint_dir(srv, snapshot_of(srv, newer._sampling_session_id))

        srv.args = TIGHT
        srv.restart()
        wait_until(lambda: metric(srv, "hosted_tinker_retention_sweeps_total") >= 2, "two retention sweeps")

        answer = httpx.post(f"{srv.base_url}/api/v1/retrieve_future", headers={"X-API-Key": KEY}, timeout=60,
                            json={"request_id": unfetched})
        assert answer.status_code == 200 and "metrics" in answer.json(), answer.text
        assert not older_dir.exists() and newer_dir.is_dir()  # each run's newest snapshot stays
        newer.sample(PROMPT, 1, types.SamplingParams(max_tokens=4)).result()
        with pytest.raises(tinker.NotFoundError, match="can no longer read"):
            older.sample(PROMPT, 1, types.SamplingParams(max_tokens=4)).result()
        assert checkpoint_dir(srv, named).is_dir()
        restored = sc.create_training_client_from_state(kept).result()
        restored.forward_backward(sft_batch(2), "cross_entropy").result()
        assert all(read_adapter(srv, kept)[k].equal(v) for k, v in adapter.items())

        sizes = data_dir_bytes(srv)
        assert sizes["checkpoints"] > 0 and sizes["snapshots"] > 0 and sizes["models"] > 0
        assert {"database/requests", "database/audit", "database/catalog", "database/timings"} <= set(sizes)
        page = httpx.get(f"{srv.base_url}/dashboard", headers={"X-API-Key": KEY}, timeout=60).text  # dev mode: shown
        assert 'id="data-dir"' in page and all(f'data-kind="{kind}"' in page for kind in sizes)
        with sqlite3.connect(database(srv.data_dir)) as db:
            # the history bound (0) took every timing and loss point older than the restart; results stayed
            assert db.execute("SELECT COUNT(*) FROM futures WHERE request_id=? AND result IS NOT NULL",
                              (unfetched,)).fetchone()[0] == 1
    finally:
        srv.stop()
    with sqlite3.connect(database(srv.data_dir)) as db:
        reasons = [r[0] for r in db.execute("SELECT details FROM audit_log WHERE event='checkpoint_delete'")]
    assert any("snapshot retention" in r for r in reasons), reasons
