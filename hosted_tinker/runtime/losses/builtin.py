"""The built-in losses of `tinker==0.38`, each one function and one `Loss` entry beside it
(docs/losses.md says what each computes). To add a loss, add both here and name the entry in
`LOSSES`: the entry's declared inputs are all that validation needs (validation.py).

Every loss is a **sum** over tokens and datums, never a mean, and a function of one row's own
tensors: a datum's result never depends on its batch. What a loss needs from the server (per-row
clip bounds from the config, gspo's ratio rows, stable_reinforce's recorded logprobs) its entry
derives before the request is queued.
"""

from __future__ import annotations

import numpy as np
import torch

from .entry import CLIP_KEYS, DatumInputs, Loss, LossInputError, LossOut, as_rows, clip_bounds, request_datums

RL_INPUTS = ("target_tokens", "logprobs", "advantages")


# -- what entries share -------------------------------------------------------------------------
def check_clip_order(config: dict[str, float]) -> None:
    lo, hi = (config[k] for k in CLIP_KEYS)
    if lo > hi:
        raise LossInputError(f"clip_low_threshold {lo} is above clip_high_threshold {hi}")


def derive_request_datums(d: DatumInputs) -> dict[str, np.ndarray]:
    """The number of datums in the request, on every row: turns per-row sums into means."""
    return {"request_datums": np.full(d.length, d.num_datums, np.float32)}


def derive_clip_rows(d: DatumInputs) -> dict[str, np.ndarray]:
    """Per-row clip bounds: a per-row tensor overrides the config for its row."""
    lo, hi = (d.inputs[k] if k in d.inputs else np.full(d.length, d.config[k], np.float32) for k in CLIP_KEYS)
    above = np.flatnonzero(lo > hi)
    if above.size:
        p = int(above[0])
        raise LossInputError(f"datum {d.index}: clip_low_threshold {float(lo[p]):g} is above "
                             f"clip_high_threshold {float(hi[p]):g} at position {p}")
    return {"clip_low_threshold": lo, "clip_high_threshold": hi}


# -- cross_entropy, importance_sampling, ppo, cispo, dro ------------------------------------------
def cross_entropy(lp, inputs, config) -> LossOut:
    return LossOut(-(lp * inputs["weights"]))


def importance_sampling(lp, inputs, config) -> LossOut:
    return LossOut(-(torch.exp(lp - inputs["logprobs"]) * inputs["advantages"]))


def ppo(lp, inputs, config) -> LossOut:
    ratio, adv = torch.exp(lp - inputs["logprobs"]), inputs["advantages"]
    lo, hi = clip_bounds(config, inputs)
    return LossOut(-torch.minimum(ratio * adv, torch.clamp(ratio, lo, hi) * adv))


def cispo(lp, inputs, config) -> LossOut:
    ratio = torch.exp(lp - inputs["logprobs"])
    lo, hi = clip_bounds(config, inputs)
    return LossOut(-(torch.clamp(ratio, lo, hi).detach() * lp * inputs["advantages"]))


def dro(lp, inputs, config) -> LossOut:
    diff = lp - inputs["logprobs"]
    return LossOut(-(lp * inputs["advantages"] - 0.5 * config["beta"] * diff * diff))


CROSS_ENTROPY = Loss("cross_entropy", cross_entropy, ("target_tokens", "weights"), topk_targets=True)
IMPORTANCE_SAMPLING = Loss("importance_sampling", importance_sampling, RL_INPUTS)
# Ratio bounds (not epsilons), with the documented defaults.
PPO = Loss("ppo", ppo, RL_INPUTS, {"clip_low_threshold": 0.8, "clip_high_threshold": 1.2}, check_clip_order,
           inputs=CLIP_KEYS, derive=(derive_clip_rows,), optional_inputs=CLIP_KEYS)
CISPO = Loss("cispo", cispo, RL_INPUTS, {"clip_low_threshold": 0.0, "clip_high_threshold": 4.0}, check_clip_order,
             inputs=CLIP_KEYS, derive=(derive_clip_rows,), optional_inputs=CLIP_KEYS)
# No documented default for beta: asking for it beats silently picking one.
DRO = Loss("dro", dro, RL_INPUTS, {"beta": None})


# -- gspo ---------------------------------------------------------------------------------------
def gspo(lp, inputs, config) -> LossOut:
    """GSPO-token: one importance ratio per datum, s = exp(mean over M of (sg(l) - q)); row t has
    the value s and the gradient s * grad(l_t); loss = -sum_t min(s_t A_t, clamp(s_t, lo_t, hi_t) A_t).

    log s is a constant of the graph (it uses sg(l)), so it is computed on the CPU in float64, row
    by row over that row's own values: a datum's ratio never depends on the rows it is batched with.
    """
    adv = inputs["advantages"]
    m = as_rows(inputs["sequence_ratio_mask"])
    count = m.sum(-1)
    diff = (as_rows(lp) - as_rows(inputs["logprobs"])) * m
    log_s = np.where(count > 0, diff.sum(-1) / np.maximum(count, 1), 0.0)
    s = np.exp(log_s)
    s_col = torch.as_tensor(s, dtype=lp.dtype, device=lp.device)[:, None]
    if lp.ndim == 1:
        s_col = s_col[0]
    ratio = s_col * torch.exp(lp - lp.detach())
    lo, hi = clip_bounds(config, inputs)
    loss = -torch.minimum(ratio * adv, torch.clamp(ratio, lo, hi) * adv)
    lo_r, hi_r = (as_rows(b) if torch.is_tensor(b) else np.full_like(m, b) for b in (lo, hi))
    clipped = (((s[:, None] < lo_r) | (s[:, None] > hi_r)) * m).sum(-1) / np.maximum(count, 1)
    datums = request_datums(inputs, len(s))
    return LossOut(loss, {"seq_ratio:mean": s / datums, "seq_clipped_frac:mean": clipped / datums})


def derive_gspo_ratio_rows(d: DatumInputs) -> dict[str, np.ndarray]:
    """M, the rows gspo's sequence ratio averages over, as 0/1 float32.

    Without `sequence_ratio_mask` (rl/train.py sends none): the rows under sampled provenance
    runs, else the rows with nonzero advantages. An empty M gives no ratio, which is only
    acceptable when the datum has nothing to train (all advantages 0).
    """
    adv = d.inputs["advantages"]
    if "sequence_ratio_mask" in d.inputs:
        rows = d.inputs["sequence_ratio_mask"] != 0
    elif d.sampled_rows is not None:
        rows = d.sampled_rows
    else:
        rows = adv != 0
    if not rows.any() and adv.any():
        p = int(np.flatnonzero(adv)[0])
        raise LossInputError(
            f"datum {d.index}: gspo's sequence ratio has no rows (sequence_ratio_mask is all zero) but "
            f"advantages[{p}] is {float(adv[p])!r}")
    return {"sequence_ratio_mask": rows.astype(np.float32)}


# The docs do not show gspo's defaults; ppo's bounds (ours).
GSPO = Loss("gspo", gspo, RL_INPUTS, {"clip_low_threshold": 0.8, "clip_high_threshold": 1.2}, check_clip_order,
            inputs=(*CLIP_KEYS, "request_datums", "sequence_ratio_mask"),
            derive=(derive_request_datums, derive_clip_rows, derive_gspo_ratio_rows), host_side=True,
            optional_inputs=(*CLIP_KEYS, "sequence_ratio_mask"))


# -- stable_reinforce -----------------------------------------------------------------------------
def stable_reinforce_v0(lp, inputs, config) -> LossOut:
    """hosted-tinker's stable REINFORCE, version 0 (docs/losses.md): on the sampled rows S,

        loss = sum_{t in S} [ -A_t l_t + kl_coeff * 1/2 (l_t - q_t)^2 ],  q = the RECORDED sampler logprob

    REINFORCE plus a quadratic pull towards the sampler's logprobs: no exp(l - q), so stale or
    numerically skewed samples cannot blow up the update.
    """
    sampled, adv, q = inputs["sampled_rows"], inputs["advantages"], inputs["recorded_logprobs"]
    diff = lp - q
    pg = -(adv * lp) * sampled
    kl = (0.5 * config["kl_coeff"]) * diff * diff * sampled
    s, d = as_rows(sampled), as_rows(diff)
    n_sampled = s.sum(-1)
    mean_diff = -(d * s).sum(-1) / np.maximum(n_sampled, 1)  # q - l over S
    datums = request_datums(inputs, len(n_sampled))
    return LossOut(pg + kl, {
        "pg_loss:sum": as_rows(pg).sum(-1), "kl_penalty:sum": as_rows(kl).sum(-1), "sampled_tokens:sum": n_sampled,
        "sampler_trainer_logprob_diff:mean": mean_diff / datums,
        "datum_logprobs_mismatch:max": as_rows(inputs["logprobs_mismatch"]).max(-1)
        if "logprobs_mismatch" in inputs else np.zeros_like(n_sampled),
    })


# The version in service; a later objective replaces this one name (and docs/losses.md).
STABLE_REINFORCE = stable_reinforce_v0


def check_kl_coeff(config: dict[str, float]) -> None:
    if config["kl_coeff"] < 0:
        raise LossInputError(f"loss_fn_config['kl_coeff'] must be >= 0, got {config['kl_coeff']}")


def derive_recorded_samples(d: DatumInputs) -> dict[str, np.ndarray]:
    """The recorded sampler logprob and a 1 on the sampled rows, and |datum logprobs - recorded|
    there (the client's `logprobs` are optional: they only feed a metric)."""
    if d.sampled_rows is None or d.recorded_logprobs is None:
        raise ValueError("stable_reinforce needs resolved provenance")  # the API resolves it first
    rows, recorded = d.sampled_rows, d.recorded_logprobs
    mismatch = np.zeros(d.length, np.float32)
    if "logprobs" in d.inputs:
        mismatch[rows] = np.abs(d.inputs["logprobs"][rows] - recorded[rows])
    return {"recorded_logprobs": recorded, "sampled_rows": rows.astype(np.float32), "logprobs_mismatch": mismatch}


# kl_coeff is the only key Tinker names; its default there is not public (0.01 is ours).
STABLE_REINFORCE_LOSS = Loss(
    "stable_reinforce", STABLE_REINFORCE, ("target_tokens", "advantages"), {"kl_coeff": 0.01}, check_kl_coeff,
    inputs=("recorded_logprobs", "sampled_rows", "request_datums", "logprobs_mismatch"),
    derive=(derive_request_datums, derive_recorded_samples), needs_recorded_samples=True, host_side=True,
    optional_inputs=("logprobs",))


LOSSES: dict[str, Loss] = {loss.name: loss for loss in (
    CROSS_ENTROPY, IMPORTANCE_SAMPLING, PPO, CISPO, DRO, GSPO, STABLE_REINFORCE_LOSS)}

# Names the SDK knows that we do not implement. Each gets an explicit refusal, never a fallback.
KNOWN_UNSUPPORTED = {
    "custom": "server-side custom losses are not enabled; forward_backward_custom runs the loss "
    "on the client (the default), which this server supports",
}
