"""The built-in Tinker losses, with Tinker's contract: every loss is a **sum** over tokens and
datums, never a mean (see shared/reference/losses.md and docs/losses.md).

Sums are what make the server exact under the SDK's chunking (one call of 8 datums equals two
calls of 4), what `forward_backward_custom` relies on (it sends `weights = -dC/dlogprobs` to
cross_entropy), and what lets one fused pass carry many tenants: the gradient of a sum of
independent per-datum losses with respect to one adapter is that adapter's own gradient.

A loss is one `Loss` entry (`entry.py`) in `LOSSES` (`builtin.py`, where each function sits
beside its entry): its inputs, what the server derives for it, whether it trains on recorded
samples, its config and its function. `validation.py` checks a request against the entry before
it is queued and prepares each datum's per-token inputs; `run.py` is the trainer's side.
"""

from .builtin import KNOWN_UNSUPPORTED, LOSSES, STABLE_REINFORCE
from .entry import DatumInputs, Loss, LossInputError, LossOut
from .run import merge_metrics, per_token_loss, run_losses, topk_cross_entropy
from .validation import (check_one_targets_shape, prepare_inputs, resolve_loss_config, validate_data,
                         validate_datum)

__all__ = [
    "KNOWN_UNSUPPORTED", "LOSSES", "STABLE_REINFORCE", "DatumInputs", "Loss", "LossInputError", "LossOut",
    "check_one_targets_shape", "merge_metrics", "per_token_loss", "prepare_inputs", "resolve_loss_config",
    "run_losses", "topk_cross_entropy", "validate_data", "validate_datum",
]
