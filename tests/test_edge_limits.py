"""Nothing one tenant sends can hurt another (issue 10), against a real server process.

- Every body is bounded, JSON or not, with or without a Content-Length; JSON nested too deep to
  parse is a 400; user metadata and telemetry batches are stored only within limits.
- Sampling is bounded per request (prompts, samples x max_tokens) and per key (requests in flight,
  Tinker `asample` and OpenAI alike), each refusal naming its setting.
- A request whose client went away is cancelled: the engine drops its rows (seen in `/metrics`),
  and another tenant's request is answered.
- Identifiers are matched whole: a trailing newline is not a valid run id.
"""

from __future__ import annotations

import json

import httpx
import openai
import pytest

from helpers import (
    BASE_MODEL, WAIT, answered, forward_backward_body, open_completion, sampling_metrics, sft_datum, wait_until,
)
from server_process import ServerProcess

pytestmark = pytest.mark.e2e
A, B = "tml-edge-alice", "tml-edge-bob"
JSON_LIMIT = 4 << 20
# Small enough to reach in a test, large enough for the long requests below (4 x 8 x 3000 tokens).
LIMITS = ("--max-json-request-bytes", str(JSON_LIMIT), "--max-sampling-requests-per-key", "2",
          "--max-prompts-per-request", "4", "--max-sampled-tokens-per-request", "100000",
          "--max-pending-per-key", "2")
# Long enough that it is still decoding when its client leaves: no EOS stop, 3000 tokens per row.
LONG = {"model": BASE_MODEL, "prompt": [[1, 2, 3]] * 4, "n": 8, "max_tokens": 3000, "ignore_eos": True}


@pytest.fixture(scope="module")
def srv(tmp_path_factory):
    proc = ServerProcess(tmp_path_factory.mktemp("edge"), args=LIMITS).start()
    yield proc
    proc.stop()


def post(srv, path: str, key: str = A, **kw) -> httpx.Response:
    return httpx.post(srv.base_url + path, headers={"X-API-Key": key, **kw.pop("headers", {})}, timeout=60, **kw)


def rows_of(request: dict) -> int:
    return len(request["prompt"]) * request["n"]


# -- bodies ---------------------------------------------------------------------------------------------

def test_every_body_is_bounded(srv):
    big = b'{"tags": [], "user_metadata": {"x": "' + b"a" * JSON_LIMIT + b'"}}'
    r = post(srv, "/api/v1/create_session", content=big, headers={"Content-Type": "application/json"})
    assert r.status_code == 413 and "max_json_request_bytes" in r.json()["detail"], r.text

    def chunked():  # no Content-Length: counted as it arrives
        yield b'{"events": [], "x": "'
        for _ in range(JSON_LIMIT // (1 << 16) + 1):
            yield b"a" * (1 << 16)
        yield b'"}'

    r = post(srv, "/api/v1/telemetry", content=chunked(), headers={"Content-Type": "application/json"})
    assert r.status_code == 413 and "max_json_request_bytes" in r.json()["detail"], r.text
    r = httpx.post(srv.base_url + "/v1/completions", content=chunked(), timeout=60,
                   headers={"Authorization": f"Bearer {A}", "Content-Type": "application/json"})
    assert r.status_code == 413 and "max_json_request_bytes" in r.json()["error"]["message"], r.text
    # binary bodies have their own, larger limit: this one is read (and refused for what it is)
    r = post(srv, "/api/v1/forward_backward", content=b"\x00" * (JSON_LIMIT + 1),
             headers={"Content-Type": "application/x-protobuf"})
    assert r.status_code == 400 and "malformed forward_backward body" in r.json()["detail"], r.text


def test_stored_json_is_bounded(srv):
    r = post(srv, "/api/v1/create_session", json={"tags": [], "user_metadata": {"x": "a" * (65 << 10)}})
    assert r.status_code == 422 and "user_metadata is" in r.json()["detail"] and "65536" in r.json()["detail"]
    r = post(srv, "/api/v1/create_session", json={"tags": ["t" * 1024] * 70})
    assert r.status_code == 422 and "tags is" in r.json()["detail"]
    nested: dict = {}
    for _ in range(40):
        nested = {"a": nested}
    r = post(srv, "/api/v1/create_session", json={"user_metadata": nested})
    assert r.status_code == 422 and "deeper than 32 levels" in r.json()["detail"]
    r = post(srv, "/api/v1/telemetry", json={"events": [{"event_data": "e" * (1 << 20)}]})
    assert r.status_code == 400 and "telemetry batch is" in r.json()["detail"]
    assert not (srv.data_dir / "telemetry.jsonl").exists()  # nothing of either was stored
    assert post(srv, "/api/v1/telemetry", json={"events": [{"event": "GENERIC_EVENT"}]}).status_code == 200


def test_telemetry_on_disk_is_bounded_too(tmp_path):
    """Bounded batches sent without end once grew telemetry.jsonl without end, on the disk every
    tenant's checkpoints share: the file is rotated at --telemetry-max-bytes, one previous kept."""
    limit = 1 << 20
    srv = ServerProcess(tmp_path / "srv", args=("--telemetry-max-bytes", str(limit))).start()
    try:
        for i in range(12):  # ~3 MiB in batches of ~250 KiB, each within the per-batch bound
            r = post(srv, "/api/v1/telemetry", json={"events": [{"event": "GENERIC_EVENT", "n": i,
                                                                 "event_data": "e" * (250 << 10)}]})
            assert r.status_code == 200, r.text
    finally:
        srv.stop()
    files = sorted(p.name for p in srv.data_dir.glob("telemetry.jsonl*"))
    assert files == ["telemetry.jsonl", "telemetry.jsonl.1"], files
    sizes = [(srv.data_dir / f).stat().st_size for f in files]
    assert all(size <= limit for size in sizes), sizes
    last = [json.loads(line) for line in (srv.data_dir / "telemetry.jsonl").read_text().splitlines()]
    assert last[-1]["batch"]["events"][0]["n"] == 11 and last[-1]["owner"]  # the newest batch is kept, whole


@pytest.mark.parametrize("path", ["/api/v1/create_session", "/api/v1/telemetry", "/api/v1/asample",
                                  "/v1/completions", "/v1/chat/completions"])
def test_json_nested_too_deep_is_a_400(srv, path):
    deep = "[" * 100_000 + "]" * 100_000
    r = httpx.post(srv.base_url + path, content=deep, timeout=60,
                   headers={"Authorization": f"Bearer {A}", "Content-Type": "application/json"})
    assert r.status_code == 400 and "nested too deeply" in r.text, r.text


def test_a_run_id_with_a_trailing_newline_is_invalid(srv):
    r = httpx.get(srv.base_url + "/api/v1/training_runs/run%0A", headers={"X-API-Key": A}, timeout=30)
    assert r.status_code == 400 and "invalid training run id" in r.json()["detail"], r.text


# -- sampling -------------------------------------------------------------------------------------------

def sampling_session(srv, key: str) -> str:
    session = post(srv, "/api/v1/create_session", key, json={"tags": []}).json()["session_id"]
    return post(srv, "/api/v1/create_sampling_session", key, json={
        "session_id": session, "sampling_session_seq_id": 0, "base_model": BASE_MODEL}).json()["sampling_session_id"]


def asample(srv, key: str, sampler: str, seq_id: int, num_samples: int = 1, max_tokens: int = 1) -> httpx.Response:
    return post(srv, "/api/v1/asample", key, json={
        "sampling_session_id": sampler, "seq_id": seq_id, "num_samples": num_samples,
        "prompt": {"chunks": [{"type": "encoded_text", "tokens": [1, 2, 3]}]},
        "sampling_params": {"max_tokens": max_tokens, "stop": []}})


def test_one_request_is_bounded(srv):
    with openai.OpenAI(base_url=srv.base_url + "/v1", api_key=A, max_retries=0) as oai:
        with pytest.raises(openai.BadRequestError, match="max_prompts_per_request"):
            oai.completions.create(model=BASE_MODEL, prompt=[[1, 2]] * 5, max_tokens=1)
        with pytest.raises(openai.BadRequestError, match="max_sampled_tokens_per_request"):
            oai.completions.create(model=BASE_MODEL, prompt=[[1, 2]] * 4, n=16, max_tokens=2000)
    r = asample(srv, A, sampling_session(srv, A), 0, num_samples=64, max_tokens=2000)
    assert r.status_code == 400 and "max_sampled_tokens_per_request" in r.json()["detail"], r.text


def test_abandoned_requests_are_cancelled_and_others_answered(srv):
    """The client of a long completion leaves: its rows are dropped, and B's 1-token request is answered."""
    before = sampling_metrics(srv)
    sock = open_completion(srv, A, LONG)
    wait_until(lambda: sampling_metrics(srv)["hosted_tinker_sampling_active_sequences"] == rows_of(LONG), "the long request decoding")
    sock.close()
    after = wait_until(lambda: (m := sampling_metrics(srv))["hosted_tinker_sampling_requests_cancelled_total"]
                  == before["hosted_tinker_sampling_requests_cancelled_total"] + len(LONG["prompt"]) and m,
                  "the long request cancelled")
    assert after["hosted_tinker_sampling_active_sequences"] == 0
    generated = after["hosted_tinker_sampled_tokens_total"] - before["hosted_tinker_sampled_tokens_total"]
    assert generated < rows_of(LONG) * LONG["max_tokens"]  # it did not run to its end
    with openai.OpenAI(base_url=srv.base_url + "/v1", api_key=B, max_retries=0, timeout=WAIT) as oai_b:
        assert oai_b.completions.create(model=BASE_MODEL, prompt=[1, 2, 3], max_tokens=1).usage.completion_tokens == 1

    # the same when a streaming client leaves after the first chunk
    before = after
    with openai.OpenAI(base_url=srv.base_url + "/v1", api_key=A, max_retries=0) as oai_a, \
            oai_a.completions.create(stream=True, **{k: v for k, v in LONG.items() if k != "ignore_eos"},
                                     extra_body={"ignore_eos": True}) as stream:
        next(iter(stream))
    wait_until(lambda: sampling_metrics(srv)["hosted_tinker_sampling_requests_cancelled_total"]
          == before["hosted_tinker_sampling_requests_cancelled_total"] + len(LONG["prompt"]),
          "the streamed request cancelled")
    wait_until(lambda: sampling_metrics(srv)["hosted_tinker_sampling_active_sequences"] == 0, "its rows dropped")


def test_sampling_in_flight_is_bounded_per_key(srv):
    """Two requests in flight is A's limit, for OpenAI and asample alike; B is not affected."""
    socks = [open_completion(srv, A, LONG) for _ in range(2)]
    try:
        wait_until(lambda: sampling_metrics(srv)["hosted_tinker_sampling_active_sequences"] == 2 * rows_of(LONG), "both decoding")
        r = httpx.post(srv.base_url + "/v1/completions", json={"model": BASE_MODEL, "prompt": "hi", "max_tokens": 1},
                       headers={"Authorization": f"Bearer {A}"}, timeout=60)
        assert r.status_code == 429 and "max_sampling_requests_per_key = 2" in r.json()["error"]["message"], r.text
        r = asample(srv, A, sampling_session(srv, A), 0)
        assert r.status_code == 429 and "max_sampling_requests_per_key = 2" in r.json()["detail"], r.text
        sampler_b = sampling_session(srv, B)
        assert asample(srv, B, sampler_b, 0).status_code == 200
    finally:
        for sock in socks:
            sock.close()
    wait_until(lambda: sampling_metrics(srv)["hosted_tinker_sampling_active_sequences"] == 0, "A's requests cancelled")
    assert asample(srv, A, sampling_session(srv, A), 0).status_code == 200  # the allowance came back


def test_a_key_over_its_pending_bound_gets_a_429_it_can_retry(srv):
    """Two unfinished requests are a key's bound here. Seq_id 1 is held back, so seq_ids 2 and 3 wait
    behind it: seq_id 4 is then a 429 that leaves it open. Seq_id 1 arrives as a refusal (which closes
    it), 2 and 3 are answered, and seq_id 4 sent again, as the SDK retries a 429, is taken and answered
    (had the 429 closed it, the retry would be "below the next expected seq_id")."""
    key = "tml-edge-pending"  # a key of its own: the bound is per key
    with srv.client(key) as sc, httpx.Client(base_url=srv.base_url, headers={"X-API-Key": key}, timeout=60) as http:
        model_id = sc.create_lora_training_client(base_model=BASE_MODEL, rank=4).result().model_id

        def post(seq_id: int, body: bytes) -> httpx.Response:
            return http.post("/api/v1/forward_backward", content=body, headers={"Content-Type": "application/x-protobuf"})

        def fb(seq_id: int) -> httpx.Response:
            return post(seq_id, forward_backward_body(model_id, seq_id, sft_datum([5, 6, 7, 8])))

        waiting = [fb(2), fb(3)]
        assert all(r.status_code == 200 for r in waiting), [r.text for r in waiting]
        over = fb(4)
        assert over.status_code == 429 and "2 unfinished requests (max_pending_per_key)" in over.json()["detail"], over.text
        refused = post(1, forward_backward_body(model_id, 1, sft_datum([5, 6, 7, 8])).replace(b"cross_entropy", b"cross_entropz"))
        assert refused.status_code == 400, refused.text
        assert all(answered(http, r.json()["request_id"]).status_code == 200 for r in waiting)
        again = fb(4)
        assert again.status_code == 200, again.text
        assert answered(http, again.json()["request_id"]).status_code == 200
