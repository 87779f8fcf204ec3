"""Unit tests of `DeviceLoop`: the one thread that alternates training cycles and sampling rounds,
and answers every request of a cycle when the cycle ends.

Real parts: the scheduler, the `FutureStore` over a real SQLite `Store`, the loop's thread.
Stand-ins (the model runtime cannot be made to fail on demand): the worker answers, forgets or
raises as each test asks, and the sampling backend records its rounds. Each test waits for the
loop's cycle observer, which runs once a cycle's answers are settled.
"""

from __future__ import annotations

import json
import threading

import pytest

from hosted_tinker.training.device_loop import UNANSWERED, DeviceLoop
from hosted_tinker.requests.futures import FutureStore
from hosted_tinker.requests.kinds import RequestKind
from hosted_tinker.sampling.backend import SamplingBackend
from hosted_tinker.training.scheduler import ClockCycleScheduler, CyclePlan, Request
from hosted_tinker.store.tables import Store

WAIT = 120.0  # hang guard on anything that should happen at once; never reached when all is well


class CycleLog:
    """The loop's cycle observer: sees each plan once the loop has settled all its answers."""

    def __init__(self) -> None:
        self.plans: list[CyclePlan] = []
        self._cv = threading.Condition()

    def __call__(self, plan: CyclePlan, seconds: float) -> None:
        with self._cv:
            self.plans.append(plan)
            self._cv.notify_all()

    def wait_for(self, n: int) -> list[CyclePlan]:
        with self._cv:
            assert self._cv.wait_for(lambda: len(self.plans) >= n, WAIT), f"expected {n} cycles, saw {len(self.plans)}"
            return list(self.plans)


class ScriptedWorker:
    """Stands in for `TrainingWorker.run_cycle`: runs `behaviour(plan)` per cycle."""

    def __init__(self, futures: FutureStore):
        self.futures = futures
        self.behaviour = self.answer_all
        self.gate: threading.Event | None = None  # when set to an Event, cycles block on it
        self.entered = threading.Event()

    def answer_all(self, plan: CyclePlan) -> None:
        for r in plan.requests:
            self.futures.resolve(r.request_id, {"ok": r.request_id})

    def run_cycle(self, plan: CyclePlan, on_compute_answered, join_optim=lambda: None) -> None:
        self.entered.set()
        if self.gate is not None:
            assert self.gate.wait(WAIT), "test never released the gate"
        self.behaviour(plan)
        on_compute_answered({r.model_id for r in plan.compute})


class RecordingBackend(SamplingBackend):
    """A backend that shares the device: wants `rounds_wanted` rounds, records each one's budget."""

    def __init__(self):
        self.rounds_wanted = 0
        self.rounds: list[dict] = []
        self.round_done = threading.Event()
        self.shutdowns = 0

    def submit(self, job) -> None:
        raise AssertionError("not used")

    def cancel(self, job) -> None:
        raise AssertionError("not used")

    def adapter_updated(self, model_id, saved_to=None) -> None:
        pass

    def shutdown(self) -> None:
        self.shutdowns += 1

    def wants_round(self) -> bool:
        return self.rounds_wanted > 0

    def run_round(self, *, should_yield, min_seconds: float, max_seconds: float) -> None:
        self.rounds_wanted -= 1
        self.rounds.append({"training_waiting": should_yield(), "min": min_seconds, "max": max_seconds})
        self.round_done.set()


@pytest.fixture
def parts(tmp_path):
    store = Store(tmp_path / "db.sqlite3")
    futures = FutureStore(store)
    wake = threading.Event()
    scheduler = ClockCycleScheduler(on_work=wake.set, gap_timeout_s=60.0, gather_window_s=0.01)
    worker = ScriptedWorker(futures)
    backend = RecordingBackend()
    loop = DeviceLoop(scheduler, worker, backend, futures, wake, round_seconds=0.25, on_cycle=CycleLog())
    yield loop
    if worker.gate is not None:
        worker.gate.set()
    loop.stop(timeout=WAIT)
    store.close()


def submit(loop: DeviceLoop, model: str, seq: int, kind: RequestKind = RequestKind.FORWARD_BACKWARD) -> str:
    rid, _ = loop.futures.create("alice", kind, model, seq)
    loop.scheduler.submit(Request(rid, kind, model, seq))
    return rid


def outcome(loop: DeviceLoop, rid: str) -> dict:
    result = loop.futures.lookup(rid)
    assert result is not None, f"{rid} was left pending"
    return json.loads(result.payload)


def test_an_exception_fails_exactly_the_cycles_unanswered_requests_and_the_loop_goes_on(parts):
    """A cycle that answers one request and then raises: that request keeps its answer, the
    cycle's other requests fail with category "server" naming the error, the next cycle runs."""
    loop = parts
    worker = loop.worker

    def answer_first_then_raise(plan: CyclePlan) -> None:
        worker.futures.resolve(plan.compute[0].request_id, {"ok": 1})
        raise UnicodeError("encoding the result failed")

    worker.behaviour = answer_first_then_raise
    loop.scheduler.open_model("a")
    ids = [submit(loop, "a", 0), submit(loop, "a", 1), submit(loop, "a", 2, RequestKind.OPTIM_STEP)]
    loop.start()
    loop.on_cycle.wait_for(1)
    assert outcome(loop, ids[0]) == {"ok": 1}
    for rid in ids[1:]:
        body = outcome(loop, rid)
        assert body["category"] == "server" and "UnicodeError: encoding the result failed" in body["error"]

    worker.behaviour = worker.answer_all
    rid = submit(loop, "a", 3)
    loop.on_cycle.wait_for(2)
    assert outcome(loop, rid) == {"ok": rid}
    assert loop.scheduler.cycles == 2


def test_a_request_the_worker_forgot_is_failed_when_its_cycle_ends(parts):
    """Even with no exception, no request of a finished cycle stays pending."""
    loop = parts
    loop.worker.behaviour = lambda plan: None
    loop.scheduler.open_model("a")
    rid = submit(loop, "a", 0)
    loop.start()
    loop.on_cycle.wait_for(1)
    assert outcome(loop, rid) == {"error": UNANSWERED, "category": "server"}


def test_orphaned_requests_are_part_of_the_cycle(parts):
    """A request whose model's queue is gone reaches the worker in `orphaned` and is answered."""
    loop = parts
    loop.worker.behaviour = lambda plan: None
    rid = submit(loop, "gone", 5)  # no queue was ever opened for this model
    loop.start()
    (plan,) = loop.on_cycle.wait_for(1)
    assert [r.request_id for r in plan.orphaned] == [rid]
    assert outcome(loop, rid)["category"] == "server"  # the recorder forgot it: the loop answered


def test_sampling_gets_a_round_after_a_cycle_and_when_woken(parts):
    """A backend that wants rounds gets one after each training cycle, and one when woken with no
    training work; its budget is the last cycle's duration, capped at round_seconds."""
    loop = parts
    backend: RecordingBackend = loop.sampling
    loop.start()
    backend.rounds_wanted = 1
    loop.wake.set()  # what the backend does when a job arrives
    assert backend.round_done.wait(WAIT)
    assert backend.rounds == [{"training_waiting": False, "min": 0.0, "max": 0.25}]

    backend.round_done.clear()
    loop.worker.gate = threading.Event()
    loop.scheduler.open_model("a")
    submit(loop, "a", 0)
    assert loop.worker.entered.wait(WAIT)  # cycle 1 is running; a second request waits behind it
    submit(loop, "a", 1)
    backend.rounds_wanted = 1
    loop.worker.gate.set()
    assert backend.round_done.wait(WAIT)
    assert backend.rounds[1]["training_waiting"] is True  # told that training is waiting
    assert 0.0 <= backend.rounds[1]["min"] <= 0.25 and backend.rounds[1]["max"] == 0.25
    loop.on_cycle.wait_for(2)


def test_the_loop_wakes_itself_at_the_schedulers_deadline(tmp_path):
    """A seq_id gap times out with nothing else ringing the loop: it wakes on the deadline."""
    store = Store(tmp_path / "db.sqlite3")
    futures = FutureStore(store)
    wake = threading.Event()
    scheduler = ClockCycleScheduler(on_work=wake.set, gap_timeout_s=0.2)
    worker = ScriptedWorker(futures)
    loop = DeviceLoop(scheduler, worker, RecordingBackend(), futures, wake, on_cycle=CycleLog())
    try:
        scheduler.open_model("a")
        loop.start()
        rid = submit(loop, "a", 1)  # seq 0 never arrives
        (plan,) = loop.on_cycle.wait_for(1)
        assert [r.request_id for r in plan.compute] == [rid]
    finally:
        loop.stop(timeout=WAIT)
        store.close()


def test_stop_finishes_the_running_cycle_then_shuts_sampling_down(parts):
    """stop() lets a running cycle finish and answer, then stops the thread and the backend."""
    loop = parts
    loop.worker.gate = threading.Event()
    loop.scheduler.open_model("a")
    loop.start()
    rid = submit(loop, "a", 0)
    assert loop.worker.entered.wait(WAIT)
    stopper = threading.Thread(target=loop.stop, kwargs={"timeout": WAIT})
    stopper.start()
    loop.worker.gate.set()
    stopper.join(WAIT)
    assert not stopper.is_alive() and not loop._thread.is_alive()
    assert outcome(loop, rid) == {"ok": rid}
    assert loop.sampling.shutdowns == 1


def test_stop_returns_when_idle(parts):
    loop = parts
    loop.start()
    loop.stop(timeout=WAIT)
    assert not loop._thread.is_alive() and loop.sampling.shutdowns == 1
