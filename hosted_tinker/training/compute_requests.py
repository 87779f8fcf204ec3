"""`ComputeRequests`: a cycle's forward and forward_backward requests, from launch to answer.

The cycle's requests run in one fused pass (each quarantined key's in a pass of its own), launched
without waiting and read after the cycle's one wait for the device. A request's failure is its
own: a pass that raises is rerun in halves until the request that made it raise fails alone, the
others getting their own results (isolation.py), and that key's next requests run apart for a
while (`Quarantine`). A request that fails leaves no gradient, in one part or many
(request_parts.py): a request in parts has its model's gradients from before its first part put
back (`PartsLedger`), one in one part those from before its pass, its model's other requests of
that pass run again (`LaunchedGradients`).
"""

from __future__ import annotations

import logging
import math
from collections.abc import Callable
from dataclasses import dataclass

from .. import faults
from .cycle_plan import Request
from ..requests.futures import FutureStore
from ..errors import MachineFault
from .isolation import Quarantine, run_isolating
from ..runtime.model_runtime import ModelRuntime
from .request_failures import answer_or_fail, is_users_fault, only_loaded
from .request_parts import LaunchedGradients, PartsLedger
from ..requests.kinds import FBOutcome, FBWork
from ..runtime.adapters import GradientSnapshot
from ..runtime.pass_io import PassStats, PendingPass, ReadyPass
from ..store.tables import Store

log = logging.getLogger(__name__)

# One request's share of a launched pass: the pass, and the request's index in it (its outcome is
# read after the cycle's wait).
LaunchedOutcome = tuple[PendingPass | ReadyPass, int]


@dataclass
class Failed:
    """A compute request's failure: its error, and whether the others of its pass were rerun without it."""

    error: BaseException
    others_rerun: bool


class ComputeRequests:
    def __init__(self, runtime: ModelRuntime, futures: FutureStore, store: Store):
        self.runtime = runtime
        self.futures = futures
        self.store = store  # the dashboard's loss curves
        self.parts = PartsLedger()  # requests in parts: their outcomes so far, their gradients before
        self.launched = LaunchedGradients()  # the cycle's other forward_backwards, until answered
        self.quarantine = Quarantine()  # keys whose request failed a pass alone: their requests run apart
        # metrics
        self.tokens_total = 0
        self.last_cycle_tokens = 0
        self.last_cycle_models = 0
        self.fused_passes = 0  # passes that carried more than one model
        self.failed_passes = 0  # passes that raised (each rerun in halves: isolation.py)
        self.isolation_reruns = 0  # the passes run to find which request failed a pass

    def launch(self, reqs: list[Request], answering: Callable[[], None]) -> list[tuple[Request, LaunchedOutcome]]:
        """The cycle's passes launched (`_passes`); `answering()` runs once they are, before any
        answer. A request that failed its pass is answered here, and a failed request in parts has
        its model's gradients put back as they were before its first part, before the cycle's
        optimizer steps are launched. The others' outcomes are read after the wait (`answer`)."""
        pending = [r for r in reqs if self.futures.is_pending(r.request_id)]
        live = [r for r in only_loaded(self.runtime, self.futures, pending) if not self._images_failed(r)]
        if not live:
            answering()
            return []
        for r in live:
            if r.first_part:
                before = None if r.payload.forward_only else GradientSnapshot(self.runtime.adapter(r.model_id))
                self.parts.begin(r.request_id, before)
        self.last_cycle_tokens = self.last_cycle_models = 0
        results = self._passes(live)
        for r, out in zip(live, results):  # until answered: a failure from here on takes its gradients back
            if not (isinstance(out, Failed) or r.in_parts or r.payload.forward_only):
                self.launched.launched(r.request_id, r.payload, out[0].before)
        faults.check("after_forward_backward")
        faults.check_poisoned("cycle.poisoned_after_passes", (d.tokens for r in live for d in r.payload.data))
        answering()
        launched = []
        for r, out in zip(live, results):
            if isinstance(out, Failed):
                self._fail(r, out)
            else:
                launched.append((r, out))
        self.settle()
        return launched

    def answer(self, launched: list[tuple[Request, LaunchedOutcome]]) -> None:
        """Each launched request's outcome, read after the cycle's wait: a part of a request in
        parts (`final=False`) adds its outcome to the request's earlier parts' (`PartsLedger`),
        and the last part answers. A part whose request already failed is dropped."""
        read: dict[int, list[FBOutcome]] = {}  # per launched pass (by id), its outcomes
        finished: list[tuple[Request, FBOutcome]] = []
        for r, (pending, j) in launched:
            if id(pending) not in read:
                read[id(pending)] = pending.outcomes()
                self._count(pending.stats)
            out = read[id(pending)][j]
            if r.in_parts:
                out = self.parts.add(r.request_id, out, last=r.final)
            if r.final:
                finished.append((r, out))
        # The dashboard's loss curves; written before the results are visible, so it never lags a client.
        self.store.losses.record([
            (r.model_id, r.seq_id, self.runtime.adapters[r.model_id].step, r.payload.forward_only, out.metrics["loss:sum"])
            for r, out in finished if math.isfinite(out.metrics.get("loss:sum", math.nan))])
        for r, out in finished:
            answer_or_fail(self.futures, r, lambda req: self._resolve(req, out))
        self.settle()

    def _resolve(self, req: Request, out: FBOutcome) -> None:
        faults.check_poisoned("answer.poisoned", (d.tokens for d in req.payload.data))
        self.futures.resolve(req.request_id, out.to_wire(), is_proto=True)

    def settle(self) -> None:
        """Put back the gradients of the requests that failed after their pass (request_parts.py)."""
        self.parts.settle(self._failed)
        self.launched.settle(self._failed, self.runtime.adapters.get, self._rerun)

    def _failed(self, request_id: str) -> bool | None:
        """None while the request is pending; then whether it failed."""
        if self.futures.is_pending(request_id):
            return None
        result = self.futures.lookup(request_id)
        return result is None or result.failed

    def _rerun(self, works: list[FBWork]) -> None:
        """A model's requests of a pass run again, their outputs unread: only their gradients count."""
        try:
            self.runtime.launch_forward_backward(works)
            self.runtime.wait()
        except Exception:  # they ran a moment ago: the device is failing
            log.exception("model %s: its answered requests could not run again after another of its pass failed; "
                          "its next optim_step lacks their gradients", works[0].model_id)

    def _passes(self, reqs: list[Request]) -> list[LaunchedOutcome | Failed]:
        """Each request's launched outcome, or the error it failed with alone: one fused pass of
        the trusted keys' requests, then one per quarantined key, each launched again in parts
        where launching raises until the request that made it raise is found (isolation.py)."""
        batches: dict[str | None, list[int]] = {}
        for i, r in enumerate(reqs):
            batches.setdefault(_key(r) if _key(r) in self.quarantine else None, []).append(i)
        results: list[LaunchedOutcome | Failed] = [None] * len(reqs)  # type: ignore[list-item]
        for key, idx in batches.items():
            report = run_isolating(self._launch_pass, [reqs[i].payload for i in idx],
                                   [reqs[i].model_id for i in idx])
            self.failed_passes += report.failed_passes
            self.isolation_reruns += report.reruns
            for j, i in enumerate(idx):
                error = report.errors[j]
                results[i] = report.outcomes[j] if error is None else Failed(error, report.reruns > 0)
            for j in report.culprits:
                self.quarantine.convict(_key(reqs[idx[j]]))
            if key is not None and not report.failed_passes:
                self.quarantine.passed(key)
        return results

    def _launch_pass(self, works: list[FBWork]) -> list[LaunchedOutcome]:
        pending = self.runtime.launch_forward_backward(works)
        return [(pending, j) for j in range(len(works))]

    def _count(self, stats: PassStats) -> None:
        self.tokens_total += stats.tokens
        self.last_cycle_tokens += stats.tokens
        self.last_cycle_models += stats.models
        self.fused_passes += stats.models > 1

    def _images_failed(self, req: Request) -> bool:
        """Whether the request's images could not be processed (image_decodes.py, before its cycle was
        planned): it fails before the pass, which it would fail."""
        error = next((p.error for p in req.payload.images if p.error is not None), None)
        if error is not None:
            self._fail(req, Failed(error, others_rerun=False))
        return error is not None

    def _fail(self, req: Request, failure: Failed) -> None:
        """A request that failed a pass of its own (or a pass the machine failed): its own failure."""
        error = failure.error
        user = is_users_fault(error)
        if not user:
            log.error("%s of model %s failed: %s: %s", req.kind, req.model_id, type(error).__name__, error,
                      exc_info=error)
        alone = ("; it failed in a pass of its own: the requests of its cycle ran again without it"
                 if failure.others_rerun and not isinstance(error, MachineFault) else "")
        self.futures.fail(req.request_id, f"{req.kind} failed{'' if user else ' on the server'}: "
                                          f"{type(error).__name__}: {error}{alone}", "user" if user else "server")


def _key(req: Request) -> str:
    """Whose request it is, for the quarantine: its API key's owner (its model where none is known)."""
    return req.owner or req.model_id
