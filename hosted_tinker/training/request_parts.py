"""A failed request leaves no gradient: `PartsLedger` for requests in parts, `LaunchedGradients`
for the others.

A forward / forward_backward above `max_tokens_per_cycle` runs one part per clock cycle
(cycle_prefix.py), each part its model's only compute in its pass. The ledger keeps, per such
request, the outcome of its parts so far and its model's gradients as they were before its first
part (`GradientSnapshot`). The last part's success answers the whole request; a part's failure,
or the request failing any other way before it is answered (a cycle that raised, its model
unloaded, its answer that could not be stored), puts the gradients back to that snapshot
(`settle`): a later optim_step applies all of the request's gradients or none of them, and a
client's retry counts its parts once.

A forward_backward in one part can fail after its pass too: its cycle raises after the passes, or
its answer cannot be made or stored. `LaunchedGradients` keeps, until each request of the cycle
is answered, the pass it ran in, whose runtime kept its adapters' gradients from before it
(`GradientPass`, which every pass takes anyway to be all or nothing: nothing is copied for
this). A model with a request that failed gets its gradients put back as before its pass, and
its requests of that pass that did not fail run again, so the model holds what it would hold had
the failed request never been sent. A model whose optim_step ran in the same cycle has had its
gradients applied already (its step is launched before the cycle's one wait for the device,
which its compute's answers come after): a request of it that fails after that wait is logged as
having been applied. Success costs nothing but a list entry per request.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from ..requests.kinds import FBOutcome, FBWork
from ..runtime.adapters import GradientPass, GradientSnapshot
from ..runtime.losses import merge_metrics

log = logging.getLogger(__name__)

# A request's state as `settle` asks it: None while pending, True once failed, False once answered.
Outcome = Callable[[str], bool | None]


@dataclass
class OpenRequest:
    """A request with parts still to come: its model's gradients before its first part (None for a
    forward, which has none) and its parts' outcome so far."""

    before: GradientSnapshot | None
    so_far: FBOutcome | None = None
    answered: bool = False  # its last part ran: it leaves once its answer is stored


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
        (the request leaves the ledger at the next `settle` after its answer)."""
        entry = self._open[request_id]
        if entry.so_far is not None:
            outcome = joined(entry.so_far, outcome)
        entry.so_far, entry.answered = outcome, last
        return outcome

    def settle(self, outcome: Outcome) -> list[str]:
        """Forget the requests that have ended: roll back those that failed since their first part
        (whoever failed them, their answer included); returns their ids."""
        ended = {rid: failed for rid in self._open if (failed := outcome(rid)) is not None}
        for rid, failed in ended.items():
            entry = self._open.pop(rid)
            if failed and entry.before is not None:
                entry.before.restore()
                self.rolled_back += 1
        return [rid for rid, failed in ended.items() if failed]


def joined(earlier: FBOutcome, later: FBOutcome) -> FBOutcome:
    """One request's outcome from its parts' (run in successive cycles), in datum order."""
    metrics = dict(earlier.metrics)
    merge_metrics(metrics, later.metrics)
    return FBOutcome(earlier.outputs + later.outputs, metrics)


@dataclass
class _Launched:
    request_id: str
    work: FBWork
    before: GradientPass | None  # its pass's gradients from before it (None: the runtime keeps none)


class LaunchedGradients:
    """The single-part forward_backward requests of the running cycle, from their pass until they
    are answered (module docstring)."""

    def __init__(self) -> None:
        self._open: dict[str, list[_Launched]] = {}  # per model, in the order its passes ran
        self._spent: list[_Launched] = []  # of models whose optim_step ran this cycle: applied, failed or not
        self.rolled_back = 0  # models whose gradients were put back after a request failed

    def launched(self, request_id: str, work: FBWork, before: GradientPass | None) -> None:
        self._open.setdefault(work.model_id, []).append(_Launched(request_id, work, before))

    def stepped(self, model_ids) -> None:
        """These models' optimizer steps are launched: their gradients are taken, failed or not."""
        for mid in model_ids:
            self._spent += self._open.pop(mid, [])

    def settle(self, outcome: Outcome, adapter: Callable[[str], Any], rerun: Callable[[list[FBWork]], None]) -> None:
        """Once every request of the cycle is answered (or failed by the device loop): each model
        with a failed one gets its gradients back as before its first pass of the cycle
        (`adapter(model_id)`: its adapter, None once unloaded), then its requests that did not
        fail `rerun`; the ledger is then empty. A model with requests pending waits."""
        for mid, entries in list(self._open.items()):
            states = [outcome(e.request_id) for e in entries]
            if None in states:
                continue
            del self._open[mid]
            if any(states):
                self._put_back(mid, entries, states, adapter(mid), rerun)
        for e in self._spent:
            if outcome(e.request_id):
                log.warning("request %s of model %s failed after its model's optim_step of the same cycle had "
                            "applied its gradients", e.request_id, e.work.model_id)
        self._spent = [e for e in self._spent if outcome(e.request_id) is None]

    def _put_back(self, mid: str, entries: list[_Launched], failed: list[bool], adapter, rerun) -> None:
        first = entries[0].before
        if adapter is None or first is None or adapter not in first.adapters:
            return  # unloaded (or the runtime keeps no gradients from before): nothing to put back
        if not first.restore(adapter):
            log.error("model %s: could not put back its gradients after a request failed (its adapter moved "
                      "during the cycle); its next optim_step includes that request's gradients", mid)
            return
        self.rolled_back += 1
        others = [e.work for e, f in zip(entries, failed) if not f]
        if others:
            rerun(others)
