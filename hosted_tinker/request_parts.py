"""`PartsLedger`: the requests running in parts, all or nothing.

A forward / forward_backward above `max_tokens_per_cycle` runs one part per clock cycle
(scheduler.py), each part its model's only compute in its pass. The ledger keeps, per such
request, the outcome of its parts so far and its model's gradients as they were before its first
part (`GradientSnapshot`). The last part's success answers the whole request; a part's failure,
or the request failing any other way between its parts (a cycle that raised, its model
unloaded), puts the gradients back to that snapshot (`settle`): a later optim_step applies all
of the request's gradients or none of them, and a client's retry counts its parts once.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from .request_types import FBOutcome
from .runtime.adapters import GradientSnapshot
from .runtime.losses import merge_metrics


@dataclass
class OpenRequest:
    """A request with parts still to come: its model's gradients before its first part (None for a
    forward, which has none) and its parts' outcome so far."""

    before: GradientSnapshot | None
    so_far: FBOutcome | None = None


class PartsLedger:
    def __init__(self) -> None:
        self._open: dict[str, OpenRequest] = {}
        self.rolled_back = 0  # requests whose earlier parts' gradients were put back

    def __len__(self) -> int:
        return len(self._open)

    def begin(self, request_id: str, before: GradientSnapshot | None) -> None:
        """Its first part is about to run (its model's gradients are `before`)."""
        self._open[request_id] = OpenRequest(before)

    def is_open(self, request_id: str) -> bool:
        return request_id in self._open

    def add(self, request_id: str, outcome: FBOutcome, *, last: bool) -> FBOutcome:
        """A part's outcome joined to the earlier parts'; the request's whole outcome if `last`
        (then the request leaves the ledger, its gradients kept)."""
        entry = self._open[request_id]
        if entry.so_far is not None:
            outcome = joined(entry.so_far, outcome)
        entry.so_far = outcome
        if last:
            del self._open[request_id]
        return outcome

    def settle(self, is_pending: Callable[[str], bool]) -> list[str]:
        """Roll back the requests that have failed since their first part (whoever failed them) and
        forget them; returns their ids."""
        failed = [rid for rid in self._open if not is_pending(rid)]
        for rid in failed:
            entry = self._open.pop(rid)
            if entry.before is not None:
                entry.before.restore()
                self.rolled_back += 1
        return failed


def joined(earlier: FBOutcome, later: FBOutcome) -> FBOutcome:
    """One request's outcome from its parts' (run in successive cycles), in datum order."""
    metrics = dict(earlier.metrics)
    merge_metrics(metrics, later.metrics)
    return FBOutcome(earlier.outputs + later.outputs, metrics)
