"""Issue 40, item 1: another owner's things show only their public fields, on every route that lists or
finds sessions, training runs or checkpoints. Alice publishes one checkpoint of a session full of private
things (metadata, a display name, a project, an optimizer note, other checkpoints, a sampler, a later
training step); Bob walks every listing and finding route, over HTTP and through the SDK's `RestClient`,
and each field he gets back is checked: what a published checkpoint is, and nothing of Alice's own.
"""

from __future__ import annotations

import uuid

import httpx
import pytest
import tinker
from tinker import types
from tinker.types.optimizer import OptimizerConfigBase

from helpers import BASE_MODEL, TEAM, sft_batch

pytestmark = [pytest.mark.e2e, pytest.mark.filterwarnings("ignore::FutureWarning")]  # search is "experimental"
ADAM = types.AdamParams(learning_rate=1e-2)


@pytest.fixture(scope="module")
def alices(team_server):
    """Alice's session, with one published training checkpoint among private things."""
    tag = uuid.uuid4().hex[:10]
    secrets = {"session": f"wandb-{tag}", "run": f"run-note-{tag}", "checkpoint": f"ckpt-note-{tag}",
               "name": f"Secret sweep {tag}", "project": f"proj-{tag}", "optimizer": f"opt-note-{tag}"}
    with team_server.client(TEAM["alice"], user_metadata={"wandb_api_key": secrets["session"]},
                            project_id=secrets["project"], display_name=secrets["name"]) as sc:
        tc = sc.create_lora_training_client(
            base_model=BASE_MODEL, rank=4, user_metadata={"note": secrets["run"]},
            optimizer=OptimizerConfigBase(type="adamw", note=secrets["optimizer"])).result()
        tc.forward_backward(sft_batch(2), "cross_entropy").result()
        tc.optim_step(ADAM).result()
        public = tc.save_state("shared", user_metadata={"note": secrets["checkpoint"]}).result().path
        private = tc.save_state("kept", user_metadata={"note": secrets["checkpoint"]}).result().path
        sampler_path = tc.save_weights_for_sampler("private-sampler").result().path
        sampler_id = tc.create_sampling_client(sampler_path).result()._sampling_session_id
        tc.forward_backward(sft_batch(2, seed=3), "cross_entropy").result()  # activity after the publication
        tinker.RestClient(base_url=team_server.base_url, api_key=TEAM["alice"]).publish_checkpoint_from_tinker_path(
            public).result()
        yield {"run": tc.model_id, "session": tc.model_id.split(":")[0], "public": public, "private": private,
               "sampler_path": sampler_path, "sampler_id": sampler_id, "secrets": secrets}


class Walker:
    """One owner's HTTP client that keeps every answer body, to look for another owner's secrets in them."""

    def __init__(self, srv, who: str):
        self.http = httpx.Client(base_url=srv.base_url, headers={"X-API-Key": TEAM[who]}, timeout=120)
        self.bodies: list[str] = []

    def __call__(self, method: str, path: str, status: int = 200, **kw):
        r = self.http.request(method, path, **kw)
        self.bodies.append(r.text)
        assert r.status_code == status, f"{method} {path}: {r.status_code} {r.text[:300]}"
        return r.json() if r.headers.get("content-type", "").startswith("application/json") else r.text


def search(walk: Walker, status: int = 200, **body):
    """The sessions found, or the refusal's body."""
    answer = walk("POST", "/api/v1/sessions/search", status, json=body)
    return answer["sessions"] if status == 200 else answer


def test_another_owners_things_show_only_public_fields(team_server, alices):
    a = alices
    run, session = a["run"], a["session"]
    alice, bob = Walker(team_server, "alice"), Walker(team_server, "bob")
    try:
        # What Alice sees of her own checkpoint and session (her private fields are there: the test can see them).
        theirs = {c["tinker_path"]: c for c in alice("GET", f"/api/v1/training_runs/{run}/checkpoints")["checkpoints"]}
        assert theirs[a["public"]]["user_metadata"] == {"note": a["secrets"]["checkpoint"]}
        (own_summary,) = search(alice, session_id=session)
        assert own_summary["user_metadata"] == {"wandb_api_key": a["secrets"]["session"]}
        assert alice("GET", f"/api/v1/training_runs/{run}")["last_request_time"] > theirs[a["public"]]["time"]

        # The public fields of the published checkpoint, its run and its session, as Bob must see them.
        checkpoint = {**theirs[a["public"]], "user_metadata": None}
        assert set(checkpoint) == {"checkpoint_id", "checkpoint_type", "time", "tinker_path", "training_run_id",
                                   "size_bytes", "public", "user_metadata", "expires_at"}
        public_run = {"training_run_id": run, "base_model": BASE_MODEL, "model_owner": "alice", "is_lora": True,
                      "corrupted": False, "lora_rank": 4, "last_request_time": checkpoint["time"],
                      "last_checkpoint": checkpoint, "last_sampler_checkpoint": None, "user_metadata": None}
        public_session = {"session_id": session, "created_at": own_summary["created_at"], "owner": "tml:user:alice",
                          "project_id": "", "status": None, "checkpoints_count": 1, "display_name": None,
                          "user_metadata": None, "checkpoint_storage_bytes": checkpoint["size_bytes"]}

        # Session search: public filters find it, with public fields only; private filters match Bob's own only.
        accessible = {"type": "accessible"}
        assert [s for s in search(bob, owner=accessible, limit=200) if s["session_id"] == session] == [public_session]
        assert search(bob, owner=accessible, session_id=session) == [public_session]
        assert search(bob, owner={"type": "user", "owner_urns": ["tml:user:alice"]}, session_id=session) \
            == [public_session]
        for private_filter in ({"user_metadata": {"wandb_api_key": a["secrets"]["session"]}},
                               {"display_name": a["secrets"]["name"]},
                               {"statuses": [{"type": "active"}], "session_id": "not-this-one"},
                               {"user_metadata": {"wandb_api_key": a["secrets"]["session"]}, "session_id": session}):
            assert search(bob, owner=accessible, **private_filter) == [], private_filter
        assert "not found" in search(bob, 404, owner=accessible, project_ids=[a["secrets"]["project"]])["detail"]
        bob.bodies.pop()  # that answer names the project Bob asked for: his guess, not a leak
        assert search(alice, user_metadata={"wandb_api_key": a["secrets"]["session"]}) == [own_summary]

        # Training runs: listed (accessible) and named by id, whatever the scope; its checkpoints.
        listed = bob("GET", "/api/v1/training_runs", params={"access_scope": "accessible", "limit": 1000})
        assert [r for r in listed["training_runs"] if r["training_run_id"] == run] == [public_run]
        assert run not in {r["training_run_id"] for r in bob("GET", "/api/v1/training_runs")["training_runs"]}
        for scope in ("owned", "accessible"):
            assert bob("GET", f"/api/v1/training_runs/{run}", params={"access_scope": scope}) == public_run
        assert bob("GET", f"/api/v1/training_runs/{run}/checkpoints") == {"checkpoints": [checkpoint]}
        assert a["public"] not in str(bob("GET", "/api/v1/checkpoints", params={"limit": 1000}))
        assert bob("POST", "/api/v1/weights_info", json={"tinker_path": a["public"]}) == {
            "base_model": BASE_MODEL, "is_lora": True, "lora_rank": 4, "train_unembed": True, "train_mlp": True,
            "train_attn": True, "optimizer_config": {"type": "adamw"}}
        assert alice("POST", "/api/v1/weights_info", json={"tinker_path": a["public"]})["optimizer_config"] == {
            "type": "adamw", "note": a["secrets"]["optimizer"]}

        # Sessions, samplers, models, traces, the dashboard and the admin reports: nothing of Alice's.
        assert session not in bob("GET", "/api/v1/sessions", params={"limit": 1000})["sessions"]
        for scope in ("owned", "accessible"):
            bob("GET", f"/api/v1/sessions/{session}", 404, params={"access_scope": scope})
        bob("GET", f"/api/v1/samplers/{a['sampler_id']}", 404)
        assert run not in str(bob("GET", "/v1/models"))
        bob("GET", f"/v1/models/{a['sampler_path']}", 404)
        bob("GET", f"/api/v1/sessions/{session}/trace_export", 404)
        for path in (f"/dashboard/runs/{run}", f"/dashboard/api/runs/{run}/loss"):
            bob("GET", path, 404)
        assert run not in bob("GET", "/dashboard")
        for path in ("/api/v1/billing/usage/checkpoints/current", "/api/v1/audit"):
            bob("GET", path, 403)
        for path in (a["private"], a["sampler_path"]):
            bob("POST", "/api/v1/weights_info", 404, json={"tinker_path": path})

        leaked = [(name, value) for name, value in a["secrets"].items() if any(value in b for b in bob.bodies)]
        assert not leaked, f"Bob's answers hold Alice's private {leaked}"
    finally:
        alice.http.close()
        bob.http.close()


def test_the_sdk_reads_the_public_fields(team_server, alices):
    """The same through `RestClient`: what `tinker checkpoint info`, `run info` and a search call."""
    a = alices
    bob = tinker.RestClient(base_url=team_server.base_url, api_key=TEAM["bob"])
    run = bob.get_training_run(a["run"]).result()  # access_scope="owned": the CLI's checkpoint info asks so
    assert run.user_metadata is None and run.model_owner == "alice" and run.lora_rank == 4
    assert run.last_checkpoint.tinker_path == a["public"] and run.last_checkpoint.user_metadata is None
    assert run.last_request_time == run.last_checkpoint.time and run.last_sampler_checkpoint is None
    assert bob.get_training_run_by_tinker_path(a["public"]).result() == run
    assert [c.tinker_path for c in bob.list_checkpoints(a["run"]).result().checkpoints] == [a["public"]]
    assert bob.get_weights_info_by_tinker_path(a["public"]).result().optimizer_config == types.AdamOptimizerConfig()
    (found,) = bob.search_sessions(types.SessionSearchRequest(
        owner=types.AccessibleSearchOwner(), session_id=a["session"])).result().sessions
    assert (found.owner, found.project_id, found.status, found.display_name, found.user_metadata) == (
        "tml:user:alice", "", None, None, None)
    assert bob.search_sessions(types.SessionSearchRequest(
        owner=types.AccessibleSearchOwner(), user_metadata={"wandb_api_key": a["secrets"]["session"]})
    ).result().sessions == []
