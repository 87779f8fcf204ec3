"""`ClockCycleScheduler`: plans clock cycles, many training runs per cycle, each in `seq_id` order.

A cycle takes, from every run with ready work, the longest prefix of its requests that keeps its
order (cycle_prefix.py: compute, then at most one optim_step, then saves, loads, create, unload)
and runs all the runs' compute in one fused pass, then their optimizer steps, then the rest. The
planner composes four parts, each with one job:

- `RunQueues` (run_queues.py): each run's requests in `seq_id` order; skipped `seq_id`s, gaps and
  their timeout (`gap_timeout_s`); a request in parts keeping its place until its last part;
  closed queues and the requests orphaned by an unload.
- `cycle_prefix` (cycle_prefix.py): what a cycle may take of one run, and the images it waits for.
- `FairShare` (fair_share.py): the round-robin order of the runs that may have work, and the
  cycle's budget (`max_tokens_per_cycle`, `max_models_per_cycle`).
- `GatherWindow` (gather_window.py): which clients pipeline, and how long a running cycle waits
  for their optim_step to join it (`join_optim`, `gather_window_s`).

The scheduler owns no thread: the `DeviceLoop` (device_loop.py) asks it for the next plan and
sleeps until work arrives (`on_work`) or the plan's deadline passes (a gap's timeout); nothing
sleeps and re-checks. One lock guards all four parts. Time comes from an injectable `clock`.

A plan visits only the runs that may have work: those a request, a skip or a dropped part woke
since they were last planned, and those whose gap just timed out, so a plan costs the same however
many idle training runs are open. An unload (`submit_after_queue`) closes the run's queue at the
end of the next plan, so nothing per run outlives it; a request that still reaches a closed queue
comes back in the next plan as `orphaned`, to be answered there.

A compute request larger than a cycle's budget arrives in parts (`Request.more`, made by
`services/training.py`): each cycle plans its next part alone (`final=False` until the last), and
the other runs' work and sampling rounds run between the parts. Gradients add up across cycles
exactly as across micro-batches, so no one request holds the device for longer than one cycle's
budget; a failed request's later parts are dropped (`drop_rest`).
"""

from __future__ import annotations

import threading
import time
from typing import Callable

from .cycle_plan import COMPUTE, CyclePlan, Request
from .cycle_prefix import cycle_prefix, waits_for_images
from .fair_share import FairShare
from .gather_window import GatherWindow
from ..requests.kinds import RequestKind
from .run_queues import RunQueues

__all__ = ["ClockCycleScheduler", "CyclePlan", "Request"]


class ClockCycleScheduler:
    """Plans clock cycles; owns no thread. The `DeviceLoop` asks it for the next plan and reports
    back when that plan has run. Producers (API threads) call `submit` & co.; each of them rings
    `on_work`, the loop's wake-up. `clock` is injectable so that tests step time by hand."""

    def __init__(self, *, on_work: Callable[[], None] = lambda: None, clock: Callable[[], float] = time.monotonic,
                 gap_timeout_s: float = 120.0, gather_window_s: float = 0.05, max_tokens_per_cycle: int = 1 << 16,
                 max_models_per_cycle: int = 64):
        self._on_work = on_work
        self.clock = clock
        self._lock = threading.Lock()
        self.queues = RunQueues(gap_timeout_s)
        self.share = FairShare(max_tokens_per_cycle, max_models_per_cycle)
        self.gather_window = GatherWindow(gather_window_s)
        self._after: list[Request] = []  # unloads: at the end of the next plan
        # metrics
        self.cycles = 0
        self.plan_visits = 0  # runs looked at by plans (a plan visits only runs that may have work)
        self.last_cycle_models = 0
        self.last_cycle_requests = 0
        self.last_cycle_seconds = 0.0
        self.cycle_seconds_total = 0.0

    @property
    def max_tokens_per_cycle(self) -> int:
        return self.share.max_tokens_per_cycle

    # -- producer side (API threads) --------------------------------------------------------------
    def open_model(self, model_id: str, first_seq: int = 0) -> None:
        with self._lock:
            self.queues.open(model_id, first_seq)

    def has_model(self, model_id: str) -> bool:
        with self._lock:
            return model_id in self.queues

    def expected_seq(self, model_id: str) -> int | None:
        with self._lock:
            return self.queues.expected_seq(model_id)

    def submit(self, req: Request) -> None:
        """Queue a request in its model's seq_id order. A model with no queue (it was unloaded
        after the caller checked) gets the request back in the next plan's `orphaned` list, so
        it is answered like any other instead of being lost."""
        with self._lock:
            req.arrived_at = self.clock()
            if self.queues.add(req):
                if req.kind == RequestKind.OPTIM_STEP:
                    self.gather_window.optim_step_queued(req.model_id)
                self.share.wake(req.model_id)
        self._on_work()

    def compute_done(self, model_ids) -> None:
        """The worker is about to resolve these models' compute futures (mid-cycle): an
        optim_step that arrives from now on may have been posted after the client saw its
        result, so it does not count as pipelining. (Told before the first answer: a client
        that waits for its results is never taken for a pipelining one.)"""
        with self._lock:
            self.gather_window.compute_answered(model_ids)

    def has_training_work(self) -> bool:
        """Whether a cycle could run now (a model whose next request waits for its images could not)."""
        with self._lock:
            heads = (self.queues.head(m) for m in self.share)
            return (any(head is not None and not waits_for_images(head) for head in heads)
                    or bool(self._after or self.queues.orphaned))

    def submit_after_queue(self, req: Request) -> None:
        """An unload_model (no seq_id): runs at the end of the next cycle, and closes the model's
        queue when planned: requests still queued, or arriving later, are answered as orphaned."""
        with self._lock:
            req.arrived_at = self.clock()
            self._after.append(req)
        self._on_work()

    def skip(self, model_id: str, seq_id: int) -> None:
        """A submission with this seq_id was rejected: count the seq_id as consumed."""
        with self._lock:
            if not self.queues.skip(model_id, seq_id):
                return
            self.share.wake(model_id)
        self._on_work()

    def drop_rest(self, req: Request) -> None:
        """A request in parts failed (a part of it, or its cycle): its later parts never run, and its
        model's next request is free to go."""
        with self._lock:
            if not self.queues.drop_rest(req):
                return
            self.share.wake(req.model_id)
        self._on_work()

    def queue_depth(self) -> int:
        with self._lock:
            return self.queues.queued

    def pipelining_models(self) -> int:
        """Models whose client is known to pipeline: their cycle waits for its optim_step while the pass runs."""
        with self._lock:
            return self.gather_window.pipelining

    # -- the device loop's side -------------------------------------------------------------------
    def next_plan(self) -> tuple[CyclePlan, float | None]:
        """The next cycle's plan (possibly empty), and when to ask again if nothing arrives
        before then (a seq_id gap's timeout; None: never)."""
        with self._lock:
            plan, deadline = self._plan()
            if plan:
                # Counted as it starts: the count never lags an answer the cycle gives.
                self.cycles += 1
            return plan, deadline

    def join_optim(self, plan: CyclePlan) -> float | None:
        """Add to the running `plan` the optim_steps that arrived since it was planned; return until
        when the cycle may wait for more, or None (`GatherWindow.join`)."""
        with self._lock:
            return self.gather_window.join(plan, self.queues, self.clock())

    def cycle_done(self, plan: CyclePlan, seconds: float) -> None:
        """The plan has run (every request answered): account for the cycle."""
        with self._lock:
            self.gather_window.compute_answered(plan.models)
            self.last_cycle_models = len(plan.models)
            self.last_cycle_requests = len(plan.requests)
            self.last_cycle_seconds = seconds
            self.cycle_seconds_total += seconds

    def _plan(self) -> tuple[CyclePlan, float | None]:
        """Build the next cycle (called with the lock held). Also returns the next deadline."""
        now = self.clock()
        for mid in self.queues.timed_out_gaps(now):  # parked runs whose gap timed out are back in line
            self.share.wake(mid)
        plan = CyclePlan()
        turn = self.share.turn()
        for mid in turn.runs():
            take = turn.admit(mid, self._ready_prefix(mid, now))
            if take:
                self._add(plan, take)
            elif mid in self.share:  # ready work it cannot start yet (its images are being processed)
                turn.wait(mid)
        unloads = [r.model_id for r in self._after if r.kind == RequestKind.UNLOAD_MODEL]
        plan.tail.extend(self._after)
        self._after = []
        if plan:
            self.share.rotate(turn, self.queues.with_pending)
        for mid in unloads:
            self._close(mid)
        plan.orphaned = self.queues.take_orphaned()
        return plan, (None if plan else self.queues.next_gap_timeout())

    def _ready_prefix(self, mid: str, now: float) -> list[Request]:
        """What the model may add to this cycle (`cycle_prefix` of its ready requests). A model with
        nothing ready leaves the round-robin order: for good while its queue is empty, parked
        until its gap times out while its next seq_id is missing (any request wakes it sooner)."""
        self.plan_visits += 1
        ready = self.queues.ready(mid, now)
        if not ready:
            self.share.leave(mid)
            return []
        return cycle_prefix(ready, self.max_tokens_per_cycle)

    def _close(self, model_id: str) -> None:
        """Forget a model that is being unloaded: nothing per model outlives it."""
        if self.queues.close(model_id):
            self.share.leave(model_id)
            self.gather_window.forget(model_id)

    def _add(self, plan: CyclePlan, take: list[Request]) -> None:
        for r in take:
            if r.more:  # plan this part; the rest keeps the request's place in the queue
                self.gather_window.compute_planned(r.model_id)
                plan.compute.append(self.queues.take_part(r))
                return
            self.queues.take(r)
            if r.kind in COMPUTE:
                self.gather_window.compute_planned(r.model_id)  # until compute_done / cycle_done
                plan.compute.append(r)
            elif r.kind == RequestKind.OPTIM_STEP:
                plan.optim.append(r)
            else:
                plan.tail.append(r)
