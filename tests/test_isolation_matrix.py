"""Tenant isolation (issue 6, test 1): key B against every one of key A's objects, endpoint by endpoint.

Every attempt must be refused with 404 (so existence does not leak), and A's objects must be
unchanged afterwards. Published checkpoints are the documented exception: others may load and
sample them, but still not delete, unpublish or re-time them.
"""

from __future__ import annotations

import sqlite3

import httpx
import pytest
import tinker
from tinker import types
from tinker.proto.request_conv import forward_backward_request_to_proto
from tinker.types.forward_backward_input import ForwardBackwardInput
from tinker.types.forward_backward_request import ForwardBackwardRequest

from helpers import BASE_MODEL, database, logprobs_of, sft_batch
from hosted_tinker.accounts.auth import anonymous_owner

pytestmark = pytest.mark.e2e
A, B = "tml-isolation-alice", "tml-isolation-bob"


@pytest.fixture(scope="module")
def alice(server):
    with server.client(A) as sc:
        tc = sc.create_lora_training_client(base_model=BASE_MODEL, rank=4).result()
        tc.forward_backward(sft_batch(2), "cross_entropy").result()
        tc.optim_step(types.AdamParams(learning_rate=1e-2)).result()
        state = tc.save_state("private-state").result().path
        sampler_path = tc.save_weights_for_sampler("private-sampler").result().path
        tc.save_weights_and_get_sampling_client().result()
        external = tc.save_weights_external("private-export").result().path
        with sqlite3.connect(database(server.data_dir)) as db:
            owner = anonymous_owner(A)
            (request_id,) = db.execute("SELECT request_id FROM futures WHERE owner=? AND status='done' LIMIT 1",
                                       (owner,)).fetchone()
            (sampler_id,) = db.execute("SELECT sampling_session_id FROM sampling_sessions WHERE owner=? LIMIT 1",
                                       (owner,)).fetchone()
        proto = forward_backward_request_to_proto(ForwardBackwardRequest(
            forward_backward_input=ForwardBackwardInput(data=sft_batch(1), loss_fn="cross_entropy"),
            model_id=tc.model_id, seq_id=100)).SerializeToString()
        yield dict(sc=sc, tc=tc, model_id=tc.model_id, session_id=tc.model_id.split(":train:")[0], state=state,
                   sampler=sampler_path, external=external, sampling_session_id=sampler_id, request_id=request_id, proto=proto)


def _ckpt_url(server, path: str, suffix: str = "") -> str:
    run, kind, name = path[len("tinker://"):].split("/")
    return f"{server.base_url}/api/v1/training_runs/{run}/checkpoints/{kind}/{name}{suffix}"


def test_key_b_is_refused_everywhere(server, alice):
    before = logprobs_of(alice["tc"].forward(sft_batch(2), "cross_entropy").result())
    m, s, st, sp = alice["model_id"], alice["session_id"], alice["state"], alice["sampler"]
    run = m
    u = server.base_url + "/api/v1"
    adam = {"learning_rate": 0.1, "beta1": 0.9, "beta2": 0.95, "eps": 1e-12, "weight_decay": 0, "grad_clip_norm": 0}
    attempts = [
        ("POST", f"{u}/get_info", {"model_id": m}),
        ("POST", f"{u}/optim_step", {"model_id": m, "seq_id": 50, "adam_params": adam}),
        ("POST", f"{u}/save_weights", {"model_id": m, "seq_id": 51, "path": "stolen"}),
        ("POST", f"{u}/save_weights_for_sampler", {"model_id": m, "seq_id": 52, "path": "stolen"}),
        ("POST", f"{u}/save_weights_external", {"model_id": m, "seq_id": 53, "path": "stolen"}),
        ("POST", f"{u}/load_weights", {"model_id": m, "seq_id": 54, "path": st, "optimizer": True}),
        ("POST", f"{u}/unload_model", {"model_id": m}),
        ("POST", f"{u}/create_model", {"session_id": s, "model_seq_id": 77, "base_model": BASE_MODEL,
                                       "lora_config": {"rank": 4}}),
        ("POST", f"{u}/session_heartbeat", {"session_id": s}),
        ("POST", f"{u}/sessions/{s}/finish", {"reason": {"type": "success"}, "detail": None}),
        ("GET", f"{u}/sessions/{s}", None),
        ("POST", f"{u}/create_sampling_session", {"session_id": s, "sampling_session_seq_id": 9,
                                                  "base_model": BASE_MODEL}),
        ("GET", f"{u}/training_runs/{run}", None),
        ("GET", f"{u}/training_runs/{run}/checkpoints", None),
        ("DELETE", _ckpt_url(server, st), None),
        ("POST", _ckpt_url(server, st, "/publish"), None),
        ("DELETE", _ckpt_url(server, st, "/publish"), None),
        ("PUT", _ckpt_url(server, st, "/ttl"), {"ttl_seconds": 3600}),
        ("GET", _ckpt_url(server, alice["external"], "/external_weights_urls"), None),
        ("DELETE", _ckpt_url(server, alice["external"]), None),
        ("GET", _ckpt_url(server, st, "/archive"), None),
        ("POST", f"{u}/weights_info", {"tinker_path": st}),
        ("POST", f"{u}/weights_info", {"tinker_path": sp}),
    ]
    with httpx.Client(timeout=30, headers={"X-API-Key": B}) as http:
        # B needs a session of its own for the create-from-checkpoint attempts
        b_session = http.post(f"{u}/create_session", json={"tags": []}).json()["session_id"]
        attempts += [
            ("POST", f"{u}/load_weights", {"session_id": b_session, "model_seq_id": 0, "path": st, "optimizer": True}),
            ("POST", f"{u}/load_weights", {"session_id": b_session, "model_seq_id": 1, "path": sp, "optimizer": False}),
            ("POST", f"{u}/create_sampling_session", {"session_id": b_session, "sampling_session_seq_id": 0,
                                                      "model_path": sp}),
        ]
        attempts += [("GET", f"{u}/samplers/{alice['sampling_session_id']}", None),
                     ("POST", f"{u}/asample", {"sampling_session_id": alice["sampling_session_id"], "seq_id": 5,
                                               "num_samples": 1, "prompt": {"chunks": [{"type": "encoded_text",
                                                                                        "tokens": [1, 2]}]},
                                               "sampling_params": {"max_tokens": 2}})]
        for method, url, body in attempts:
            r = http.request(method, url, json=body)
            assert r.status_code == 404, (method, url, r.status_code, r.text)
            assert r.json()["detail"]
        r = http.post(f"{u}/forward_backward", content=alice["proto"], headers={"Content-Type": "application/x-protobuf"})
        assert r.status_code == 404
        assert http.post(f"{u}/retrieve_future", json={"request_id": alice["request_id"]}).status_code == 404
        # listings show B nothing of A's
        assert all(c["tinker_path"] not in (st, sp) for c in http.get(f"{u}/checkpoints").json()["checkpoints"])
        assert all(r["training_run_id"] != m for r in http.get(f"{u}/training_runs").json()["training_runs"])
        assert s not in http.get(f"{u}/sessions").json()["sessions"]
        # OpenAI surface: A's adapter is not B's to sample or list
        r = http.post(f"{server.base_url}/v1/completions", json={"model": sp, "prompt": "hi", "max_tokens": 2},
                      headers={"Authorization": f"Bearer {B}"})
        assert r.status_code == 404
        listed = http.get(f"{server.base_url}/v1/models", headers={"Authorization": f"Bearer {B}"}).json()
        assert sp not in [x["id"] for x in listed["data"]]
    # nothing of A's changed
    after = logprobs_of(alice["tc"].forward(sft_batch(2), "cross_entropy").result())
    for a, b in zip(before, after):
        assert (a == b).all()
    assert alice["tc"].save_state("still-mine").result().path.endswith("still-mine")


def test_published_checkpoints_are_loadable_and_sampleable_by_others(server, alice):
    rc = tinker.RestClient(base_url=server.base_url, api_key=A)
    rc.publish_checkpoint_from_tinker_path(alice["state"]).result()
    rc.publish_checkpoint_from_tinker_path(alice["sampler"]).result()
    try:
        with server.client(B) as sc_b:
            tc_b = sc_b.create_training_client_from_state(alice["state"]).result()
            mine = logprobs_of(alice["tc"].forward(sft_batch(2), "cross_entropy").result())
            assert tc_b.model_id.startswith("sess") and tc_b.model_id != alice["model_id"]
            theirs = logprobs_of(tc_b.forward(sft_batch(2), "cross_entropy").result())
            assert len(theirs) == len(mine)
            sampler = sc_b.create_sampling_client(model_path=alice["sampler"]).result()
            out = sampler.sample(types.ModelInput.from_ints([1, 2, 3]), num_samples=1,
                                 sampling_params=types.SamplingParams(max_tokens=3)).result()
            assert len(out.sequences[0].tokens) >= 1
            with httpx.Client(timeout=30, headers={"X-API-Key": B}) as http:  # still not B's to manage
                for method, suffix in (("DELETE", ""), ("DELETE", "/publish")):
                    r = http.request(method, _ckpt_url(server, alice["state"], suffix))
                    assert r.status_code in (403, 404), (method, suffix, r.text)
    finally:
        rc.unpublish_checkpoint_from_tinker_path(alice["state"]).result()
        rc.unpublish_checkpoint_from_tinker_path(alice["sampler"]).result()


def test_another_keys_encrypted_export_is_a_404_like_any_other_object(server, alice, tmp_path, monkeypatch):
    """Issue 33, not probed before: A's age-encrypted export, and the cookbook's encrypted download
    of A's training checkpoint, are 404s to B at every step (the signed URLs, the archive, its info,
    its deletion; the download's load into a run of B's), as any other object of A's is."""
    import pyrage
    from tinker_cookbook import weights
    from tinker_cookbook.exceptions import WeightsDownloadError

    identity = pyrage.x25519.Identity.generate()
    enc = alice["tc"].save_weights_external("private-encrypted", age_encryption_recipients=[
        str(identity.to_public())]).result().path
    u = server.base_url + "/api/v1"
    with httpx.Client(timeout=30, headers={"X-API-Key": B}) as http:
        for method, url, body in [("GET", _ckpt_url(server, enc, "/external_weights_urls"), None),
                                  ("GET", _ckpt_url(server, enc, "/archive"), None),
                                  ("POST", f"{u}/weights_info", {"tinker_path": enc}),
                                  ("DELETE", _ckpt_url(server, enc), None)]:
            r = http.request(method, url, json=body)
            assert r.status_code == 404 and r.json()["detail"], (method, url, r.status_code, r.text)
    monkeypatch.setenv("TINKER_API_KEY", B)
    for path in (enc, alice["state"]):
        with pytest.raises((tinker.NotFoundError, WeightsDownloadError), match="404|not found"):
            weights.download(tinker_path=path, output_dir=str(tmp_path / "stolen"), base_url=server.base_url)
        assert not (tmp_path / "stolen" / "adapter_model.safetensors").exists()
    rc = tinker.RestClient(base_url=server.base_url, api_key=A)  # still A's, and whole
    assert set(rc.get_external_weights_urls(enc).result().urls) == {
        "adapter_config.json.age", "adapter_model.safetensors.age", "manifest.json.age"}
