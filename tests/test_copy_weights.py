"""`copy_weights` through the SDK (issue 36): a new checkpoint in the destination project that shares the
source's files (hard links: no byte copied), in a new run that cannot be trained, with its own TTL; refused
for a checkpoint the caller cannot read; readable after its source is deleted."""

from __future__ import annotations

import sqlite3
import time
import uuid

import httpx
import pytest
import tinker
import torch
from tinker import types

from helpers import (
    BASE_MODEL, TEAM, checkpoint_dir, database, forward_backward_body, read_adapter, sft_batch, sft_datum,
)

pytestmark = pytest.mark.e2e


def rest(srv, who: str) -> tinker.RestClient:
    return tinker.RestClient(base_url=srv.base_url, api_key=TEAM[who])


def trained_checkpoint(srv, who: str, name: str) -> str:
    with srv.client(TEAM[who], project_id=f"proj-{who}") as sc:
        tc = sc.create_lora_training_client(base_model=BASE_MODEL, rank=4).result()
        tc.forward_backward(sft_batch(2), "cross_entropy").result()
        tc.optim_step(types.AdamParams(learning_rate=1e-2)).result()
        return tc.save_state(name).result().path


def project_of_run(srv, run_id: str) -> str:
    with sqlite3.connect(database(srv.data_dir)) as db:
        return db.execute("SELECT s.project_id FROM models m JOIN sessions s ON s.session_id = m.session_id"
                          " WHERE m.model_id = ?", (run_id,)).fetchone()[0]


def test_a_copy_shares_the_sources_files_and_outlives_it(team_server):
    source = trained_checkpoint(team_server, "alice", "to-copy")
    weights = read_adapter(team_server, source)
    before = time.time()
    copy = rest(team_server, "alice").copy_weights(source, "proj-archive", ttl_seconds=7200).result()
    run = copy.split("/")[2]
    assert copy.endswith("/weights/to-copy") and run != source.split("/")[2]
    for f in checkpoint_dir(team_server, source).iterdir():  # the same inodes: no byte copied
        twin = checkpoint_dir(team_server, copy) / f.name
        assert twin.stat().st_ino == f.stat().st_ino and f.stat().st_nlink == 2
    (listed,) = rest(team_server, "alice").list_checkpoints(run).result().checkpoints
    assert str(listed.tinker_path) == copy and before + 7200 <= listed.expires_at.timestamp() <= time.time() + 7200
    assert project_of_run(team_server, run) == "proj-archive"
    rest(team_server, "alice").delete_checkpoint_from_tinker_path(source).result()
    assert not checkpoint_dir(team_server, source).exists()
    assert all(torch.equal(read_adapter(team_server, copy)[k], v) for k, v in weights.items())
    with team_server.client(TEAM["alice"]) as sc:
        sc.create_training_client_from_state_with_optimizer(copy).result()  # readable, whole
    # Its run cannot be trained: no training request reaches it.
    http = httpx.Client(base_url=team_server.base_url, headers={"X-API-Key": TEAM["alice"]}, timeout=60)
    with http:
        r = http.post("/api/v1/forward_backward", content=forward_backward_body(run, 1, sft_datum([5, 6, 7])),
                      headers={"Content-Type": "application/x-protobuf"})
        assert r.status_code == 404 and "is not loaded" in r.json()["detail"], r.text
        r = http.post("/api/v1/load_weights", json={"model_id": run, "seq_id": 1, "path": copy, "optimizer": False})
        assert r.status_code == 404, r.text


def test_the_service_clients_copy_lands_in_its_project_and_retries_find_the_first(team_server):
    source = trained_checkpoint(team_server, "bob", "service-copy")
    with team_server.client(TEAM["bob"], project_id="proj-bob-copies") as sc:
        copy = sc.copy_weights(source).result()
    assert project_of_run(team_server, copy.split("/")[2]) == "proj-bob-copies"
    key = str(uuid.uuid4())
    body = {"source_path": source, "destination_project_id": "proj-retried"}
    answers = [httpx.post(f"{team_server.base_url}/api/v1/copy_weights", json=body, timeout=60,
                          headers={"X-API-Key": TEAM["bob"], "X-Idempotency-Key": key}).json() for _ in range(2)]
    assert answers[0] == answers[1] and answers[0]["tinker_path"] != copy


def test_a_copy_is_refused_for_a_checkpoint_the_caller_cannot_read(team_server):
    source = trained_checkpoint(team_server, "alice", "private")
    with pytest.raises(tinker.NotFoundError, match="not found"):
        rest(team_server, "bob").copy_weights(source, "proj-bob").result()
    rest(team_server, "alice").publish_checkpoint_from_tinker_path(source).result()
    published_copy = rest(team_server, "bob").copy_weights(source, "proj-bob").result()
    (row,) = rest(team_server, "bob").list_checkpoints(published_copy.split("/")[2]).result().checkpoints
    assert row.public is False  # bob's own, private copy


@pytest.mark.parametrize("body, detail", [
    ({"ttl_seconds": 60}, "ttl_seconds must be between 3600 (1 hour)"),
    ({"weights_access_token": "tok"}, "weights_access_token"),
    ({"destination_project_id": None}, "destination_project_id is needed"),
    ({"destination_project_id": None, "session_id": "sess-x"}, "model_seq_id is needed"),
    ({"source_path": "tinker://nope"}, "tinker://"),
])
def test_a_bad_copy_request_is_a_4xx_naming_the_field(team_server, body, detail):
    request = {"source_path": "tinker://run-x/weights/w", "destination_project_id": "p", **body}
    r = httpx.post(f"{team_server.base_url}/api/v1/copy_weights", json=request, headers={"X-API-Key": TEAM["alice"]},
                   timeout=60)
    assert r.status_code in (400, 404) and detail in r.json()["detail"], r.text
