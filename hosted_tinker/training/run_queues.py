"""`RunQueues`: each training run's requests, in `seq_id` order, as the scheduler plans them.

The SDK posts chunks concurrently and out of order, and retries, so a run's requests are kept by
`seq_id` and handed out only from its next expected one on. A `seq_id` a submission consumed
without queueing a request (it was rejected) is `skip`ped. A gap (the next `seq_id` is missing)
that has been open for `gap_timeout_s` is skipped too: the SDK advances its counter even when a
submission failed for good. A run waiting on a gap is parked in a heap by when its gap times out,
so the planner looks at it again then, and not before (unless a request wakes it).

A request in parts (`Request.more`) keeps its place at the head of its run's queue until its last
part is taken (`take_part`); `drop_rest` drops the parts left of one that failed.

An unloaded run's queue is closed: its queued requests, and any that still arrive for it, are
kept as `orphaned`, for the next plan to answer. Not thread-safe: the scheduler calls it under its
lock.
"""

from __future__ import annotations

import heapq
import logging
from dataclasses import replace

from .cycle_plan import Request

log = logging.getLogger(__name__)


class RunQueue:
    """One training run's queued requests by `seq_id`, and the `seq_id` it expects next."""

    def __init__(self, next_seq: int):
        self.next_seq = next_seq
        self.pending: dict[int, Request] = {}
        self.skipped: set[int] = set()
        self.gap_since: float | None = None

    def advance_past_skipped(self) -> None:
        while self.next_seq in self.skipped:
            self.skipped.discard(self.next_seq)
            self.next_seq += 1

    def ready(self) -> list[Request]:
        """The requests that may run, in order: from the next expected `seq_id` to the first gap."""
        out, seq = [], self.next_seq
        while seq in self.pending:
            out.append(self.pending[seq])
            seq += 1
            while seq in self.skipped:
                seq += 1
        return out


class RunQueues:
    """Every open training run's `RunQueue`, the runs parked on a gap, and the orphaned requests."""

    def __init__(self, gap_timeout_s: float):
        self.gap_timeout_s = gap_timeout_s
        self._queues: dict[str, RunQueue] = {}
        self._gaps: list[tuple[float, str]] = []  # heap of (when its gap times out, run) of parked runs
        self.queued = 0  # requests in all the queues (the queue_depth gauge, read every cycle)
        self.orphaned: list[Request] = []  # requests of runs with no queue (unloaded): answered next cycle

    def __contains__(self, model_id: str) -> bool:
        return model_id in self._queues

    def open(self, model_id: str, first_seq: int) -> None:
        if model_id not in self._queues:
            self._queues[model_id] = RunQueue(first_seq)

    def expected_seq(self, model_id: str) -> int | None:
        q = self._queues.get(model_id)
        return None if q is None else q.next_seq

    def add(self, req: Request) -> bool:
        """Queue `req` by its `seq_id`; False if its run has no queue (it is kept as orphaned)."""
        q = self._queues.get(req.model_id)
        if q is None:
            self.orphaned.append(req)
            return False
        if req.seq_id < q.next_seq or req.seq_id in q.pending:
            raise ValueError(f"seq_id {req.seq_id} of model {req.model_id} was already used")
        q.pending[req.seq_id] = req
        self.queued += 1
        return True

    def skip(self, model_id: str, seq_id: int) -> bool:
        """Count a rejected submission's `seq_id` as consumed; False if there was nothing to skip."""
        q = self._queues.get(model_id)
        if q is None or seq_id < q.next_seq or seq_id in q.pending:
            return False
        q.skipped.add(seq_id)
        q.advance_past_skipped()
        return True

    def drop_rest(self, req: Request) -> bool:
        """Drop the parts left of a request in parts that failed; False if none were left."""
        q = self._queues.get(req.model_id)
        rest = q.pending.get(req.seq_id) if q is not None else None
        if rest is None or rest.request_id != req.request_id:
            return False
        self.take(rest)
        return True

    def with_pending(self, model_ids: list[str]) -> list[str]:
        """Those of `model_ids` whose queue holds requests (one pass: a plan asks it of every run in line)."""
        queues = self._queues
        return [m for m in model_ids if m in queues and queues[m].pending]

    def head(self, model_id: str) -> Request | None:
        """The run's next request, if it is queued."""
        ready = self._queues[model_id].ready()[:1]
        return ready[0] if ready else None

    def next_request(self, model_id: str) -> Request | None:
        """The request at the run's next expected `seq_id`, if any (None too for a closed queue)."""
        q = self._queues.get(model_id)
        return None if q is None else q.pending.get(q.next_seq)

    def ready(self, model_id: str, now: float) -> list[Request]:
        """The run's ready requests; none while its next `seq_id` is missing, the run then parked
        until its gap times out, and after that the gap skipped."""
        q = self._queues[model_id]
        ready = q.ready()
        if not ready:
            ready = self._handle_gap(model_id, q, now)
            if not ready:
                return []
        q.gap_since = None
        return ready

    def _handle_gap(self, model_id: str, q: RunQueue, now: float) -> list[Request]:
        """A run whose next seq_id is missing: parked until gap_timeout_s has passed, then the gap
        is skipped."""
        if not q.pending:
            return []
        if q.gap_since is None:
            q.gap_since = now
        if now - q.gap_since < self.gap_timeout_s:
            heapq.heappush(self._gaps, (q.gap_since + self.gap_timeout_s, model_id))
            return []
        lowest = min(q.pending)
        log.warning("model %s: seq_id %d..%d never arrived after %.0fs; skipping the gap",
                    model_id, q.next_seq, lowest - 1, self.gap_timeout_s)
        q.next_seq, q.gap_since = lowest, None
        return q.ready()

    def next_gap_timeout(self) -> float | None:
        """When the earliest parked run's gap times out (None: no run is parked)."""
        return self._gaps[0][0] if self._gaps else None

    def timed_out_gaps(self, now: float) -> list[str]:
        """The parked runs whose gap timeout has come (and still open): they are no longer parked."""
        woken = []
        while self._gaps and self._gaps[0][0] <= now:
            _, model_id = heapq.heappop(self._gaps)
            if model_id in self._queues:  # else unloaded since it was parked
                woken.append(model_id)
        return woken

    def take(self, r: Request) -> None:
        """`r`, the next request of its queue, leaves it: the queue moves on to the next seq_id."""
        q = self._queues[r.model_id]
        del q.pending[r.seq_id]
        self.queued -= 1
        q.next_seq = r.seq_id + 1
        q.advance_past_skipped()

    def take_part(self, r: Request) -> Request:
        """The next part of `r`, a request in parts at the head of its queue, to plan now; the rest
        keeps the request's place in the queue."""
        payload, tokens = r.more[0]
        self._queues[r.model_id].pending[r.seq_id] = replace(r, payload=payload, tokens=tokens, more=r.more[1:],
                                                              part=r.part + 1)
        return replace(r, more=[], final=False)

    def close(self, model_id: str) -> bool:
        """Forget an unloaded run: its queued requests become orphaned, and nothing of it outlives it
        (its entry in the gap heap, if parked, is skipped when it comes due). False if it had no queue."""
        q = self._queues.pop(model_id, None)
        if q is None:
            return False
        self.orphaned.extend(q.pending[s] for s in sorted(q.pending))
        self.queued -= len(q.pending)
        return True

    def take_orphaned(self) -> list[Request]:
        out, self.orphaned = self.orphaned, []
        return out
