"""Numerical parity of gspo and stable_reinforce: the server vs an in-process PEFT reference.

The datums carry hand-built provenance naming samples recorded by the server: single-turn ones
as recipes/rl_loop.py builds them, and multi-turn ones with two sampled runs from two requests
(turn 2's prompt is turn 1's prompt + answer + a new observation), as
rl/data_processing.trajectory_to_data builds them. Between sampling and training the model takes
one step, so the sampler's logprobs q differ from the trainer's l (off-policy, as in async RL).

The reference recomputes l with plain PEFT from the same checkpoint, writes each loss out again
from its formula (docs/losses.md; gspo as in Tinker's docs code), and compares the per-datum
logprobs, `loss:sum`, every metric, and the gradient, read back through the optimizer as in
test_parity.py (AdamW with eps = lr = 1e8 moves each weight by its gradient).
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from peft import PeftModel
from tinker import types
from transformers import AutoModelForCausalLM

from helpers import BASE_MODEL, checkpoint_dir, model_dir, read_adapter, sft_batch

pytestmark = pytest.mark.e2e
GRAD_PROBE = types.AdamParams(learning_rate=1e8, eps=1e8, beta1=0.9, beta2=0.95, weight_decay=0.0)
KEY = "tml-parity-rl"


def spans(runs, drop):
    """The cookbook's shift: runs of the full sequence minus its first (loss) or last (input) position."""
    runs = [list(r) for r in runs]
    edge = runs[0] if drop == "first" else runs[-1]
    if drop == "first":
        edge[2] += 1
    edge[3] -= 1
    make = {"prompt": types.PromptProvenanceSpan, "sampled": types.SampledProvenanceSpan}
    return [make[kind](sequence_id=sid, offset=offset, length=length) for kind, sid, offset, length in runs]


def datum(parts, advantages_rng) -> tuple[types.Datum, dict]:
    """One datum from full-sequence parts [(kind, sequence_id, offset, tokens, logprobs | None)]."""
    full, q, sampled, runs = [], [], [], []
    for kind, sid, offset, tokens, lps in parts:
        full += tokens
        q += list(lps) if kind == "sampled" else [0.0] * len(tokens)
        sampled += [kind == "sampled"] * len(tokens)
        runs.append((kind, sid, offset, len(tokens)))
    sampled_rows = np.array(sampled[1:])
    adv = np.where(sampled_rows, advantages_rng.normal(0, 1, len(full) - 1), 0).astype(np.float32)
    q_rows = np.float32(q[1:])
    d = types.Datum(model_input=types.ModelInput.from_ints(full[:-1]),
                    loss_fn_inputs={"target_tokens": full[1:], "logprobs": q_rows.tolist(), "advantages": adv.tolist()})
    d = d.with_provenance(model_input=spans(runs, "last"), loss_fn_inputs=spans(runs, "first"))
    return d, {"q": torch.tensor(q_rows), "adv": torch.tensor(adv), "sampled": torch.tensor(sampled_rows)}


@pytest.fixture(scope="module")
def episodes(server):
    """Recorded samples (single- and multi-turn), then one step off-policy; the start checkpoint."""
    with server.client(KEY) as sc:
        tc = sc.create_lora_training_client(base_model=BASE_MODEL, rank=8, seed=7).result()
        for _ in range(2):
            tc.forward_backward(sft_batch(6, seed=4), "cross_entropy").result()
            tc.optim_step(types.AdamParams(learning_rate=5e-3)).result()
        sampler = tc.save_weights_and_get_sampling_client(record_stability_info=True).result()
        params = types.SamplingParams(max_tokens=5, stop=[], seed=11)
        rng = np.random.default_rng(0)
        data, ref = [], []
        for prompt in ([31, 32, 33, 34], [41, 42, 43, 44, 45, 46]):
            turn1 = sampler.sample(types.ModelInput.from_ints(prompt), 2, params).result().sequences
            for seq in turn1:  # single-turn, rl_loop's layout
                d, r = datum([("prompt", seq.sequence_id, 0, prompt, None),
                              ("sampled", seq.sequence_id, 0, list(seq.tokens), seq.logprobs)], rng)
                data.append(d), ref.append(r)
            first = turn1[0]
            observation = [51, 52, 53]
            prompt2 = prompt + list(first.tokens) + observation
            second = sampler.sample(types.ModelInput.from_ints(prompt2), 1,
                                    types.SamplingParams(max_tokens=4, stop=[], seed=12)).result().sequences[0]
            d, r = datum([("prompt", first.sequence_id, 0, prompt, None),
                          ("sampled", first.sequence_id, 0, list(first.tokens), first.logprobs),
                          ("prompt", second.sequence_id, len(prompt) + len(first.tokens), observation, None),
                          ("sampled", second.sequence_id, 0, list(second.tokens), second.logprobs)], rng)
            data.append(d), ref.append(r)
        tc.forward_backward(sft_batch(6, seed=5), "cross_entropy").result()  # off-policy from here on
        tc.optim_step(types.AdamParams(learning_rate=5e-3)).result()
        start = tc.save_state("rl-parity-start").result().path
        yield sc, start, data, ref


def reference_model(server, start):
    base = AutoModelForCausalLM.from_pretrained(str(model_dir(server)), dtype=torch.float32)
    ref = PeftModel.from_pretrained(base, str(checkpoint_dir(server, start)), is_trainable=True)
    ref.eval()
    return ref


def stable_reinforce_reference(lp, r, beta):
    s = r["sampled"]
    diff = lp - r["q"]
    loss = (-r["adv"] * lp + 0.5 * beta * diff * diff)[s].sum()
    return loss, {"pg_loss:sum": (-r["adv"] * lp)[s].sum().item(),
                  "kl_penalty:sum": (0.5 * beta * diff * diff)[s].sum().item(),
                  "sampled_tokens:sum": int(s.sum()), "diff": (r["q"] - lp)[s].mean().item()}


def gspo_reference(lp, r, lo, hi, mask):
    """Tinker's documented GSPO code: one ratio per datum over the rows in the mask, then clipping."""
    in_ratio = mask != 0
    log_ratio = (lp.detach() - r["q"])[in_ratio].mean()
    ratio = torch.exp(log_ratio + lp - lp.detach())
    loss = -torch.minimum(ratio * r["adv"], torch.clamp(ratio, lo, hi) * r["adv"]).sum()
    s = torch.exp(log_ratio)
    outside = (s < torch.as_tensor(lo)) | (s > torch.as_tensor(hi))
    clipped = outside.expand_as(lp)[in_ratio].float().mean()
    return loss, {"seq_ratio": s.item(), "clipped": clipped.item()}


CASES = [
    ("stable_reinforce", None),
    ("stable_reinforce", {"kl_coeff": 2.0}),
    ("gspo", None),  # rl/train.py: no mask (the sampled provenance rows), default bounds
    ("gspo", {"clip_low_threshold": 0.995, "clip_high_threshold": 1.005}),  # rl_loop: a mask, tight bounds
]


@pytest.mark.parametrize("loss_fn,cfg", CASES, ids=[f"{l}-{bool(c)}" for l, c in CASES])
def test_rl_loss_matches_peft_reference(server, episodes, loss_fn, cfg):
    sc, start, data, ref = episodes
    rng = np.random.default_rng(1)
    per_row = []
    if loss_fn == "gspo" and cfg is not None:
        # rl_loop's mask, plus per-row bounds on some datums (they override the config for their row)
        for i, (d, r) in enumerate(zip(data, ref)):
            n = len(r["q"])
            inputs = {**d.loss_fn_inputs, "sequence_ratio_mask": r["sampled"].float().numpy()}
            lo, hi = np.full(n, 0.995, np.float32), np.full(n, 1.005, np.float32)
            if i % 2:
                lo, hi = rng.uniform(0.5, 1.0, n).astype(np.float32), rng.uniform(1.0, 1.5, n).astype(np.float32)
                inputs.update(clip_low_threshold=lo, clip_high_threshold=hi)
            per_row.append((torch.tensor(lo), torch.tensor(hi)))
            data[i] = types.Datum(model_input=d.model_input, loss_fn_inputs=inputs,
                                  model_input_spans=d.model_input_spans, loss_fn_input_spans=d.loss_fn_input_spans)
    tc = sc.create_training_client_from_state(start).result()
    out = tc.forward_backward(data, loss_fn, loss_fn_config=cfg).result()
    step = tc.optim_step(GRAD_PROBE).result()
    after = read_adapter(server, tc.save_weights_for_sampler(f"rl-parity-{loss_fn}-{bool(cfg)}").result().path)

    model = reference_model(server, start)
    total = torch.zeros((), dtype=torch.float32)
    metrics = []
    for i, (d, r, o) in enumerate(zip(data, ref, out.loss_fn_outputs)):
        ids = torch.tensor(d.model_input.to_ints())[None]
        targets = torch.tensor(d.loss_fn_inputs["target_tokens"].to_numpy()).long()
        lp = torch.log_softmax(model(input_ids=ids).logits[0].float(), -1).gather(-1, targets[:, None])[:, 0]
        np.testing.assert_allclose(o["logprobs"].to_numpy(), lp.detach().numpy(), atol=2e-5, rtol=0)
        if loss_fn == "stable_reinforce":
            loss, m = stable_reinforce_reference(lp, r, (cfg or {}).get("kl_coeff", 0.01))
        else:
            lo, hi = per_row[i] if per_row else (0.8, 1.2)
            loss, m = gspo_reference(lp, r, lo, hi, r["sampled"])
        total = total + loss
        metrics.append(m)
    assert out.metrics["loss:sum"] == pytest.approx(total.item(), rel=1e-5, abs=1e-4)
    if loss_fn == "stable_reinforce":
        assert out.metrics["pg_loss:sum"] == pytest.approx(sum(m["pg_loss:sum"] for m in metrics), rel=1e-5, abs=1e-4)
        assert out.metrics["kl_penalty:sum"] == pytest.approx(sum(m["kl_penalty:sum"] for m in metrics), rel=1e-4,
                                                              abs=1e-5)
        assert out.metrics["sampled_tokens:sum"] == sum(m["sampled_tokens:sum"] for m in metrics)
        assert out.metrics["sampler_trainer_logprob_diff:mean"] == pytest.approx(
            np.mean([m["diff"] for m in metrics]), abs=1e-5)
        assert abs(out.metrics["sampler_trainer_logprob_diff:mean"]) > 1e-3  # really off-policy
        assert out.metrics["datum_logprobs_mismatch:max"] == 0.0  # the SDK's copy equals the record
    else:
        assert out.metrics["seq_ratio:mean"] == pytest.approx(np.mean([m["seq_ratio"] for m in metrics]), rel=1e-5)
        assert out.metrics["seq_clipped_frac:mean"] == pytest.approx(np.mean([m["clipped"] for m in metrics]),
                                                                     abs=1e-6)
    if cfg and loss_fn == "gspo":
        assert out.metrics["seq_clipped_frac:mean"] > 0  # the tight bounds clip some datums...
    total.backward()

    start_tensors = read_adapter(server, start)
    grads = {n.replace(".default", ""): p.grad for n, p in model.named_parameters() if p.requires_grad}
    assert set(grads) == set(start_tensors) == set(after)
    ref_norm = torch.linalg.vector_norm(torch.stack([torch.linalg.vector_norm(g) for g in grads.values()]))
    assert ref_norm > 0 and step.metrics["grad_norm"] == pytest.approx(ref_norm.item(), rel=1e-4)
    for name, g in grads.items():
        server_grad = start_tensors[name] - after[name]
        torch.testing.assert_close(server_grad, g, atol=1e-4 + 1e-3 * g.abs().max().item(), rtol=1e-3)
