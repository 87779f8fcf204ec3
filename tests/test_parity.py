"""Numerical parity (issue 2, test 2): the server vs an in-process PEFT/transformers reference.

For each built-in loss, the server's per-token logprobs, its `loss:sum`, and the adapter gradient
of one step equal what a plain PEFT model computes in this process, in float32. The losses are
written out again here from Tinker's documented formulas, independently of the server's code.

The gradient is read back through the optimizer: with AdamW's eps = lr = 1e8, the first step
moves every weight by lr * g / (|g| + eps) = g to within |g| / 1e8, so (old - new) is the
server's gradient; the step's `grad_norm` metric is compared too.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from peft import PeftModel
from tinker import types
from transformers import AutoModelForCausalLM

from helpers import BASE_MODEL, checkpoint_dir, logprobs_of, model_dir, read_adapter, rl_datum, sft_batch, sft_datum

pytestmark = pytest.mark.e2e
GRAD_PROBE = types.AdamParams(learning_rate=1e8, eps=1e8, beta1=0.9, beta2=0.95, weight_decay=0.0)


def reference_loss(loss_fn: str, cfg: dict, lp: torch.Tensor, inputs: dict) -> torch.Tensor:
    if loss_fn == "cross_entropy":
        return -(lp * inputs["weights"]).sum()
    adv, old = inputs["advantages"], inputs["logprobs"]
    ratio = torch.exp(lp - old)
    if loss_fn == "importance_sampling":
        return -(ratio * adv).sum()
    if loss_fn == "ppo":
        lo, hi = cfg.get("clip_low_threshold", 0.8), cfg.get("clip_high_threshold", 1.2)
        return -torch.minimum(ratio * adv, torch.clamp(ratio, lo, hi) * adv).sum()
    if loss_fn == "cispo":
        lo, hi = cfg.get("clip_low_threshold", 0.0), cfg.get("clip_high_threshold", 4.0)
        return -(torch.clamp(ratio, lo, hi).detach() * lp * adv).sum()
    if loss_fn == "dro":
        return -(lp * adv - 0.5 * cfg["beta"] * (lp - old) ** 2).sum()
    raise AssertionError(loss_fn)


@pytest.fixture(scope="module")
def trained_start(server):
    """A checkpoint whose adapter is non-trivial (B != 0), shared by every loss case."""
    with server.client("tml-parity") as sc:
        tc = sc.create_lora_training_client(base_model=BASE_MODEL, rank=8, seed=5).result()
        for _ in range(3):
            tc.forward_backward(sft_batch(6, seed=2), "cross_entropy").result()
            tc.optim_step(types.AdamParams(learning_rate=5e-3)).result()
        path = tc.save_state("parity-start").result().path
        yield sc, path


def _rl_batch(reference_lps: list[np.ndarray], seed: int) -> list:
    """RL datums whose sampling logprobs are near the current ones, so ratios straddle the clips."""
    rng = np.random.default_rng(seed)
    out = []
    for toks, lp in reference_lps:
        old = (lp + rng.normal(0, 0.3, lp.shape)).astype(np.float32)
        adv = rng.normal(0, 1, lp.shape).astype(np.float32)
        adv[:2] = 0.0  # masked prompt positions, as the cookbook sends them
        out.append(rl_datum(toks, old.tolist(), adv.tolist()))
    return out


CASES = [
    ("cross_entropy", None),
    ("importance_sampling", None),
    ("ppo", None),
    ("ppo", {"clip_low_threshold": 0.9, "clip_high_threshold": 1.1}),
    ("cispo", None),
    ("dro", {"beta": 0.1}),
]


@pytest.mark.parametrize("loss_fn,cfg", CASES, ids=[f"{l}-{bool(c)}" for l, c in CASES])
def test_server_matches_peft_reference(server, trained_start, loss_fn, cfg):
    sc, start = trained_start
    tc = sc.create_training_client_from_state(start).result()
    rng = np.random.default_rng(0)
    seqs = [rng.integers(0, 1000, n).tolist() for n in (9, 17, 12, 5)]
    if loss_fn == "cross_entropy":
        # negative and non-binary weights, as forward_backward_custom sends them
        data = [sft_datum(s, rng.normal(0, 1.5, len(s) - 1).astype(np.float32).tolist()) for s in seqs]
    else:
        probe = tc.forward([sft_datum(s) for s in seqs], "cross_entropy").result()
        data = _rl_batch(list(zip(seqs, logprobs_of(probe))), seed=1)
    out = tc.forward_backward(data, loss_fn, loss_fn_config=cfg).result()
    step = tc.optim_step(GRAD_PROBE).result()
    after = read_adapter(server, tc.save_weights_for_sampler("parity-after").result().path)

    # -- the reference: plain PEFT on the same base weights and the same starting adapter
    base = AutoModelForCausalLM.from_pretrained(str(model_dir(server)), dtype=torch.float32)
    ref = PeftModel.from_pretrained(base, str(checkpoint_dir(server, start)), is_trainable=True)
    ref.eval()
    total = torch.zeros((), dtype=torch.float32)
    for d, o in zip(data, out.loss_fn_outputs):
        ids = torch.tensor(d.model_input.to_ints())[None]
        inputs = {k: torch.tensor(v.to_numpy()) for k, v in d.loss_fn_inputs.items()}
        logits = ref(input_ids=ids).logits[0].float()
        lp = torch.log_softmax(logits, -1).gather(-1, inputs["target_tokens"].long()[:, None])[:, 0]
        np.testing.assert_allclose(o["logprobs"].to_numpy(), lp.detach().numpy(), atol=2e-5, rtol=0)
        total = total + reference_loss(loss_fn, cfg or {}, lp, inputs)
    assert out.metrics["loss:sum"] == pytest.approx(total.item(), rel=1e-5, abs=1e-4)
    total.backward()

    start_tensors = read_adapter(server, start)
    grads = {n.replace(".default", ""): p.grad for n, p in ref.named_parameters() if p.requires_grad}
    assert set(grads) == set(start_tensors) == set(after)
    ref_norm = torch.linalg.vector_norm(torch.stack([torch.linalg.vector_norm(g) for g in grads.values()]))
    assert step.metrics["grad_norm"] == pytest.approx(ref_norm.item(), rel=1e-4)
    for name, g in grads.items():
        server_grad = start_tensors[name] - after[name]
        torch.testing.assert_close(server_grad, g, atol=1e-4 + 1e-3 * g.abs().max().item(), rtol=1e-3)
