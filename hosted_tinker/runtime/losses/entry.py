"""What a loss is: one `Loss` entry holds everything the server knows about it (its inputs, what
the server derives for it, whether it trains on recorded samples, its config and its function),
and the few tensor helpers the loss functions share."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable

import numpy as np
import torch

from ...errors import UserError

CLIP_KEYS = ("clip_low_threshold", "clip_high_threshold")
# The user inputs that hold token ids (checked against the vocabulary); every other input a loss
# declares is a per-token float (checked for shape and finiteness).
TOKEN_INPUTS = ("target_tokens",)


class LossInputError(UserError):
    """A user's mistake in a forward_backward request; the message names the datum and field."""


@dataclass
class LossOut:
    """A loss function's answer for a block of rows: the per-token loss (= -objective) and,
    optionally, per-row metric values (float64 numpy, [rows]) that a run's rows reduce by the
    key's reduction: ":max" by max, every other by sum (means arrive pre-divided by
    `request_datums`)."""
    loss: torch.Tensor
    row_metrics: dict[str, np.ndarray] = field(default_factory=dict)


@dataclass(frozen=True)
class DatumInputs:
    """What a deriver may read of one validated datum: its user inputs, the resolved config,
    the request's datum count and, with provenance, its sampled rows (bool [N]) and the recorded
    sampler logprobs on them (float32 [N], only for a loss that needs recorded samples)."""
    index: int
    inputs: dict[str, np.ndarray]
    config: dict[str, float]
    num_datums: int
    sampled_rows: np.ndarray | None = None
    recorded_logprobs: np.ndarray | None = None

    @property
    def length(self) -> int:
        return int(self.inputs["target_tokens"].shape[0])


# Takes the trainer's logprobs and inputs of a block of rows ([rows, T], or one datum's [N]) and
# the resolved config. Padded positions carry zero advantages / weights / masks and so must
# contribute exactly 0.
LossFunction = Callable[[torch.Tensor, dict, dict], LossOut]
# Per-token arrays the server derives for one datum (named in `Loss.inputs`).
Deriver = Callable[[DatumInputs], dict]


@dataclass(frozen=True)
class Loss:
    """One built-in loss. Every per-token input is [N] (one value per model_input token), except
    `target_tokens` and `weights` of a loss with `topk_targets`, which may be [N, K]."""
    name: str
    fn: LossFunction
    # Inputs the user must send, checked and handed to `fn` as sent.
    required_inputs: tuple[str, ...]
    # config key -> default; None means the key is required.
    config: dict[str, float | None] = field(default_factory=dict)
    # Raises LossInputError for a resolved config this loss cannot use (beyond finite numbers).
    check_config: Callable[[dict[str, float]], None] | None = None
    # What the server derives for `fn` besides the required inputs (a user's tensor of the same
    # name is replaced), and the derivers that compute them, in order.
    inputs: tuple[str, ...] = ()
    derive: tuple[Deriver, ...] = ()
    # Inputs the user may send, which the derivers read when sent (per-row clip bounds, gspo's
    # ratio mask): validated as the required ones are.
    optional_inputs: tuple[str, ...] = ()
    # Trains on the recorded samples that a datum's provenance names (services/provenance.py
    # resolves them into `DatumInputs.recorded_logprobs`).
    needs_recorded_samples: bool = False
    # Takes K targets per position, (N, K) `target_tokens` and `weights` next to (N,).
    topk_targets: bool = False
    # Computes part of its value or metrics on the host (a device sync): its micro-batches run
    # eagerly where the others are CUDA graphs (runtime/graphs.py).
    host_side: bool = False

    @property
    def user_inputs(self) -> tuple[str, ...]:
        """Every input a user may send for this loss: what validation checks, by its kind."""
        return (*self.required_inputs, *self.optional_inputs)


def as_rows(x: torch.Tensor) -> np.ndarray:
    """A detached float64 copy on the CPU, always [rows, T]."""
    a = x.detach().to("cpu", torch.float64).numpy()
    return a[None] if a.ndim == 1 else a


def request_datums(inputs: dict[str, torch.Tensor], rows: int) -> np.ndarray:
    """Per row, the number of datums of its request (1 where unknown, e.g. a lone datum)."""
    return as_rows(inputs["request_datums"])[:, 0] if "request_datums" in inputs else np.ones(rows)


def clip_bounds(config: dict[str, float], inputs: dict[str, torch.Tensor]):
    """Per-row tensors when given (the trainer always has them), else the config's scalars."""
    return tuple(inputs[k] if k in inputs else config[k] for k in CLIP_KEYS)
