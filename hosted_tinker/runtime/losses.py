"""The built-in Tinker losses, with Tinker's contract: every loss is a **sum** over tokens and
datums, never a mean (see shared/reference/losses.md and docs/losses.md).

Sums are what make the server exact under the SDK's chunking (one call of 8 datums equals two
calls of 4), what `forward_backward_custom` relies on (it sends `weights = -dC/dlogprobs` to
cross_entropy), and what lets one fused pass carry many tenants: the gradient of a sum of
independent per-datum losses with respect to one adapter is that adapter's own gradient.

Validation lives here too, so the API can reject a bad request before it is queued and the
model is never touched by it. `prepare_inputs` then hands the trainer exactly the per-token
tensors a loss reads, with what the server derives filled in (per-row clip bounds from the
config, gspo's ratio rows, stable_reinforce's recorded logprobs), so that every loss below is a
function of one row's own tensors and a datum's result never depends on its batch.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Callable

import numpy as np
import torch

from ..errors import UserError

RL_INPUTS = ("target_tokens", "logprobs", "advantages")
CLIP_KEYS = ("clip_low_threshold", "clip_high_threshold")
# Per-token float inputs a user may send (the SDK's float32 keys), checked for shape and finiteness.
PER_TOKEN_FLOAT = ("weights", "logprobs", "advantages", *CLIP_KEYS, "sequence_ratio_mask")
# Per-token inputs the server derives in `prepare_inputs`; a user's tensor of the same name is dropped.
DERIVED = (
    "recorded_logprobs",  # stable_reinforce: the recorded sampler logprob on sampled rows
    "sampled_rows",  # stable_reinforce: 1 on the loss rows under sampled provenance runs
    "request_datums",  # the number of datums in the request, on every row: turns per-row sums into means
    "logprobs_mismatch",  # stable_reinforce: |datum logprobs - recorded| on sampled rows
)
# Per-token float inputs the trainer pads into [rows, width] tensors for `run_losses`.
LOSS_INPUT_KEYS = (*PER_TOKEN_FLOAT, *DERIVED)


@dataclass(frozen=True)
class LossSpec:
    required_inputs: tuple[str, ...]
    # config key -> default; None means the key is required.
    config: dict[str, float | None]
    # what prepare_inputs hands the trainer besides the required inputs
    inputs: tuple[str, ...] = ()
    # Computes part of its value or metrics on the host (a device sync): its micro-batches run
    # eagerly where the others are CUDA graphs (runtime/graphs.py).
    host_side: bool = False


_CLIPPED = (*CLIP_KEYS, "request_datums")

LOSSES: dict[str, LossSpec] = {
    "cross_entropy": LossSpec(("target_tokens", "weights"), {}),
    "importance_sampling": LossSpec(RL_INPUTS, {}),
    # Ratio bounds (not epsilons), with the documented defaults.
    "ppo": LossSpec(RL_INPUTS, {"clip_low_threshold": 0.8, "clip_high_threshold": 1.2}, CLIP_KEYS),
    "cispo": LossSpec(RL_INPUTS, {"clip_low_threshold": 0.0, "clip_high_threshold": 4.0}, CLIP_KEYS),
    # No documented default for beta: asking for it beats silently picking one.
    "dro": LossSpec(RL_INPUTS, {"beta": None}),
    # The docs do not show gspo's defaults; ppo's bounds (ours).
    "gspo": LossSpec(RL_INPUTS, {"clip_low_threshold": 0.8, "clip_high_threshold": 1.2},
                     (*_CLIPPED, "sequence_ratio_mask"), host_side=True),
    # kl_coeff is the only key Tinker names; its default there is not public (0.01 is ours).
    "stable_reinforce": LossSpec(("target_tokens", "advantages"), {"kl_coeff": 0.01}, DERIVED, host_side=True),
}

# Names the SDK knows that we do not implement. Each gets an explicit refusal, never a fallback.
KNOWN_UNSUPPORTED = {
    "custom": "server-side custom losses are not enabled; forward_backward_custom runs the loss "
    "on the client (the default), which this server supports",
}


class LossInputError(UserError):
    """A user's mistake in a forward_backward request; the message names the datum and field."""


def resolve_loss_config(loss_fn: str, config: dict[str, float | str]) -> dict[str, float]:
    """Check the loss name and its config keys; return the config with defaults filled in."""
    if loss_fn in KNOWN_UNSUPPORTED:
        raise LossInputError(KNOWN_UNSUPPORTED[loss_fn])
    spec = LOSSES.get(loss_fn)
    if spec is None:
        raise LossInputError(f"unknown loss_fn {loss_fn!r}; expected one of {sorted(LOSSES)}")
    unknown = sorted(set(config) - set(spec.config))
    if unknown:
        allowed = sorted(spec.config) or "none"
        raise LossInputError(
            f"loss_fn_config keys {unknown} are not used by {loss_fn!r} (its keys: {allowed})"
        )
    resolved: dict[str, float] = {}
    for key, default in spec.config.items():
        value = config.get(key, default)
        if value is None:
            raise LossInputError(f"loss {loss_fn!r} needs loss_fn_config[{key!r}]")
        if isinstance(value, str):
            raise LossInputError(f"loss_fn_config[{key!r}] must be a finite number, got the text {value!r}")
        if not math.isfinite(float(value)):
            raise LossInputError(f"loss_fn_config[{key!r}] must be a finite number, got {value!r}")
        resolved[key] = float(value)
    lo, hi = resolved.get("clip_low_threshold"), resolved.get("clip_high_threshold")
    if lo is not None and hi is not None and lo > hi:
        raise LossInputError(f"clip_low_threshold {lo} is above clip_high_threshold {hi}")
    if resolved.get("kl_coeff", 0.0) < 0:
        raise LossInputError(f"loss_fn_config['kl_coeff'] must be >= 0, got {resolved['kl_coeff']}")
    return resolved


# The inputs that may carry K targets per position, (N, K) next to (N,): cross_entropy's only
# (the RL losses need one sampler logprob per position, of the one token sampled there).
TOPK_KEYS = ("target_tokens", "weights")
TOPK_LOSSES = ("cross_entropy",)


def targets_per_position(inputs: dict[str, np.ndarray]) -> int:
    """K of a datum's (N, K) `target_tokens`; 0 for (N,) targets."""
    targets = inputs["target_tokens"]
    return int(targets.shape[1]) if targets.ndim == 2 else 0


def validate_datum(
    index: int, tokens: np.ndarray, inputs: dict[str, np.ndarray], loss_fn: str, vocab_size: int,
    max_length: int, max_targets: int,
) -> None:
    """Raise LossInputError naming datum `index` and the field if the datum is unusable.
    `max_targets` bounds K of (N, K) targets."""
    n = int(tokens.shape[0])
    where = f"datum {index}"
    if n == 0:
        raise LossInputError(f"{where}: model_input is empty")
    if n > max_length:
        raise LossInputError(f"{where}: model_input has {n} tokens, above the model's context of {max_length}")
    bad = (tokens < 0) | (tokens >= vocab_size)
    if bad.any():
        pos = int(np.argmax(bad))
        raise LossInputError(
            f"{where}: model_input token {int(tokens[pos])} at position {pos} is outside the "
            f"vocabulary [0, {vocab_size})"
        )
    for key in LOSSES[loss_fn].required_inputs:
        if key not in inputs:
            raise LossInputError(f"{where}: loss {loss_fn!r} needs loss_fn_inputs[{key!r}]")
    k = _check_targets_shape(where, inputs.get("target_tokens"), n, loss_fn, max_targets)
    for key in ("target_tokens",) + PER_TOKEN_FLOAT:
        if key not in inputs:
            continue
        arr = inputs[key]
        expected = [n, k] if k and key in TOPK_KEYS else [n]
        if list(arr.shape) != expected:
            raise LossInputError(f"{where}: loss_fn_inputs[{key!r}] has shape {list(arr.shape)}, expected "
                                 f"{_expected_shape(key, expected, loss_fn)}")
        if key == "target_tokens":
            if np.issubdtype(arr.dtype, np.floating) and not np.all(np.mod(arr, 1) == 0):
                raise LossInputError(f"{where}: loss_fn_inputs['target_tokens'] must be integers")
            bad = (arr < 0) | (arr >= vocab_size)
            if bad.any():
                raise LossInputError(
                    f"{where}: target token {int(arr[_first(bad)])} at position {_position(bad)} is outside the "
                    f"vocabulary [0, {vocab_size})"
                )
        elif not np.all(np.isfinite(arr)):
            raise LossInputError(f"{where}: loss_fn_inputs[{key!r}] has a non-finite value at position "
                                 f"{_position(~np.isfinite(arr))}")


def _check_targets_shape(where: str, targets: np.ndarray | None, n: int, loss_fn: str, max_targets: int) -> int:
    """K of (N, K) targets (0 for (N,)), if this loss takes them and K is within the limit."""
    if targets is None or targets.ndim != 2:
        return 0  # missing, (N,), or a wrong shape that the per-field check names
    k = int(targets.shape[1])
    shape = list(targets.shape)
    if loss_fn not in TOPK_LOSSES:
        raise LossInputError(
            f"{where}: loss_fn_inputs['target_tokens'] has shape {shape}, expected [{n}] (one target per "
            f"model_input token): loss {loss_fn!r} needs the sampler's logprob of each position's one token; "
            f"only {', '.join(TOPK_LOSSES)} takes [N, K] targets")
    if not 1 <= k <= max_targets:
        raise LossInputError(
            f"{where}: loss_fn_inputs['target_tokens'] has shape {shape}, expected [{n}] or [{n}, K] with "
            f"1 <= K <= {max_targets} (this server's max_targets_per_position)")
    return k


def _expected_shape(key: str, expected: list[int], loss_fn: str) -> str:
    if len(expected) == 2:
        what = "K targets per model_input token" if key == "target_tokens" else "one weight per target"
        return f"{expected} ({what})"
    if key == "target_tokens" and loss_fn in TOPK_LOSSES:
        return f"{expected} or [{expected[0]}, K] (one target, or K, per model_input token)"
    return f"{expected} (one value per model_input token)"


def _first(mask: np.ndarray) -> tuple[int, ...]:
    return np.unravel_index(int(np.argmax(mask)), mask.shape)


def _position(mask: np.ndarray) -> str:
    """Where `mask` is first true: "p" in an (N,) array, "p (target j)" in an (N, K) one."""
    at = _first(mask)
    return str(int(at[0])) if mask.ndim == 1 else f"{int(at[0])} (target {int(at[1])})"


def check_one_targets_shape(ks: list[int]) -> None:
    """Every datum of a request has (N,) targets, or (N, K) ones with one K: a request's outputs
    come back as one tensor per field over all its datums, with one trailing shape."""
    def form(k: int) -> str:
        return f"[N, {k}]" if k else "[N]"

    for i, k in enumerate(ks):
        if k != ks[0]:
            raise LossInputError(
                f"datum {i}: loss_fn_inputs['target_tokens'] has shape {form(k)} but datum 0's is {form(ks[0])}; "
                "every datum of one request needs the same K (send other K in another request)")


def prepare_inputs(
    index: int, loss_fn: str, config: dict[str, float], inputs: dict[str, np.ndarray], num_datums: int, *,
    sampled_rows: np.ndarray | None = None, recorded_logprobs: np.ndarray | None = None,
) -> dict[str, np.ndarray]:
    """The per-token arrays the trainer hands `loss_fn` for one validated datum.

    `sampled_rows` (bool [N]) are the loss rows under sampled provenance runs, None without
    provenance; `recorded_logprobs` (float32 [N]) are the recorded sampler logprobs on those rows,
    which stable_reinforce needs (see runtime/provenance.py).
    """
    spec = LOSSES[loss_fn]
    n = int(inputs["target_tokens"].shape[0])
    out = {key: inputs[key] for key in spec.required_inputs}
    if "request_datums" in spec.inputs:
        out["request_datums"] = np.full(n, num_datums, np.float32)
    if CLIP_KEYS[0] in spec.inputs:
        # A per-row tensor overrides the config for its row.
        lo, hi = (inputs[k] if k in inputs else np.full(n, config[k], np.float32) for k in CLIP_KEYS)
        above = np.flatnonzero(lo > hi)
        if above.size:
            p = int(above[0])
            raise LossInputError(f"datum {index}: clip_low_threshold {float(lo[p]):g} is above "
                                 f"clip_high_threshold {float(hi[p]):g} at position {p}")
        out.update(clip_low_threshold=lo, clip_high_threshold=hi)
    if loss_fn == "gspo":
        out["sequence_ratio_mask"] = _gspo_ratio_rows(index, inputs, sampled_rows)
    if loss_fn == "stable_reinforce":
        if sampled_rows is None or recorded_logprobs is None:
            raise ValueError("stable_reinforce needs resolved provenance")  # the API resolves it first
        out.update(recorded_logprobs=recorded_logprobs, sampled_rows=sampled_rows.astype(np.float32))
        mismatch = np.zeros(n, np.float32)
        if "logprobs" in inputs:  # optional: the client's copy only feeds a metric
            mismatch[sampled_rows] = np.abs(inputs["logprobs"][sampled_rows] - recorded_logprobs[sampled_rows])
        out["logprobs_mismatch"] = mismatch
    return out


def _gspo_ratio_rows(index: int, inputs: dict[str, np.ndarray], sampled_rows: np.ndarray | None) -> np.ndarray:
    """M, the rows gspo's sequence ratio averages over, as 0/1 float32.

    Without `sequence_ratio_mask` (rl/train.py sends none): the rows under sampled provenance
    runs, else the rows with nonzero advantages. An empty M gives no ratio, which is only
    acceptable when the datum has nothing to train (all advantages 0).
    """
    adv = inputs["advantages"]
    if "sequence_ratio_mask" in inputs:
        rows = inputs["sequence_ratio_mask"] != 0
    elif sampled_rows is not None:
        rows = sampled_rows
    else:
        rows = adv != 0
    if not rows.any() and adv.any():
        p = int(np.flatnonzero(adv)[0])
        raise LossInputError(
            f"datum {index}: gspo's sequence ratio has no rows (sequence_ratio_mask is all zero) but "
            f"advantages[{p}] is {float(adv[p])!r}")
    return rows.astype(np.float32)


# ---------------------------------------------------------------------------------------------
# The losses. Each takes the trainer's logprobs and inputs of a block of rows ([rows, T], or one
# datum's [N]) and returns the per-token loss (= -objective) plus, optionally, per-row metric
# values (float64 numpy, [rows]) that a run's rows reduce by the key's reduction: ":max" by max,
# every other by sum (means arrive pre-divided by `request_datums`). Padded positions carry zero
# advantages / weights / masks and so contribute exactly 0.


@dataclass
class LossOut:
    loss: torch.Tensor
    row_metrics: dict[str, np.ndarray] = field(default_factory=dict)


def _clip_bounds(config: dict[str, float], inputs: dict[str, torch.Tensor]):
    """Per-row tensors when given (the trainer always has them), else the config's scalars."""
    return tuple(inputs[k] if k in inputs else config[k] for k in CLIP_KEYS)


def _cross_entropy(lp, inputs, config) -> LossOut:
    return LossOut(-(lp * inputs["weights"]))


def topk_cross_entropy(lp: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
    """cross_entropy with (N, K) targets: per position, -sum over its K targets of weight x logprob.
    `lp` and `weights` are [..., K]; returns [...]."""
    return -(lp * weights).sum(-1)


def _importance_sampling(lp, inputs, config) -> LossOut:
    return LossOut(-(torch.exp(lp - inputs["logprobs"]) * inputs["advantages"]))


def _ppo(lp, inputs, config) -> LossOut:
    ratio, adv = torch.exp(lp - inputs["logprobs"]), inputs["advantages"]
    lo, hi = _clip_bounds(config, inputs)
    return LossOut(-torch.minimum(ratio * adv, torch.clamp(ratio, lo, hi) * adv))


def _cispo(lp, inputs, config) -> LossOut:
    ratio = torch.exp(lp - inputs["logprobs"])
    lo, hi = _clip_bounds(config, inputs)
    return LossOut(-(torch.clamp(ratio, lo, hi).detach() * lp * inputs["advantages"]))


def _dro(lp, inputs, config) -> LossOut:
    diff = lp - inputs["logprobs"]
    return LossOut(-(lp * inputs["advantages"] - 0.5 * config["beta"] * diff * diff))


def _rows(x: torch.Tensor) -> np.ndarray:
    """A detached float64 copy on the CPU, always [rows, T]."""
    a = x.detach().to("cpu", torch.float64).numpy()
    return a[None] if a.ndim == 1 else a


def _request_datums(inputs: dict[str, torch.Tensor], rows: int) -> np.ndarray:
    """Per row, the number of datums of its request (1 where unknown, e.g. a lone datum)."""
    return _rows(inputs["request_datums"])[:, 0] if "request_datums" in inputs else np.ones(rows)


def _gspo(lp, inputs, config) -> LossOut:
    """GSPO-token: one importance ratio per datum, s = exp(mean over M of (sg(l) - q)); row t has
    the value s and the gradient s * grad(l_t); loss = -sum_t min(s_t A_t, clamp(s_t, lo_t, hi_t) A_t).

    log s is a constant of the graph (it uses sg(l)), so it is computed on the CPU in float64, row
    by row over that row's own values: a datum's ratio never depends on the rows it is batched with.
    """
    adv = inputs["advantages"]
    m = _rows(inputs["sequence_ratio_mask"])
    count = m.sum(-1)
    diff = (_rows(lp) - _rows(inputs["logprobs"])) * m
    log_s = np.where(count > 0, diff.sum(-1) / np.maximum(count, 1), 0.0)
    s = np.exp(log_s)
    s_col = torch.as_tensor(s, dtype=lp.dtype, device=lp.device)[:, None]
    if lp.ndim == 1:
        s_col = s_col[0]
    ratio = s_col * torch.exp(lp - lp.detach())
    lo, hi = _clip_bounds(config, inputs)
    loss = -torch.minimum(ratio * adv, torch.clamp(ratio, lo, hi) * adv)
    lo_r, hi_r = (_rows(b) if torch.is_tensor(b) else np.full_like(m, b) for b in (lo, hi))
    clipped = (((s[:, None] < lo_r) | (s[:, None] > hi_r)) * m).sum(-1) / np.maximum(count, 1)
    datums = _request_datums(inputs, len(s))
    return LossOut(loss, {"seq_ratio:mean": s / datums, "seq_clipped_frac:mean": clipped / datums})


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
    s, d = _rows(sampled), _rows(diff)
    n_sampled = s.sum(-1)
    mean_diff = -(d * s).sum(-1) / np.maximum(n_sampled, 1)  # q - l over S
    datums = _request_datums(inputs, len(n_sampled))
    return LossOut(pg + kl, {
        "pg_loss:sum": _rows(pg).sum(-1), "kl_penalty:sum": _rows(kl).sum(-1), "sampled_tokens:sum": n_sampled,
        "sampler_trainer_logprob_diff:mean": mean_diff / datums,
        "datum_logprobs_mismatch:max": _rows(inputs["logprobs_mismatch"]).max(-1)
        if "logprobs_mismatch" in inputs else np.zeros_like(n_sampled),
    })


# The version in service; a later objective replaces this one name (and docs/losses.md).
STABLE_REINFORCE = stable_reinforce_v0

LOSS_FUNCTIONS: dict[str, Callable[..., LossOut]] = {
    "cross_entropy": _cross_entropy,
    "importance_sampling": _importance_sampling,
    "ppo": _ppo,
    "cispo": _cispo,
    "dro": _dro,
    "gspo": _gspo,
    "stable_reinforce": STABLE_REINFORCE,
}


def per_token_loss(
    loss_fn: str, config: dict[str, float], target_logprobs: torch.Tensor, inputs: dict[str, torch.Tensor],
) -> torch.Tensor:
    """Per-token loss (= -objective) of one datum or a padded block of datums.

    `target_logprobs` and every input are shaped alike ([N] or [rows, T]); padded positions must
    carry zero weights/advantages so they contribute exactly 0.
    """
    return LOSS_FUNCTIONS[loss_fn](target_logprobs, inputs, config).loss


def merge_metrics(into: dict[str, float], new: dict[str, float]) -> None:
    """Add one micro-batch's metrics of a request to its totals: max for ':max', else a sum
    (':mean' values arrive already divided by the request's datum count)."""
    for key, value in new.items():
        if key not in into:
            into[key] = value
        elif key.endswith(":max"):
            into[key] = max(into[key], value)
        else:
            into[key] += value


def run_losses(
    runs: list[tuple[str, dict[str, float], int, int]], logprobs: torch.Tensor, inputs: dict[str, torch.Tensor],
    mask: torch.Tensor,
) -> tuple[torch.Tensor, list[dict[str, float]]]:
    """Per-token losses of a micro-batch laid out as runs of rows, one run per request.

    `runs` holds (loss_fn, config, row_start, row_end); `logprobs`, every input and `mask` are
    [rows, width] with zeros on padding. Returns the per-token loss ([rows, width], padding 0) and,
    per run, the extra metrics its loss reports (merged by the caller across micro-batches with
    `merge_metrics`; "loss:sum" is added by the caller from the returned per-token loss).

    Every loss works row by row, so consecutive runs with the same loss function and config are
    computed as one block (fewer ops with many tenants; the gradient of a sum is 1 for every
    token however the sum is grouped).
    """
    blocks: list[tuple[str, dict[str, float], int, int]] = []
    for loss_fn, config, s, e in runs:
        if blocks and blocks[-1][0] == loss_fn and blocks[-1][1] == config and blocks[-1][3] == s:
            blocks[-1] = (loss_fn, config, blocks[-1][2], e)
        else:
            blocks.append((loss_fn, config, s, e))
    parts, computed = [], []
    for fn, cfg, s, e in blocks:
        out = LOSS_FUNCTIONS[fn](logprobs[s:e], {k: v[s:e] for k, v in inputs.items()}, cfg)
        parts.append(out.loss * mask[s:e])
        computed.append((s, e, out.row_metrics))
    tok_loss = parts[0] if len(parts) == 1 else torch.cat(parts)
    metrics = []
    for _, _, s, e in runs:
        bs, _, row_metrics = next(c for c in computed if c[0] <= s < c[1])  # the block holding the run
        metrics.append({key: float(values[s - bs:e - bs].max() if key.endswith(":max") else values[s - bs:e - bs].sum())
                        for key, values in row_metrics.items()})
    return tok_loss, metrics
