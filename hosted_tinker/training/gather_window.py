"""`GatherWindow`: which clients pipeline, and how long a cycle waits for their optim_step.

A pipelining client (the SDK posts optim_step as soon as its forward_backward POST returns) gets
its forward_backward run at once, and its optim_step joins the running cycle if it arrives
before the cycle launches its optimizer steps (`join`): on a CPU the pass is longer than the
SDK's gap between the two POSTs. A run is seen pipelining when its optim_step arrives while its
compute is planned and not yet answered; such a run gets up to `gather_window_s` after its
forward_backward arrived for its optim_step to come, waited out while the device runs the pass
(device_loop.py), never before it. A window that passes with no optim_step stops the waiting for
that run until it is seen pipelining again.

Not thread-safe: the scheduler calls it under its lock.
"""

from __future__ import annotations

from .cycle_plan import CyclePlan
from ..requests.kinds import RequestKind
from .run_queues import RunQueues


class GatherWindow:
    def __init__(self, gather_window_s: float):
        self.gather_window_s = gather_window_s
        self._in_flight: set[str] = set()  # runs whose compute is planned, its answers not yet handed out
        self._pipelining: set[str] = set()  # learned: this client posts optim_step before fb completes
        self.joined_optim_steps = 0  # optim_steps that joined the cycle running their run's compute

    @property
    def pipelining(self) -> int:
        """How many runs are known to pipeline."""
        return len(self._pipelining)

    def compute_planned(self, mid: str) -> None:
        self._in_flight.add(mid)

    def compute_answered(self, mids) -> None:
        """These runs' compute answers are being handed out: an optim_step that arrives from now on
        may have been posted after the client saw its result, so it does not count as pipelining."""
        self._in_flight.difference_update(mids)

    def optim_step_queued(self, mid: str) -> None:
        if mid in self._in_flight:
            self._pipelining.add(mid)

    def forget(self, mid: str) -> None:
        """The run is unloaded."""
        self._in_flight.discard(mid)
        self._pipelining.discard(mid)

    def join(self, plan: CyclePlan, queues: RunQueues, now: float) -> float | None:
        """Add to the running `plan` the optim_steps that arrived since it was planned, each right
        after its run's compute in the plan (the run's next request, and the run has nothing else
        in the plan); return until when the cycle may wait for more (a run seen pipelining, up to
        `gather_window_s` after its forward_backward arrived), or None."""
        last = {r.model_id: r for r in plan.compute}  # each run's last compute request in the plan
        for r in plan.optim + plan.tail:
            last.pop(r.model_id, None)
        wait_until: float | None = None
        for mid, compute in last.items():
            if mid not in queues or not compute.final:  # unloaded, or a request in parts with more to come
                continue
            following = queues.next_request(mid)
            if following is not None and following.kind == RequestKind.OPTIM_STEP:
                queues.take(following)
                plan.optim.append(following)
                self.joined_optim_steps += 1
            elif following is None and mid in self._pipelining:
                until = compute.arrived_at + self.gather_window_s
                if now < until:
                    wait_until = until if wait_until is None else min(wait_until, until)
                else:
                    self._pipelining.discard(mid)  # the window passed with no optim_step: stop waiting for one
        return wait_until
