"""The per-request and per-key limits that no other test module reaches, each refused through the
real SDK against a real server, with a message naming its setting, while another key is not
affected: `max_lora_rank`, `max_models_per_key`, `max_datums_per_request`, `max_num_samples`,
`max_request_bytes`
(tests/test_architecture.py checks that every limit a refusal names has such a test somewhere)."""

from __future__ import annotations

import httpx
import pytest
import tinker
from tinker import types

from helpers import BASE_MODEL, WAIT, answered, forward_backward_body, sft_datum
from server_process import ServerProcess

pytestmark = pytest.mark.e2e
B = "tml-limits-bob"


def key(test: str) -> str:
    """A key of its own per test: the module's server keeps what earlier tests created."""
    return f"tml-limits-{test}"
REQUEST_BYTES = 1 << 20
LIMITS = ("--max-lora-rank", "8", "--max-models-per-key", "2", "--max-datums-per-request", "3",
          "--max-num-samples", "2", "--max-request-bytes", str(REQUEST_BYTES))


@pytest.fixture(scope="module")
def srv(tmp_path_factory):
    proc = ServerProcess(tmp_path_factory.mktemp("limits"), args=LIMITS).start()
    yield proc
    proc.stop()


def test_a_rank_above_max_lora_rank_is_refused(srv):
    with srv.client(key("rank")) as sc:
        with pytest.raises(tinker.BadRequestError, match=r"LoRA rank 16 is above this server's limit of 8 \(max_lora_rank\)"):
            sc.create_lora_training_client(base_model=BASE_MODEL, rank=16).result()
        assert sc.create_lora_training_client(base_model=BASE_MODEL, rank=8).result().get_info().model_data.model_name


def test_a_key_holds_at_most_max_models_per_key_live_training_runs(srv):
    A = key("models")
    with srv.client(A) as a, srv.client(B) as b:
        live = [a.create_lora_training_client(base_model=BASE_MODEL, rank=4).result() for _ in range(2)]
        with pytest.raises(tinker.BadRequestError, match=r"already has 2 live models \(max_models_per_key = 2\); "
                                                         "unload one before creating another"):
            a.create_lora_training_client(base_model=BASE_MODEL, rank=4).result()
        b.create_lora_training_client(base_model=BASE_MODEL, rank=4).result()  # another key has its own bound
        with httpx.Client(base_url=srv.base_url, headers={"X-API-Key": A}, timeout=60) as http:  # no SDK method
            r = http.post("/api/v1/unload_model", json={"model_id": live[0].model_id})
            assert r.status_code == 200, r.text
            assert answered(http, r.json()["request_id"]).json()["model_id"] == live[0].model_id
        a.create_lora_training_client(base_model=BASE_MODEL, rank=4).result()  # room again


def test_a_request_of_more_than_max_datums_per_request_is_refused(srv):
    """The SDK reads the bound from the client config and splits a larger batch itself; a client that
    does not (a body posted by hand) gets a 400 naming the setting, and its next request is taken."""
    four = [sft_datum([1, 2, 3, 4 + i]) for i in range(4)]
    A = key("datums")
    with srv.client(A) as a, srv.client(B) as b:
        tc_b = b.create_lora_training_client(base_model=BASE_MODEL, rank=4).result()
        assert len(tc_b.forward_backward(four, "cross_entropy").result(timeout=WAIT).loss_fn_outputs) == 4
        model_a = a.create_lora_training_client(base_model=BASE_MODEL, rank=4).result().model_id
    proto = {"Content-Type": "application/x-protobuf"}
    with httpx.Client(base_url=srv.base_url, headers={"X-API-Key": A}, timeout=60) as http:
        r = http.post("/api/v1/forward_backward", content=forward_backward_body(model_a, 1, *four), headers=proto)
        assert r.status_code == 400, r.text
        assert ("4 datums in one request; this server takes at most 3 (max_datums_per_request; the SDK splits larger "
                "batches itself)") in r.json()["detail"]
        r = http.post("/api/v1/forward_backward", content=forward_backward_body(model_a, 2, *four[:3]), headers=proto)
        assert r.status_code == 200, r.text
        assert answered(http, r.json()["request_id"]).status_code == 200


def test_more_than_max_num_samples_is_refused(srv):
    with srv.client(key("samples")) as a:
        sampler = a.create_sampling_client(base_model=BASE_MODEL).result()
        prompt = types.ModelInput.from_ints([1, 2, 3])
        params = types.SamplingParams(max_tokens=2, temperature=1.0)
        with pytest.raises(tinker.BadRequestError, match=r"num_samples 3 is above this server's limit of 2 "
                                                         r"\(max_num_samples\)"):
            sampler.sample(prompt, 3, params).result(timeout=WAIT)
        assert len(sampler.sample(prompt, 2, params).result(timeout=WAIT).sequences) == 2


def test_a_body_above_max_request_bytes_is_a_413_naming_it(srv):
    """A protobuf forward_backward above the bound: refused from its Content-Length, and without one
    (chunked) as it arrives; a body within it is read."""
    A = key("bytes")
    with srv.client(A) as a:
        model_a = a.create_lora_training_client(base_model=BASE_MODEL, rank=4).result().model_id
    big = forward_backward_body(model_a, 1, sft_datum(list(range(1, 3)) * (REQUEST_BYTES // 4)))
    assert len(big) > REQUEST_BYTES
    proto = {"Content-Type": "application/x-protobuf"}
    with httpx.Client(base_url=srv.base_url, headers={"X-API-Key": A}, timeout=60) as http:
        r = http.post("/api/v1/forward_backward", content=big, headers=proto)
        assert r.status_code == 413, r.text
        assert f"above this server's limit of {REQUEST_BYTES} bytes (max_request_bytes)" in r.json()["detail"]
        r = http.post("/api/v1/forward_backward", content=iter([big[:1 << 19], big[1 << 19:]]), headers=proto)
        assert r.status_code == 413 and "(max_request_bytes)" in r.json()["detail"], r.text
        r = http.post("/api/v1/forward_backward", content=forward_backward_body(model_a, 1, sft_datum([1, 2, 3])),
                      headers=proto)
        assert r.status_code == 200 and answered(http, r.json()["request_id"]).status_code == 200
