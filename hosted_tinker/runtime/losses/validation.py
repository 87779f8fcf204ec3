"""A forward_backward request's loss, checked before it is queued (the model is never touched by
a bad request), and each datum's per-token inputs prepared for the trainer from its `Loss` entry."""

from __future__ import annotations

import math
from collections.abc import Sequence

import numpy as np

from .builtin import KNOWN_UNSUPPORTED, LOSSES
from .entry import TOKEN_INPUTS, DatumInputs, LossInputError
# The inputs that may carry K targets per position, (N, K) next to (N,), for a loss that takes
# them (`Loss.topk_targets`; the RL losses need one sampler logprob per position, of the one token
# sampled there).
TOPK_KEYS = ("target_tokens", "weights")
TOPK_LOSSES = tuple(name for name, loss in LOSSES.items() if loss.topk_targets)


def resolve_loss_config(loss_fn: str, config: dict[str, float | str]) -> dict[str, float]:
    """Check the loss name and its config keys; return the config with defaults filled in."""
    if loss_fn in KNOWN_UNSUPPORTED:
        raise LossInputError(KNOWN_UNSUPPORTED[loss_fn])
    loss = LOSSES.get(loss_fn)
    if loss is None:
        raise LossInputError(f"unknown loss_fn {loss_fn!r}; expected one of {sorted(LOSSES)}")
    unknown = sorted(set(config) - set(loss.config))
    if unknown:
        allowed = sorted(loss.config) or "none"
        raise LossInputError(
            f"loss_fn_config keys {unknown} are not used by {loss_fn!r} (its keys: {allowed})"
        )
    resolved: dict[str, float] = {}
    for key, default in loss.config.items():
        value = config.get(key, default)
        if value is None:
            raise LossInputError(f"loss {loss_fn!r} needs loss_fn_config[{key!r}]")
        if isinstance(value, str):
            raise LossInputError(f"loss_fn_config[{key!r}] must be a finite number, got the text {value!r}")
        if not math.isfinite(float(value)):
            raise LossInputError(f"loss_fn_config[{key!r}] must be a finite number, got {value!r}")
        resolved[key] = float(value)
    if loss.check_config is not None:
        loss.check_config(resolved)
    return resolved


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
    for key in (*TOKEN_INPUTS, *per_token_float_inputs()):
        if key not in inputs:
            continue
        arr = inputs[key]
        expected = [n, k] if k and key in TOPK_KEYS else [n]
        if list(arr.shape) != expected:
            raise LossInputError(f"{where}: loss_fn_inputs[{key!r}] has shape {list(arr.shape)}, expected "
                                 f"{_expected_shape(key, expected, loss_fn)}")
        if key in TOKEN_INPUTS:
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


def validate_data(data: Sequence[tuple[np.ndarray, dict[str, np.ndarray]]], loss_fn: str, vocab_size: int,
                  max_length: int, max_targets: int) -> None:
    """`validate_datum` of each (tokens, inputs) of a request in order: the first unusable datum is
    the one named. Its value checks run once over every datum's values together, so a request of
    many datums pays numpy's per-call cost a few times rather than a dozen times per datum (64
    datums: ~1.7 ms of the host's work before the pass, issue 42); only a request that fails them
    is checked datum by datum, which finds the first fault and says what it is."""
    if not data or _all_valid(data, loss_fn, vocab_size, max_length, max_targets):
        return
    for i, (tokens, inputs) in enumerate(data):
        validate_datum(i, tokens, inputs, loss_fn, vocab_size, max_length, max_targets)


def _all_valid(data: Sequence[tuple[np.ndarray, dict[str, np.ndarray]]], loss_fn: str, vocab_size: int,
               max_length: int, max_targets: int) -> bool:
    """Whether `validate_datum` passes every datum: its checks, the shapes per datum, the values over
    all datums at once (a value is out of range in one datum iff it is in all of them together)."""
    required = LOSSES[loss_fn].required_inputs
    float_keys = per_token_float_inputs()
    tokens_seen, targets, targets_float, floats = [], [], [], []
    for tokens, inputs in data:
        n = int(tokens.shape[0])
        if not 0 < n <= max_length or any(key not in inputs for key in required):
            return False
        try:
            k = _check_targets_shape("", inputs.get("target_tokens"), n, loss_fn, max_targets)
        except LossInputError:
            return False
        tokens_seen.append(tokens)
        for key in (*TOKEN_INPUTS, *float_keys):
            arr = inputs.get(key)
            if arr is None:
                continue
            if arr.shape != ((n, k) if k and key in TOPK_KEYS else (n,)):
                return False
            if key not in TOKEN_INPUTS:
                floats.append(arr.ravel())
            elif np.issubdtype(arr.dtype, np.floating):
                targets_float.append(arr.ravel())
            else:
                targets.append(arr.ravel())
    every = np.concatenate(tokens_seen)
    if every.min() < 0 or every.max() >= vocab_size:
        return False
    if targets_float:  # float target ids must be whole numbers (NaN is not)
        every = np.concatenate(targets_float)
        if not np.all(np.mod(every, 1) == 0):
            return False
        targets.append(every)
    if targets:
        every = np.concatenate(targets)  # int64 and float64 together: float64, exact for any id below 2**53
        if every.min() < 0 or every.max() >= vocab_size:
            return False
    return not floats or bool(np.isfinite(np.concatenate(floats)).all())


def per_token_float_inputs() -> tuple[str, ...]:
    """The per-token float inputs a user may send (the SDK's float32 keys): every input that any
    registered loss declares (`Loss.user_inputs`) and that holds no token ids. Each is checked for
    shape and finiteness whenever sent, whichever loss the request names, so a new loss's float
    input is validated by its declaration alone."""
    names = dict.fromkeys(key for loss in LOSSES.values() for key in loss.user_inputs)  # in registration order
    return tuple(key for key in names if key not in TOKEN_INPUTS)


def _check_targets_shape(where: str, targets: np.ndarray | None, n: int, loss_fn: str, max_targets: int) -> int:
    """K of (N, K) targets (0 for (N,)), if this loss takes them and K is within the limit."""
    if targets is None or targets.ndim != 2:
        return 0  # missing, (N,), or a wrong shape that the per-field check names
    k = int(targets.shape[1])
    shape = list(targets.shape)
    if not LOSSES[loss_fn].topk_targets:
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
    if key == "target_tokens" and LOSSES[loss_fn].topk_targets:
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
    """The per-token arrays the trainer hands `loss_fn` for one validated datum: its required
    inputs as sent, then what its entry derives.

    `sampled_rows` (bool [N]) are the loss rows under sampled provenance runs, None without
    provenance; `recorded_logprobs` (float32 [N]) are the recorded sampler logprobs on those rows,
    which a loss with `needs_recorded_samples` reads (see services/provenance.py).
    """
    loss = LOSSES[loss_fn]
    out = {key: inputs[key] for key in loss.required_inputs}
    datum = DatumInputs(index, inputs, config, num_datums, sampled_rows, recorded_logprobs)
    for derive in loss.derive:
        out.update(derive(datum))
    return out
