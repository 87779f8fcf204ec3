"""`DeviceLoop`: the one thread that uses a served model's accelerator.

It alternates a training cycle and a sampling round:

    plan = scheduler.next_plan()              what runs together (scheduler.py)
    worker.run_cycle(plan)                    fused pass, optimizer steps, saves/loads (worker.py);
                                              optim_steps that arrive during the pass join it
    every request of the plan still pending   fails with category "server": nothing hangs
    sampling.run_round(...)                   if the sampling backend shares the device

and sleeps when neither side has work, until a producer rings `wake` (a training submission
or a sampling job) or the scheduler's next deadline passes. Whatever raises inside a cycle is
confined to that cycle: its unanswered requests fail, the loop goes on.

The sampling share: when training is waiting, a sampling round still gets as long as the last
training cycle took, capped at `round_seconds`: an even split of the device, so neither side
starves the other.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable

from .. import faults
from ..requests.futures import FutureStore
from ..sampling.backend import SamplingBackend
from .scheduler import ClockCycleScheduler, CyclePlan
from .worker import TrainingWorker

log = logging.getLogger(__name__)

UNANSWERED = ("the server finished its cycle without answering this request (a server bug); "
              "resubmit it")


class DeviceLoop:
    def __init__(self, scheduler: ClockCycleScheduler, worker: TrainingWorker, sampling: SamplingBackend,
                 futures: FutureStore, wake: threading.Event, *, round_seconds: float = 0.25,
                 on_cycle: Callable[[CyclePlan, float], None] = lambda plan, seconds: None,
                 name: str = "device-loop"):
        self.scheduler = scheduler
        self.worker = worker
        self.sampling = sampling
        self.futures = futures
        self.wake = wake  # set by producers (the scheduler's on_work, the sampling backend)
        self.round_seconds = round_seconds
        self.on_cycle = on_cycle  # observation (api/metrics.py), after each training cycle
        self.name = name
        self._stopping = False
        self._thread: threading.Thread | None = None

    def start(self) -> None:
        self._thread = threading.Thread(target=self._run, name=self.name, daemon=True)
        self._thread.start()

    def stop(self, timeout: float = 60.0) -> None:
        """Finish the running cycle or round, then stop; then shut the sampling backend down."""
        if self._stopping:
            return
        self._stopping = True
        self.wake.set()
        if self._thread is not None:
            self._thread.join(timeout)
            if self._thread.is_alive():
                log.error("%s did not stop within %.0fs; leaving its sampling jobs to the restart", self.name,
                          timeout)
                return
        self.sampling.shutdown()

    def is_alive(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    def _run(self) -> None:
        while not self._stopping:
            self.wake.clear()  # a producer that rings from here on is seen by the next wait
            faults.hold("device_loop.before_plan")
            plan, deadline = self.scheduler.next_plan()
            if plan:
                self._training_cycle(plan)
            if self.sampling.wants_round():
                self._sampling_round()
            elif not plan and not self._stopping:
                self.wake.wait(None if deadline is None else max(0.0, deadline - self.scheduler.clock()))

    def _training_cycle(self, plan: CyclePlan) -> None:
        start = time.perf_counter()
        message = UNANSWERED
        try:
            self.worker.run_cycle(plan, on_compute_answered=self.scheduler.compute_done,
                                  join_optim=lambda: self._join_optim(plan))
        except Exception as e:
            log.exception("a training cycle failed")
            message = f"the server failed while running this request ({type(e).__name__}: {e}); resubmit it"
        # A cycle that raised fails the parts of split requests too: their later parts are dropped.
        answerable = plan.finishing if message is UNANSWERED else plan.requests
        try:
            unanswered = self.futures.fail_unanswered([r.request_id for r in answerable], message)
            if unanswered and message is UNANSWERED:
                log.error("a cycle left %d request(s) unanswered; failed them", len(unanswered))
        except Exception:
            log.exception("could not fail the unanswered requests of a cycle")
        for r in plan.compute:  # a request in parts that failed: its later parts never run
            if not r.final and not self.futures.is_pending(r.request_id):
                self.scheduler.drop_rest(r)
        seconds = time.perf_counter() - start
        self.scheduler.cycle_done(plan, seconds)
        try:
            self.on_cycle(plan, seconds)
        except Exception:  # an observer must not stop the loop
            log.exception("a cycle observer failed")

    def _join_optim(self, plan: CyclePlan) -> None:
        """Between the cycle's pass and its optimizer steps: the optim_steps that arrived meanwhile
        join the plan, and while a pipelining model's is still expected (scheduler.join_optim) the
        loop waits for it, the device busy with the pass launched before (a producer's ring ends
        the wait early; the loop plans again after every cycle, so no other ring is lost)."""
        while True:
            self.wake.clear()
            wait_until = self.scheduler.join_optim(plan)
            if wait_until is None or self._stopping:
                return
            self.wake.wait(max(0.0, wait_until - self.scheduler.clock()))

    def _sampling_round(self) -> None:
        share = min(self.scheduler.last_cycle_seconds, self.round_seconds)
        try:
            self.sampling.run_round(should_yield=self.scheduler.has_training_work, min_seconds=share,
                                    max_seconds=self.round_seconds)
        except Exception:  # the backend answers its own jobs; the loop must live on
            log.exception("a sampling round failed")
