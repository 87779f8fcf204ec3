"""The built-in Tinker losses, with Tinker's contract: every loss is a **sum** over tokens and
datums, never a mean (see shared/reference/losses.md).

Sums are what make the server exact under the SDK's chunking (one call of 8 datums equals two
calls of 4), what `forward_backward_custom` relies on (it sends `weights = -dC/dlogprobs` to
cross_entropy), and what lets one fused pass carry many tenants: the gradient of a sum of
independent per-datum losses with respect to one adapter is that adapter's own gradient.

Validation lives here too, so the API can reject a bad request before it is queued and the
model is never touched by it.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
import torch

RL_INPUTS = ("target_tokens", "logprobs", "advantages")
# Per-token float inputs the trainer pads into [rows, width] tensors for `run_losses`.
LOSS_INPUT_KEYS = ("weights", "logprobs", "advantages")


@dataclass(frozen=True)
class LossSpec:
    required_inputs: tuple[str, ...]
    # config key -> default; None means the key is required.
    config: dict[str, float | None]


LOSSES: dict[str, LossSpec] = {
    "cross_entropy": LossSpec(("target_tokens", "weights"), {}),
    "importance_sampling": LossSpec(RL_INPUTS, {}),
    # Ratio bounds (not epsilons), with the documented defaults.
    "ppo": LossSpec(RL_INPUTS, {"clip_low_threshold": 0.8, "clip_high_threshold": 1.2}),
    "cispo": LossSpec(RL_INPUTS, {"clip_low_threshold": 0.0, "clip_high_threshold": 4.0}),
    # No documented default for beta: asking for it beats silently picking one.
    "dro": LossSpec(RL_INPUTS, {"beta": None}),
}

# Names the SDK knows that we do not implement. Each gets an explicit refusal, never a fallback.
KNOWN_UNSUPPORTED = {
    "gspo": "loss 'gspo' is not supported by this server; use 'ppo' or 'cispo', "
    "or forward_backward_custom for a sequence-level ratio",
    "stable_reinforce": "loss 'stable_reinforce' needs sampler stability records, which this "
    "server does not keep; use 'importance_sampling' or 'ppo'",
    "custom": "server-side custom losses are not enabled; forward_backward_custom runs the loss "
    "on the client (the default), which this server supports",
}

# Per-token inputs with their dtype class: float inputs must be finite.
PER_TOKEN_FLOAT = ("weights", "logprobs", "advantages")


class LossInputError(ValueError):
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
        if isinstance(value, str) or not math.isfinite(float(value)):
            raise LossInputError(f"loss_fn_config[{key!r}] must be a finite number, got {value!r}")
        resolved[key] = float(value)
    lo, hi = resolved.get("clip_low_threshold"), resolved.get("clip_high_threshold")
    if lo is not None and hi is not None and lo > hi:
        raise LossInputError(f"clip_low_threshold {lo} is above clip_high_threshold {hi}")
    return resolved


def validate_datum(
    index: int, tokens: np.ndarray, inputs: dict[str, np.ndarray], loss_fn: str, vocab_size: int,
    max_length: int,
) -> None:
    """Raise LossInputError naming datum `index` and the field if the datum is unusable."""
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
    for key in ("target_tokens",) + PER_TOKEN_FLOAT:
        if key not in inputs:
            continue
        arr = inputs[key]
        if arr.ndim != 1 or arr.shape[0] != n:
            raise LossInputError(
                f"{where}: loss_fn_inputs[{key!r}] has shape {list(arr.shape)}, expected [{n}] "
                "(one value per model_input token)"
            )
        if key == "target_tokens":
            if np.issubdtype(arr.dtype, np.floating) and not np.all(np.mod(arr, 1) == 0):
                raise LossInputError(f"{where}: loss_fn_inputs['target_tokens'] must be integers")
            bad = (arr < 0) | (arr >= vocab_size)
            if bad.any():
                pos = int(np.argmax(bad))
                raise LossInputError(
                    f"{where}: target token {int(arr[pos])} at position {pos} is outside the "
                    f"vocabulary [0, {vocab_size})"
                )
        elif not np.all(np.isfinite(arr)):
            pos = int(np.argmax(~np.isfinite(arr)))
            raise LossInputError(f"{where}: loss_fn_inputs[{key!r}] has a non-finite value at position {pos}")


def per_token_loss(
    loss_fn: str, config: dict[str, float], target_logprobs: torch.Tensor, inputs: dict[str, torch.Tensor],
) -> torch.Tensor:
    """Per-token loss (= -objective) of one datum or a padded block of datums.

    `target_logprobs` and every input are shaped alike ([N] or [rows, T]); padded positions must
    carry zero weights/advantages so they contribute exactly 0.
    """
    lp = target_logprobs
    if loss_fn == "cross_entropy":
        return -(lp * inputs["weights"])
    adv = inputs["advantages"]
    sampling_lp = inputs["logprobs"]
    if loss_fn == "dro":
        diff = lp - sampling_lp
        return -(lp * adv - 0.5 * config["beta"] * diff * diff)
    ratio = torch.exp(lp - sampling_lp)
    if loss_fn == "importance_sampling":
        return -(ratio * adv)
    lo, hi = config["clip_low_threshold"], config["clip_high_threshold"]
    if loss_fn == "ppo":
        return -torch.minimum(ratio * adv, torch.clamp(ratio, lo, hi) * adv)
    if loss_fn == "cispo":
        return -(torch.clamp(ratio, lo, hi).detach() * lp * adv)
    raise LossInputError(f"unknown loss_fn {loss_fn!r}")  # unreachable after resolve_loss_config


def run_losses(
    runs: list[tuple[str, dict[str, float], int, int]], logprobs: torch.Tensor, inputs: dict[str, torch.Tensor],
    mask: torch.Tensor,
) -> tuple[torch.Tensor, list[dict[str, float]]]:
    """Per-token losses of a micro-batch laid out as runs of rows, one run per request.

    `runs` holds (loss_fn, config, row_start, row_end); `logprobs`, every input and `mask` are
    [rows, width] with zeros on padding. Returns the per-token loss ([rows, width], padding 0) and,
    per run, the extra metrics its loss reports (summed by the caller across micro-batches;
    "loss:sum" is added by the caller from the returned per-token loss).

    Losses are elementwise per token, so consecutive runs with the same loss function and config
    are computed as one block (fewer ops with many tenants; the gradient of a sum is 1 for every
    token however the sum is grouped).
    """
    blocks: list[tuple[str, dict[str, float], int, int]] = []
    for loss_fn, config, s, e in runs:
        if blocks and blocks[-1][0] == loss_fn and blocks[-1][1] == config and blocks[-1][3] == s:
            blocks[-1] = (loss_fn, config, blocks[-1][2], e)
        else:
            blocks.append((loss_fn, config, s, e))
    parts = [per_token_loss(fn, cfg, logprobs[s:e], {k: v[s:e] for k, v in inputs.items()}) * mask[s:e]
             for fn, cfg, s, e in blocks]
    tok_loss = parts[0] if len(parts) == 1 else torch.cat(parts)
    return tok_loss, [{} for _ in runs]
