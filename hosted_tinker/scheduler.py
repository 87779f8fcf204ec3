"""`ClockCycleScheduler`: per-model `seq_id` order, many models per cycle.

Each model's requests are kept in `seq_id` order (the SDK posts chunks concurrently and out of
order, and retries). A cycle takes, from every model with ready work, the longest prefix of the
form

    (forward | forward_backward)*  optim_step?  (create | save | load | unload)*

and runs all the models' compute in one fused pass, then their optimizer steps, then their
saves/loads. Per-model order is never violated: a model's optim_step runs after all of its
earlier compute, a save sees exactly the weights its `seq_id` position implies, and compute
that follows a save/load waits for the next cycle.

The scheduler owns no thread: the `DeviceLoop` (device_loop.py) asks it for the next plan and
sleeps until work arrives (`on_work`) or the plan's deadline passes; nothing sleeps and
re-checks. The only deadline between cycles: a `seq_id` gap that has been open for
`gap_timeout_s` is skipped (the SDK advances its counter even when a submission failed for good).
Time comes from an injectable `clock`.

A plan visits only the models that may have work: those a request, a skip or a dropped part
woke since they were last planned, and those whose gap just timed out. A model whose queue is
empty, or blocked on a missing `seq_id`, leaves the round-robin order until one of those wakes it,
so a plan costs the same however many idle training runs are open.

A pipelining client (the SDK posts optim_step as soon as its forward_backward POST returns) gets
its forward_backward run at once, and its optim_step joins the running cycle if it arrives
before the cycle launches its optimizer steps (`join_optim`): on a CPU the pass is longer than
the SDK's gap between the two POSTs. A model seen pipelining gets up to `gather_window_s` after
its forward_backward arrived for its optim_step to come, waited out while the device runs the
pass (device_loop.py), never before it.

An unload closes the model's queue, so nothing per model outlives it; a request that still
reaches a closed queue comes back in the next plan as `orphaned`, to be answered there.

Fair share: a cycle packs compute up to `max_tokens_per_cycle` tokens and `max_models_per_cycle`
models, taking models in round-robin order; a model left out (or cut short) for lack of room
goes first in the next cycle, and the models that ran go last, so a tenant with a huge queue
cannot starve small ones. A plan stops looking once the budget is full: with a thousand busy
runs it still visits about `max_models_per_cycle` of them.

A compute request larger than a cycle's budget arrives in parts (`Request.more`, made by
`services/training.py`): each cycle plans its next part alone (`final=False` until the last), the
request keeps its place in its model's queue until the last part is planned, and the other
models' work and sampling rounds run between the parts. Gradients add up across cycles exactly as
across micro-batches, so no one request holds the device for longer than one cycle's budget. Each
part is its model's only compute in its cycle (the model's earlier compute runs a cycle before the
first part, its later compute a cycle after the last), so that a failed part can put back exactly
the gradients from before the request (worker.py); a failed request's later parts are dropped
(`drop_rest`).
"""

from __future__ import annotations

import heapq
import itertools
import logging
import threading
import time
from dataclasses import dataclass, field, replace
from enum import IntEnum
from typing import Callable

from .cycle_plan import COMPUTE, CyclePlan, Request
from .request_types import FBWork, RequestKind

log = logging.getLogger(__name__)

class _ModelQueue:
    def __init__(self, next_seq: int):
        self.next_seq = next_seq
        self.pending: dict[int, Request] = {}
        self.skipped: set[int] = set()
        self.gap_since: float | None = None
        self.pipelined = False  # learned: this client posts optim_step before fb completes
        self.in_flight_compute = False

    def advance_past_skipped(self) -> None:
        while self.next_seq in self.skipped:
            self.skipped.discard(self.next_seq)
            self.next_seq += 1

    def ready(self) -> list[Request]:
        out, seq = [], self.next_seq
        while seq in self.pending:
            out.append(self.pending[seq])
            seq += 1
            while seq in self.skipped:
                seq += 1
        return out


class _Stage(IntEnum):
    """Where a model's prefix of a cycle stands: its compute, then at most one optim_step, then
    its tail requests (create, save, load, unload)."""
    COMPUTE = 0
    OPTIM = 1
    TAIL = 2


@dataclass
class _CycleBudget:
    """A cycle's fair share: compute up to `max_tokens` tokens and `max_models` models, whole
    requests only, and at least one compute request per cycle however large."""
    max_tokens: int
    max_models: int
    tokens: int = 0
    models: set[str] = field(default_factory=set)

    @property
    def full(self) -> bool:
        """No other model's compute fits: the plan need look at no more models."""
        return self.tokens >= self.max_tokens or len(self.models) >= self.max_models

    def admit(self, mid: str, take: list[Request]) -> int:
        """How many of `take`'s leading compute requests fit, counted in."""
        admitted = 0
        for r in take:
            if r.kind not in COMPUTE:
                break
            over = (self.tokens + r.tokens > self.max_tokens
                    or (mid not in self.models and len(self.models) >= self.max_models))
            if over and (self.tokens > 0 or admitted > 0):
                break
            self.tokens += r.tokens
            admitted += 1
            self.models.add(mid)
        return admitted


def _waits_for_images(r: Request, ask: bool = False) -> bool:
    """Whether a compute request's images are not decoded yet (`ask`: asking for their decode)."""
    if not isinstance(r.payload, FBWork) or not r.payload.images:
        return False
    if ask:
        return not all([p.ready() for p in r.payload.images])  # a list: every one is asked, not only the first
    return any(p.waiting for p in r.payload.images)


def _earliest(a: float | None, b: float | None) -> float | None:
    return b if a is None else a if b is None else min(a, b)


class ClockCycleScheduler:
    """Plans clock cycles; owns no thread. The `DeviceLoop` asks it for the next plan and reports
    back when that plan has run. Producers (API threads) call `submit` & co.; each of them rings
    `on_work`, the loop's wake-up. `clock` is injectable so that tests step time by hand."""

    def __init__(self, *, on_work: Callable[[], None] = lambda: None, clock: Callable[[], float] = time.monotonic,
                 gap_timeout_s: float = 120.0, gather_window_s: float = 0.05, max_tokens_per_cycle: int = 1 << 16,
                 max_models_per_cycle: int = 64):
        self._on_work = on_work
        self.clock = clock
        self.max_tokens_per_cycle = max_tokens_per_cycle
        self.max_models_per_cycle = max_models_per_cycle
        self.gap_timeout_s = gap_timeout_s
        self.gather_window_s = gather_window_s
        self._lock = threading.Lock()
        self._queues: dict[str, _ModelQueue] = {}
        # The models a plan visits, in round-robin order (rotated every cycle): those that may have
        # ready work. Idle models are not in it, so a plan never costs more for them.
        self._rr: dict[str, None] = {}
        self._gaps: list[tuple[float, str]] = []  # heap of (when its gap times out, model) of parked models
        self._queued = 0  # requests in all the queues (the queue_depth gauge, read every cycle)
        self._after: list[Request] = []
        self._orphaned: list[Request] = []  # requests of models with no queue (unloaded): answered next cycle
        # metrics
        self.cycles = 0
        self.plan_visits = 0  # models looked at by plans (a plan visits only models that may have work)
        self.joined_optim_steps = 0  # optim_steps that joined the cycle running their model's compute
        self.last_cycle_models = 0
        self.last_cycle_requests = 0
        self.last_cycle_seconds = 0.0
        self.cycle_seconds_total = 0.0

    # -- producer side (API threads) --------------------------------------------------------------
    def open_model(self, model_id: str, first_seq: int = 0) -> None:
        with self._lock:
            if model_id not in self._queues:
                self._queues[model_id] = _ModelQueue(first_seq)

    def has_model(self, model_id: str) -> bool:
        with self._lock:
            return model_id in self._queues

    def expected_seq(self, model_id: str) -> int | None:
        with self._lock:
            q = self._queues.get(model_id)
            return None if q is None else q.next_seq

    def submit(self, req: Request) -> None:
        """Queue a request in its model's seq_id order. A model with no queue (it was unloaded
        after the caller checked) gets the request back in the next plan's `orphaned` list, so
        it is answered like any other instead of being lost."""
        with self._lock:
            req.arrived_at = self.clock()
            q = self._queues.get(req.model_id)
            if q is None:
                self._orphaned.append(req)
            else:
                if req.seq_id < q.next_seq or req.seq_id in q.pending:
                    raise ValueError(f"seq_id {req.seq_id} of model {req.model_id} was already used")
                if req.kind == RequestKind.OPTIM_STEP and q.in_flight_compute:
                    q.pipelined = True
                q.pending[req.seq_id] = req
                self._queued += 1
                self._rr.setdefault(req.model_id)
        self._on_work()

    def compute_done(self, model_ids) -> None:
        """The worker is about to resolve these models' compute futures (mid-cycle): an
        optim_step that arrives from now on may have been posted after the client saw its
        result, so it does not count as pipelining. (Told before the first answer: a client
        that waits for its results is never taken for a pipelining one.)"""
        with self._lock:
            for mid in model_ids:
                q = self._queues.get(mid)
                if q is not None:
                    q.in_flight_compute = False

    def has_training_work(self) -> bool:
        """Whether a cycle could run now (a model whose next request waits for its images could not)."""
        with self._lock:
            heads = (self._queues[m].ready()[:1] for m in self._rr)
            return any(head and not _waits_for_images(head[0]) for head in heads) or bool(self._after or self._orphaned)

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
            q = self._queues.get(model_id)
            if q is None or seq_id < q.next_seq or seq_id in q.pending:
                return
            q.skipped.add(seq_id)
            q.advance_past_skipped()
            self._rr.setdefault(model_id)
        self._on_work()

    def drop_rest(self, req: Request) -> None:
        """A request in parts failed (a part of it, or its cycle): its later parts never run, and its
        model's next request is free to go."""
        with self._lock:
            q = self._queues.get(req.model_id)
            rest = q.pending.get(req.seq_id) if q is not None else None
            if rest is None or rest.request_id != req.request_id:
                return
            self._take(q, rest)
            self._rr.setdefault(req.model_id)
        self._on_work()

    def queue_depth(self) -> int:
        with self._lock:
            return self._queued

    def pipelining_models(self) -> int:
        """Models whose client is known to pipeline: their cycle waits for its optim_step while the pass runs."""
        with self._lock:
            return sum(q.pipelined for q in self._queues.values())

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
        """Add to the running `plan` the optim_steps that arrived since it was planned, each right
        after its model's compute in the plan (the model's next request, and the model has nothing
        else in the plan); return until when the cycle may wait for more (a model seen pipelining,
        up to `gather_window_s` after its forward_backward arrived), or None."""
        with self._lock:
            now = self.clock()
            last = {r.model_id: r for r in plan.compute}  # each model's last compute request in the plan
            for r in plan.optim + plan.tail:
                last.pop(r.model_id, None)
            wait_until: float | None = None
            for mid, compute in last.items():
                q = self._queues.get(mid)
                if q is None or not compute.final:  # unloaded, or a request in parts with more to come
                    continue
                following = q.pending.get(q.next_seq)
                if following is not None and following.kind == RequestKind.OPTIM_STEP:
                    self._take(q, following)
                    plan.optim.append(following)
                    self.joined_optim_steps += 1
                elif following is None and q.pipelined:
                    until = compute.arrived_at + self.gather_window_s
                    if now < until:
                        wait_until = _earliest(wait_until, until)
                    else:
                        q.pipelined = False  # the window passed with no optim_step: stop waiting for one
            return wait_until

    def cycle_done(self, plan: CyclePlan, seconds: float) -> None:
        """The plan has run (every request answered): account for the cycle."""
        with self._lock:
            for mid in plan.models:
                q = self._queues.get(mid)
                if q is not None:
                    q.in_flight_compute = False
            self.last_cycle_models = len(plan.models)
            self.last_cycle_requests = len(plan.requests)
            self.last_cycle_seconds = seconds
            self.cycle_seconds_total += seconds

    def _plan(self) -> tuple[CyclePlan, float | None]:
        """Build the next cycle (called with the lock held). Also returns the next deadline."""
        now = self.clock()
        self._wake_timed_out_gaps(now)
        plan = CyclePlan()
        deferred: list[str] = []  # models cut short by the budget: first in line next cycle
        ran: list[str] = []  # models with work in this plan: last in line next cycle
        waiting: list[str] = []  # models whose next request waits for its images: they keep their place
        order, unvisited = list(self._rr), []
        budget = _CycleBudget(self.max_tokens_per_cycle, self.max_models_per_cycle)
        for i, mid in enumerate(order):
            if budget.full:  # the rest keep their place, ahead of the models that ran
                unvisited = order[i:]
                break
            take = self._ready_prefix(mid, now)
            admitted = budget.admit(mid, take)
            if admitted < sum(r.kind in COMPUTE for r in take):
                take = take[:admitted]
                deferred.append(mid)
            if take:
                self._add(plan, take)
                if mid not in deferred:
                    ran.append(mid)
            elif mid in self._rr:  # ready work it cannot start yet (its images are being processed)
                waiting.append(mid)
        unloads = [r.model_id for r in self._after if r.kind == RequestKind.UNLOAD_MODEL]
        plan.tail.extend(self._after)
        self._after = []
        if plan:  # a model whose queue the plan emptied leaves the order now, not at its next visit
            self._rr = dict.fromkeys(m for m in deferred + unvisited + waiting + ran
                                     if m in self._rr and self._queues[m].pending)
        for mid in unloads:
            self._close(mid)
        plan.orphaned, self._orphaned = self._orphaned, []
        return plan, (None if plan or not self._gaps else self._gaps[0][0])

    def _ready_prefix(self, mid: str, now: float) -> list[Request]:
        """What the model may add to this cycle (`_prefix` of its ready requests). A model with
        nothing ready leaves the round-robin order: for good while its queue is empty, parked
        until its gap times out while its next seq_id is missing (any request wakes it sooner)."""
        self.plan_visits += 1
        q = self._queues[mid]
        ready = q.ready()
        if not ready:
            ready = self._handle_gap(mid, q, now)
            if not ready:
                del self._rr[mid]
                return []
        q.gap_since = None
        return self._prefix(ready)

    def _wake_timed_out_gaps(self, now: float) -> None:
        """Models parked on a gap whose timeout has come go back into the round-robin order."""
        while self._gaps and self._gaps[0][0] <= now:
            _, mid = heapq.heappop(self._gaps)
            if mid in self._queues:  # else unloaded since it was parked
                self._rr.setdefault(mid)

    def _close(self, model_id: str) -> None:
        """Forget a model that is being unloaded: nothing per model outlives it (a parked model's
        entry in the gap heap is skipped when it comes due)."""
        q = self._queues.pop(model_id, None)
        if q is None:
            return
        self._orphaned.extend(q.pending[s] for s in sorted(q.pending))
        self._queued -= len(q.pending)
        self._rr.pop(model_id, None)

    def _handle_gap(self, mid: str, q: _ModelQueue, now: float) -> list[Request]:
        """A model whose next seq_id is missing: parked until gap_timeout_s has passed, then the gap
        is skipped."""
        if not q.pending:
            return []
        if q.gap_since is None:
            q.gap_since = now
        if now - q.gap_since < self.gap_timeout_s:
            heapq.heappush(self._gaps, (q.gap_since + self.gap_timeout_s, mid))
            return []
        lowest = min(q.pending)
        log.warning("model %s: seq_id %d..%d never arrived after %.0fs; skipping the gap",
                    mid, q.next_seq, lowest - 1, self.gap_timeout_s)
        q.next_seq, q.gap_since = lowest, None
        return q.ready()

    def _prefix(self, ready: list[Request]) -> list[Request]:
        """The longest prefix of the module docstring's form. A part of a request in parts is its
        model's only compute in its cycle: the model's gradients before its first part are then the
        ones a failed part puts back (worker.py). A compute request whose images are not decoded yet
        ends it (`_images_ready`)."""
        take: list[Request] = []
        stage = _Stage.COMPUTE
        for i, r in enumerate(ready):
            if r.kind in COMPUTE:
                if stage > _Stage.COMPUTE or (r.in_parts and take) or (take and take[-1].in_parts):
                    break
                if not self._images_ready(ready, i):
                    break
            elif r.kind == RequestKind.OPTIM_STEP:
                if stage > _Stage.COMPUTE:
                    break
                stage = _Stage.OPTIM
            else:
                stage = _Stage.TAIL
            take.append(r)
            if r.more:  # a split request: nothing after it until its last part
                break
        return take

    def _images_ready(self, ready: list[Request], i: int) -> bool:
        """Whether compute request `ready[i]`'s images (those of its part to plan) are decoded. If not,
        their decode is asked for (image_decodes.py, whose end rings `on_work`), and so is that of the
        model's next compute requests that one cycle's budget holds with it: they decode side by side
        while other models' cycles run, and nothing queued further back is decoded yet."""
        if not _waits_for_images(ready[i], ask=True):
            return True
        tokens = ready[i].tokens
        for later in itertools.islice(ready, i + 1, None):
            tokens += later.tokens
            if later.kind not in COMPUTE or later.in_parts or tokens > self.max_tokens_per_cycle:
                break
            _waits_for_images(later, ask=True)
        return False

    def _take(self, q: _ModelQueue, r: Request) -> None:
        """`r`, the next request of its queue, leaves it: the queue moves on to the next seq_id."""
        del q.pending[r.seq_id]
        self._queued -= 1
        q.next_seq = r.seq_id + 1
        q.advance_past_skipped()

    def _add(self, plan: CyclePlan, take: list[Request]) -> None:
        q = self._queues[take[0].model_id]
        for r in take:
            if r.more:  # plan this part; the rest keeps the request's place in the queue
                payload, tokens = r.more[0]
                q.pending[r.seq_id] = replace(r, payload=payload, tokens=tokens, more=r.more[1:], part=r.part + 1)
                q.in_flight_compute = True
                plan.compute.append(replace(r, more=[], final=False))
                return
            self._take(q, r)
            if r.kind in COMPUTE:
                q.in_flight_compute = True  # until compute_done / cycle_done
                plan.compute.append(r)
            elif r.kind == RequestKind.OPTIM_STEP:
                plan.optim.append(r)
            else:
                plan.tail.append(r)
