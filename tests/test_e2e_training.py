"""End to end through the real `tinker` SDK against a real server process (issue 2: 1, 3, 5)."""

from __future__ import annotations

import warnings

import httpx
import numpy as np
import pytest
import tinker
import torch
from tinker import types
from tinker.proto.request_conv import forward_backward_request_to_proto
from tinker.types.forward_backward_input import ForwardBackwardInput
from tinker.types.forward_backward_request import ForwardBackwardRequest

from helpers import API_KEY, BASE_MODEL, logprobs_of, read_adapter, sft_batch, sft_datum

pytestmark = pytest.mark.e2e
ADAM = types.AdamParams(learning_rate=1e-2)


def _state_equal(a: dict, b: dict, atol: float = 0.0, rtol: float = 0.0) -> bool:
    return a.keys() == b.keys() and all(torch.allclose(a[k], b[k], atol=atol, rtol=rtol) for k in a)


def test_sdk_flow_and_loss_falls(server, service_client):
    """create -> fb -> optim -> save_state -> load_state(+optimizer) -> from_state; SFT loss falls."""
    tc = service_client.create_lora_training_client(base_model=BASE_MODEL, rank=8, seed=3).result()
    info = tc.get_info()
    assert info.model_data.model_name == BASE_MODEL and info.lora_rank == 8
    batch = sft_batch(8, seed=1)
    losses = []
    for _ in range(20):
        fb = tc.forward_backward(batch, "cross_entropy")
        opt = tc.optim_step(ADAM)
        out = fb.result()
        assert opt.result().metrics["grad_norm"] > 0
        losses.append(out.metrics["loss:sum"])
    assert losses[-1] < 0.5 * losses[0], losses
    # per-datum outputs line up with the request
    out = tc.forward(batch, "cross_entropy").result()
    for d, o in zip(batch, out.loss_fn_outputs):
        n = d.model_input.length
        assert list(o["logprobs"].shape) == [n] and list(o["elementwise_loss"].shape) == [n]

    path = tc.save_state("flow-state").result().path
    assert path == f"tinker://{tc.model_id}/weights/flow-state"
    before = logprobs_of(tc.forward(batch, "cross_entropy").result())
    tc.optim_step(ADAM).result()  # no pending gradient: the weights do not move
    tc.forward_backward(batch, "cross_entropy").result()
    tc.optim_step(ADAM).result()  # now they do
    moved = logprobs_of(tc.forward(batch, "cross_entropy").result())
    assert not all(np.array_equal(a, b) for a, b in zip(before, moved))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)
        tc.load_state(path).result()
        restored = logprobs_of(tc.forward(batch, "cross_entropy").result())
        tc.load_state_with_optimizer(path).result()
    for a, b in zip(before, restored):
        np.testing.assert_array_equal(a, b)

    tc2 = service_client.create_training_client_from_state(path).result()
    tc3 = service_client.create_training_client_from_state_with_optimizer(path).result()
    assert tc2.model_id != tc.model_id and tc2.get_info().lora_rank == 8
    for client in (tc2, tc3):
        got = logprobs_of(client.forward(batch, "cross_entropy").result())
        for a, b in zip(before, got):
            np.testing.assert_array_equal(a, b)
    # with the optimizer restored, one more step from tc3 equals one more step from tc (restored)
    for client in (tc, tc3):
        client.forward_backward(batch, "cross_entropy").result()
        client.optim_step(ADAM).result()
    assert _state_equal(saved_adapter(server, tc, "flow-a"), saved_adapter(server, tc3, "flow-b"))


def saved_adapter(server, tc, name: str) -> dict:
    """The model's current adapter tensors, as the server writes them to disk."""
    return read_adapter(server, tc.save_weights_for_sampler(name).result().path)


def _train_one_step(server, service_client, batches: list[list], seed: int = 0) -> dict:
    tc = service_client.create_lora_training_client(base_model=BASE_MODEL, rank=4, seed=seed).result()
    for b in batches:
        tc.forward_backward(b, "cross_entropy").result()
    tc.optim_step(ADAM).result()
    return saved_adapter(server, tc, "after-step")


def test_split_invariance_and_zero_weights(server, service_client):
    batch = sft_batch(8, seed=7)
    whole = _train_one_step(server, service_client, [batch])
    halves = _train_one_step(server, service_client, [batch[:4], batch[4:]])
    assert _state_equal(whole, halves, atol=1e-6, rtol=1e-5)
    # zero-weight datums add nothing to the update
    zeros = [sft_datum(list(range(5, 25)), [0.0] * 19), sft_datum(list(range(50, 60)), [0.0] * 9)]
    padded = _train_one_step(server, service_client, [batch + zeros])
    assert _state_equal(whole, padded, atol=1e-6, rtol=1e-5)
    # and a batch of only zero weights leaves the adapter exactly as created
    fresh = service_client.create_lora_training_client(base_model=BASE_MODEL, rank=4, seed=0).result()
    init = saved_adapter(server, fresh, "init")
    only_zeros = _train_one_step(server, service_client, [zeros])
    assert _state_equal(init, only_zeros)


def test_forward_backward_custom(service_client):
    tc = service_client.create_lora_training_client(base_model=BASE_MODEL, rank=4).result()
    batch = sft_batch(3, seed=11)

    def loss_fn(data, logprobs_list):
        loss = sum((lp ** 2).sum() for lp in logprobs_list)
        return loss, {"custom_sq:sum": float(loss.detach())}

    out = tc.forward_backward_custom(batch, loss_fn).result()
    lps = logprobs_of(tc.forward(batch, "cross_entropy").result())
    expected = sum(float((lp.astype(np.float64) ** 2).sum()) for lp in lps)
    assert out.metrics["loss:sum"] == pytest.approx(expected, rel=1e-5)
    assert "surrogate_loss:sum" in out.metrics
    assert tc.optim_step(ADAM).result().metrics["grad_norm"] > 0


# -- bad input ----------------------------------------------------------------------------------------

def _proto_body(model_id: str, seq_id: int, data, loss_fn="cross_entropy") -> bytes:
    req = ForwardBackwardRequest(forward_backward_input=ForwardBackwardInput(data=data, loss_fn=loss_fn),
                                 model_id=model_id, seq_id=seq_id)
    return forward_backward_request_to_proto(req).SerializeToString()


@pytest.mark.parametrize("case,needle", [
    ("unknown_loss", "unknown loss_fn"),
    ("missing_input", "needs loss_fn_inputs['weights']"),
    ("missing_rl_input", "needs loss_fn_inputs['advantages']"),
    ("mis_sized", "has shape [3]"),
    ("token_out_of_vocab", "outside the vocabulary"),
    ("target_out_of_vocab", "target token"),
    ("nan_weight", "non-finite"),
    ("inf_advantage", "non-finite"),
    ("gspo_without_ratio_rows", "gspo's sequence ratio has no rows"),
    ("dro_without_beta", "needs loss_fn_config['beta']"),
    ("unknown_config_key", "are not used by"),
])
def test_bad_inputs_rejected_then_training_continues(service_client, case, needle):
    tc = service_client.create_lora_training_client(base_model=BASE_MODEL, rank=4).result()
    good = sft_batch(2, seed=3)
    before = logprobs_of(tc.forward(good, "cross_entropy").result())
    toks = list(range(10, 20))
    loss_fn, cfg, data = "cross_entropy", None, None
    rl_ok = {"target_tokens": toks[1:], "logprobs": [-1.0] * 9, "advantages": [1.0] * 9}
    if case == "unknown_loss":
        loss_fn, data = "cross_entropyy", good
    elif case == "missing_input":
        data = [types.Datum(model_input=types.ModelInput.from_ints(toks[:-1]), loss_fn_inputs={"target_tokens": toks[1:]})]
    elif case == "missing_rl_input":
        loss_fn = "importance_sampling"
        data = [types.Datum(model_input=types.ModelInput.from_ints(toks[:-1]),
                            loss_fn_inputs={"target_tokens": toks[1:], "logprobs": [-1.0] * 9})]
    elif case == "mis_sized":
        data = [types.Datum(model_input=types.ModelInput.from_ints(toks[:-1]),
                            loss_fn_inputs={"target_tokens": toks[1:], "weights": [1.0] * 3})]
    elif case == "token_out_of_vocab":
        data = [sft_datum([5, 6, 10 ** 6, 7])]
    elif case == "target_out_of_vocab":
        data = [sft_datum([5, 6, 7, 10 ** 6])]
    elif case == "nan_weight":
        data = [sft_datum(toks, [1.0, float("nan")] + [1.0] * 7)]
    elif case == "inf_advantage":
        loss_fn = "ppo"
        data = [types.Datum(model_input=types.ModelInput.from_ints(toks[:-1]),
                            loss_fn_inputs={**rl_ok, "advantages": [float("inf")] + [1.0] * 8})]
    elif case == "gspo_without_ratio_rows":
        loss_fn = "gspo"
        data = [types.Datum(model_input=types.ModelInput.from_ints(toks[:-1]),
                            loss_fn_inputs={**rl_ok, "sequence_ratio_mask": [0.0] * 9})]
    elif case in ("dro_without_beta", "unknown_config_key"):
        loss_fn = {"dro_without_beta": "dro", "unknown_config_key": "ppo"}[case]
        cfg = {"clip_epsilon": 0.2} if case == "unknown_config_key" else None
        data = [types.Datum(model_input=types.ModelInput.from_ints(toks[:-1]), loss_fn_inputs=rl_ok)]
    with pytest.raises(tinker.BadRequestError) as err:
        tc.forward_backward(data, loss_fn, loss_fn_config=cfg).result()
    assert needle in str(err.value), str(err.value)
    # the model was not touched, and the next good request (the next seq_id) succeeds
    after = logprobs_of(tc.forward(good, "cross_entropy").result())
    for a, b in zip(before, after):
        np.testing.assert_array_equal(a, b)
    tc.forward_backward(good, "cross_entropy").result()
    assert tc.optim_step(ADAM).result().metrics["grad_norm"] > 0


def test_raw_http_errors(server, service_client):
    tc = service_client.create_lora_training_client(base_model=BASE_MODEL, rank=4).result()
    url = f"{server.base_url}/api/v1/forward_backward"
    proto = {"Content-Type": "application/x-protobuf"}
    with httpx.Client(timeout=30) as http:
        # a key that is not a Tinker key
        r = http.post(url, content=b"", headers={**proto, "X-API-Key": "sk-not-tinker"})
        assert r.status_code == 401 and "tml-" in r.json()["detail"]
        r = http.post(url, content=b"")
        assert r.status_code == 401 and r.json()["detail"]
        auth = {**proto, "X-API-Key": API_KEY}
        # malformed protobuf
        r = http.post(url, content=b"\xff\xfe not a protobuf", headers=auth)
        assert r.status_code == 400 and "malformed" in r.json()["detail"]
        # zstd that is not zstd
        r = http.post(url, content=b"garbage", headers={**auth, "Content-Encoding": "zstd"})
        assert r.status_code == 400 and r.json()["detail"]
        # unknown model id
        body = _proto_body("no-such-model", 1, sft_batch(1))
        r = http.post(url, content=body, headers=auth)
        assert r.status_code == 404 and "no-such-model" in r.json()["detail"]
        # JSON where protobuf is required
        r = http.post(url, json={"model_id": tc.model_id}, headers={"X-API-Key": API_KEY})
        assert r.status_code == 415 and r.json()["detail"]
        # another key cannot see this model
        body = _proto_body(tc.model_id, 1, sft_batch(1))
        r = http.post(url, content=body, headers={**proto, "X-API-Key": "tml-someone-else"})
        assert r.status_code == 404
        # unknown future
        r = http.post(f"{server.base_url}/api/v1/retrieve_future", json={"request_id": "req-nope"},
                      headers={"X-API-Key": API_KEY})
        assert r.status_code == 404 and r.json()["detail"]
    # the model still trains
    tc.forward_backward(sft_batch(2), "cross_entropy").result()
    tc.optim_step(ADAM).result()


def test_idempotent_resubmission(server, service_client):
    """The same (model_id, seq_id) posted twice returns the same request id and is applied once."""
    tc = service_client.create_lora_training_client(base_model=BASE_MODEL, rank=4).result()
    body = _proto_body(tc.model_id, 1, sft_batch(2, seed=5))
    headers = {"Content-Type": "application/x-protobuf", "X-API-Key": API_KEY}
    with httpx.Client(timeout=30) as http:
        ids = {http.post(f"{server.base_url}/api/v1/forward_backward", content=body, headers=headers).json()["request_id"]
               for _ in range(3)}
        assert len(ids) == 1
        opt = {"model_id": tc.model_id, "seq_id": 2, "type": "optim_step",
               "adam_params": {"learning_rate": 0.01, "beta1": 0.9, "beta2": 0.95, "eps": 1e-12,
                               "weight_decay": 0.0, "grad_clip_norm": 0.0}}
        rid = {http.post(f"{server.base_url}/api/v1/optim_step", json=opt, headers={"X-API-Key": API_KEY}).json()["request_id"]
               for _ in range(2)}
        assert len(rid) == 1
        res = http.post(f"{server.base_url}/api/v1/retrieve_future", json={"request_id": rid.pop()},
                        headers={"X-API-Key": API_KEY}).json()
    # applied once: the gradient norm is that of one batch, not of three accumulated
    ref = service_client.create_lora_training_client(base_model=BASE_MODEL, rank=4).result()
    ref.forward_backward(sft_batch(2, seed=5), "cross_entropy").result()
    ref_norm = ref.optim_step(types.AdamParams(learning_rate=0.01)).result().metrics["grad_norm"]
    assert res["metrics"]["grad_norm"] == pytest.approx(ref_norm, rel=1e-5)
