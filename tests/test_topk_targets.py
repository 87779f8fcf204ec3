"""cross_entropy with (N, K) target_tokens and weights through the real SDK (issue 27): top-K
distillation as the cookbook's sdft sends it, and forward_backward_custom whose loss reads the
per-position top-K logprobs. Values are checked against a plain forward of the same model in the
test (a fresh adapter leaves the base model's outputs unchanged): log_softmax, gather, and the
weighted sum over positions and the K targets.
"""

from __future__ import annotations

import numpy as np
import pytest
import tinker
import torch
from tinker import types
from transformers import AutoModelForCausalLM

from helpers import BASE_MODEL, VOCAB, model_dir, read_adapter, sft_batch

pytestmark = pytest.mark.e2e
ADAM = types.AdamParams(learning_rate=1e-2)
K = 4
TOL = dict(rtol=1e-5, atol=1e-5)


@pytest.fixture(scope="module")
def base(server) -> torch.nn.Module:
    return AutoModelForCausalLM.from_pretrained(str(model_dir(server)), dtype=torch.float32).eval()


def plain_logprobs(model: torch.nn.Module, tokens: list[int], targets: torch.Tensor) -> torch.Tensor:
    """[N, K]: log p(targets[i, k]) at position i, from one forward of the plain model."""
    with torch.no_grad():
        logits = model(input_ids=torch.tensor([tokens])).logits[0].float()
    return torch.log_softmax(logits, -1).gather(-1, targets)


def topk_batch(n: int, seed: int, k: int = K) -> list[types.Datum]:
    """Distillation-like datums: on the first positions (the prompt) all weights are 0, elsewhere a
    teacher's renormalised top-K probabilities; sent as torch tensors, which the SDK sends as
    sparse CSR where that is smaller."""
    rng = np.random.default_rng(seed)
    out = []
    for _ in range(n):
        length = int(rng.integers(8, 24))
        tokens = rng.integers(0, VOCAB, length).tolist()
        targets = torch.as_tensor(rng.integers(0, VOCAB, (length, k)))
        probs = torch.softmax(torch.as_tensor(rng.normal(size=(length, k)), dtype=torch.float32), -1)
        probs[: length // 2] = 0.0
        out.append(types.Datum(model_input=types.ModelInput.from_ints(tokens),
                               loss_fn_inputs={"target_tokens": targets, "weights": probs}))
    return out


def inputs_of(datum: types.Datum) -> tuple[list[int], torch.Tensor, torch.Tensor]:
    return (datum.model_input.to_ints(), datum.loss_fn_inputs["target_tokens"].to_torch(),
            datum.loss_fn_inputs["weights"].to_torch())


def columns(data: list[types.Datum]) -> list[types.Datum]:
    """Each (N, K) datum as K (N,) datums, one per column of its targets and weights."""
    out = []
    for d in data:
        tokens, targets, weights = inputs_of(d)
        out += [types.Datum(model_input=d.model_input,
                            loss_fn_inputs={"target_tokens": targets[:, j].tolist(), "weights": weights[:, j].tolist()})
                for j in range(targets.shape[1])]
    return out


def trained(server, service_client, step) -> dict[str, torch.Tensor]:
    """A fresh adapter's tensors after `step(tc)` and one optimizer step."""
    tc = service_client.create_lora_training_client(base_model=BASE_MODEL, rank=4, seed=1).result()
    step(tc)
    tc.optim_step(ADAM).result()
    return read_adapter(server, tc.save_weights_for_sampler("after").result().path)


def assert_same_adapter(a: dict, b: dict) -> None:
    assert a.keys() == b.keys()
    for key in a:
        np.testing.assert_allclose(a[key].numpy(), b[key].numpy(), rtol=1e-5, atol=1e-6, err_msg=key)


def test_topk_cross_entropy_values_and_update(server, service_client, base):
    """Logprobs [N, K] and elementwise_loss [N] as the plain model gives them, loss:sum the weighted
    sum over positions and K; the update is that of the K one-target datums of each column."""
    batch = topk_batch(3, seed=1)
    got = {}

    def step(tc):
        got["fb"] = tc.forward_backward(batch, "cross_entropy").result()
        got["forward"] = tc.forward(batch, "cross_entropy").result()  # forward_only: the same values

    updated = trained(server, service_client, step)
    total = 0.0
    for datum, fb, fwd in zip(batch, got["fb"].loss_fn_outputs, got["forward"].loss_fn_outputs, strict=True):
        tokens, targets, weights = inputs_of(datum)
        want = plain_logprobs(base, tokens, targets)
        assert fb["logprobs"].shape == [len(tokens), K] and fb["elementwise_loss"].shape == [len(tokens)]
        np.testing.assert_allclose(fb["logprobs"].to_numpy(), want.numpy(), **TOL)
        np.testing.assert_array_equal(fwd["logprobs"].to_numpy(), fb["logprobs"].to_numpy())
        np.testing.assert_allclose(fb["elementwise_loss"].to_numpy(), (-(want * weights).sum(-1)).numpy(), **TOL)
        total += float(-(want.double() * weights.double()).sum())
    assert got["fb"].metrics["loss:sum"] == pytest.approx(total, rel=1e-5)
    by_columns = trained(server, service_client,
                         lambda tc: tc.forward_backward(columns(batch), "cross_entropy").result())
    assert_same_adapter(updated, by_columns)


def test_forward_backward_custom_reads_topk_logprobs(server, service_client, base):
    """A Brier loss over each position's top-K (as decisions' custom losses are): the SDK's forward
    hands it [N, K] logprobs, its value is the plain model's, and its update is that of the linear
    loss it sends back (cross_entropy with weights -dC/dlogprobs, (N, K) too)."""
    batch = topk_batch(2, seed=2)
    shapes = []

    def brier(data, logprobs_list):
        shapes.extend(list(lp.shape) for lp in logprobs_list)
        loss = sum(((lp.exp() - d.loss_fn_inputs["weights"].to_torch()) ** 2).sum()
                   for d, lp in zip(data, logprobs_list, strict=True))
        return loss, {"brier:sum": float(loss.detach())}

    got = {}
    updated = trained(server, service_client,
                      lambda tc: got.setdefault("out", tc.forward_backward_custom(batch, brier).result()))
    assert shapes == [[d.model_input.length, K] for d in batch]
    want, linear = 0.0, []
    for datum in batch:
        tokens, targets, weights = inputs_of(datum)
        lp = plain_logprobs(base, tokens, targets).requires_grad_(True)
        loss = ((lp.exp() - weights) ** 2).sum()
        loss.backward()
        want += float(loss.detach())
        linear.append(types.Datum(model_input=datum.model_input,
                                  loss_fn_inputs={"target_tokens": targets, "weights": -lp.grad}))
    assert got["out"].metrics["loss:sum"] == pytest.approx(want, rel=1e-5)
    assert "surrogate_loss:sum" in got["out"].metrics
    by_linear_loss = trained(server, service_client, lambda tc: tc.forward_backward(linear, "cross_entropy").result())
    assert_same_adapter(updated, by_linear_loss)


def with_inputs(datum: types.Datum, **inputs) -> types.Datum:
    return types.Datum(model_input=datum.model_input, loss_fn_inputs={**datum.loss_fn_inputs, **inputs})


def test_wrong_topk_shapes_are_400s_naming_field_and_shape(service_client):
    """Each mistake is a 400 that names the datum, the field and the shape expected; the model is
    untouched and trains on."""
    tc = service_client.create_lora_training_client(base_model=BASE_MODEL, rank=4).result()
    good = topk_batch(2, seed=3)
    n = good[0].model_input.length
    before = tc.forward(good, "cross_entropy").result().loss_fn_outputs[0]["logprobs"].to_numpy()
    rl = {"logprobs": torch.zeros(n), "advantages": torch.ones(n)}
    cases = [
        ([with_inputs(good[0], weights=torch.ones(n))], "cross_entropy",
         f"datum 0: loss_fn_inputs['weights'] has shape [{n}], expected [{n}, {K}] (one weight per target)"),
        ([with_inputs(good[0], target_tokens=list(range(n)))], "cross_entropy",
         f"datum 0: loss_fn_inputs['weights'] has shape [{n}, {K}], expected [{n}]"),
        ([good[0], *topk_batch(1, seed=4, k=K - 1)], "cross_entropy",
         f"datum 1: loss_fn_inputs['target_tokens'] has shape [N, {K - 1}] but datum 0's is [N, {K}]"),
        (topk_batch(1, seed=5, k=101), "cross_entropy",
         "expected [{0}] or [{0}, K] with 1 <= K <= 100 (this server's max_targets_per_position)"),
        ([with_inputs(good[0], **rl)], "importance_sampling",
         f"datum 0: loss_fn_inputs['target_tokens'] has shape [{n}, {K}], expected [{n}] (one target per "
         "model_input token): loss 'importance_sampling'"),
    ]
    for data, loss_fn, needle in cases:
        needle = needle.format(data[0].model_input.length)
        with pytest.raises(tinker.BadRequestError) as err:
            tc.forward_backward(data, loss_fn).result()
        assert needle in str(err.value), str(err.value)
    after = tc.forward(good, "cross_entropy").result().loss_fn_outputs[0]["logprobs"].to_numpy()
    np.testing.assert_array_equal(before, after)
    tc.forward_backward(good, "cross_entropy").result()
    tc.forward_backward(sft_batch(2), "cross_entropy").result()  # (N,) and (N, K) requests of one model
    assert tc.optim_step(ADAM).result().metrics["grad_norm"] > 0
