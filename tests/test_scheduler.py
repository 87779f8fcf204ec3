"""Unit tests of `ClockCycleScheduler`: per-model seq_id order, the cycle prefix rule, fusion of
many models per cycle, gap handling, pipelining, and the thread's robustness.

The scheduler runs its real thread; `run_cycle` is a recorder. Requests queued before `start()`
are all visible to the first cycle, which makes the plans deterministic.
"""

from __future__ import annotations

import threading
import time

import pytest

from hosted_tinker.scheduler import ClockCycleScheduler, CyclePlan, Request

WAIT = 5.0  # upper bound for anything that should happen "at once"


class Recorder:
    """A fake `run_cycle`: records every plan; can hold a cycle open or raise on demand."""

    def __init__(self) -> None:
        self.plans: list[CyclePlan] = []
        self._cv = threading.Condition()
        self.entered = threading.Event()  # set when a cycle starts running
        self.gate: threading.Event | None = None  # when set to an Event, cycles block on it
        self.raise_next = False

    def __call__(self, plan: CyclePlan) -> None:
        self.entered.set()
        if self.gate is not None:
            assert self.gate.wait(WAIT), "test never released the gate"
        with self._cv:
            self.plans.append(plan)
            self._cv.notify_all()
        if self.raise_next:
            self.raise_next = False
            raise RuntimeError("boom inside run_cycle")

    def wait_for(self, n: int, timeout: float = WAIT) -> list[CyclePlan]:
        with self._cv:
            assert self._cv.wait_for(lambda: len(self.plans) >= n, timeout), \
                f"expected {n} cycles, saw {len(self.plans)}"
            return list(self.plans)


def req(model: str, seq: int, kind: str = "forward_backward") -> Request:
    return Request(request_id=f"{model}-{seq}", kind=kind, model_id=model, seq_id=seq)


def seqs(reqs: list[Request]) -> list[tuple[str, int]]:
    return [(r.model_id, r.seq_id) for r in reqs]


@pytest.fixture
def rec() -> Recorder:
    return Recorder()


@pytest.fixture
def make_sched(rec):
    made: list[ClockCycleScheduler] = []

    def make(**kw) -> ClockCycleScheduler:
        kw.setdefault("gap_timeout_s", 60.0)
        kw.setdefault("gather_window_s", 0.01)
        s = ClockCycleScheduler(rec, **kw)
        made.append(s)
        return s

    yield make
    for s in made:
        if rec.gate is not None:
            rec.gate.set()
        s.stop(timeout=WAIT)


def test_out_of_order_seq_ids_run_in_order(rec, make_sched):
    """seq_ids 2 and 3 arriving before 1 wait for it, then all run in seq_id order."""
    s = make_sched()
    s.open_model("a", first_seq=1)
    s.start()
    s.submit(req("a", 3))
    s.submit(req("a", 2))
    time.sleep(0.05)  # give the thread a chance to (wrongly) run something
    assert rec.plans == [] and s.cycles == 0
    s.submit(req("a", 1))
    (plan,) = rec.wait_for(1)
    assert seqs(plan.compute) == [("a", 1), ("a", 2), ("a", 3)]
    assert s.expected_seq("a") == 4


def test_prefix_rule_never_runs_optim_before_earlier_compute(rec, make_sched):
    """fb1,opt2,fb3,opt4 queued together run as (fb1+opt2) then (fb3+opt4), never opt4 early."""
    s = make_sched()
    s.open_model("a", first_seq=1)
    s.submit(req("a", 1))
    s.submit(req("a", 2, "optim_step"))
    s.submit(req("a", 3))
    s.submit(req("a", 4, "optim_step"))
    s.start()
    p1, p2 = rec.wait_for(2)
    assert seqs(p1.compute) == [("a", 1)] and seqs(p1.optim) == [("a", 2)] and p1.tail == []
    assert seqs(p2.compute) == [("a", 3)] and seqs(p2.optim) == [("a", 4)] and p2.tail == []


def test_forward_and_forward_backward_share_a_prefix(rec, make_sched):
    """(fwd|fb)* optim tail*: fwd,fb,fwd,optim,save all fit one cycle."""
    s = make_sched()
    s.open_model("a")
    for i, kind in enumerate(["forward", "forward_backward", "forward", "optim_step", "save_weights"]):
        s.submit(req("a", i, kind))
    s.start()
    (plan,) = rec.wait_for(1)
    assert [r.kind for r in plan.compute] == ["forward", "forward_backward", "forward"]
    assert seqs(plan.optim) == [("a", 3)] and seqs(plan.tail) == [("a", 4)]


def test_several_models_fused_in_one_cycle(rec, make_sched):
    """Ready compute of three models lands in one plan.compute; each model's optim in plan.optim."""
    s = make_sched()
    for m in ("a", "b", "c"):
        s.open_model(m)
        s.submit(req(m, 0))
        s.submit(req(m, 1))
        s.submit(req(m, 2, "optim_step"))
    s.start()
    (plan,) = rec.wait_for(1)
    assert sorted(seqs(plan.compute)) == [(m, i) for m in ("a", "b", "c") for i in (0, 1)]
    for m in ("a", "b", "c"):  # per-model order inside the fused list
        assert [r.seq_id for r in plan.compute if r.model_id == m] == [0, 1]
    assert sorted(seqs(plan.optim)) == [("a", 2), ("b", 2), ("c", 2)]
    assert plan.models == {"a", "b", "c"}


def test_save_after_compute_same_cycle_compute_after_save_next_cycle(rec, make_sched):
    """A save following compute is in the same cycle's tail; compute after a save waits a cycle."""
    s = make_sched()
    s.open_model("a")
    s.submit(req("a", 0))
    s.submit(req("a", 1, "save_weights"))
    s.submit(req("a", 2))
    s.submit(req("a", 3, "load_weights"))
    s.start()
    p1, p2 = rec.wait_for(2)
    assert seqs(p1.compute) == [("a", 0)] and seqs(p1.tail) == [("a", 1)]
    assert seqs(p2.compute) == [("a", 2)] and seqs(p2.tail) == [("a", 3)]


def test_tail_keeps_per_model_order(rec, make_sched):
    """Consecutive tail requests (save, save_for_sampler, load) run in seq_id order."""
    s = make_sched()
    s.open_model("a")
    kinds = ["save_weights", "save_weights_for_sampler", "load_weights"]
    for i, kind in enumerate(kinds):
        s.submit(req("a", i, kind))
    s.start()
    (plan,) = rec.wait_for(1)
    assert [r.kind for r in plan.tail] == kinds


def test_submit_after_queue_runs_at_end_of_next_cycle(rec, make_sched):
    """An unload (no seq_id) goes at the end of the next cycle's tail, after seq'd work."""
    s = make_sched()
    s.open_model("a")
    s.submit(req("a", 0))
    s.submit(req("a", 1, "save_weights"))
    s.submit_after_queue(Request("unload", "unload_model", "a", -1))
    s.start()
    (plan,) = rec.wait_for(1)
    assert [r.request_id for r in plan.tail] == ["a-1", "unload"]


def test_skip_of_rejected_seq_id_unblocks_later_ones(rec, make_sched):
    """skip() of the missing seq_id lets later ones run at once (no gap timeout)."""
    s = make_sched()
    s.open_model("a")
    s.start()
    s.submit(req("a", 1))
    s.submit(req("a", 2))
    time.sleep(0.05)
    assert rec.plans == []
    s.skip("a", 0)
    (plan,) = rec.wait_for(1)
    assert seqs(plan.compute) == [("a", 1), ("a", 2)]


def test_skip_ahead_of_next_seq_is_jumped_over(rec, make_sched):
    """A seq_id skipped before its turn is jumped over when the queue reaches it."""
    s = make_sched()
    s.open_model("a")
    s.skip("a", 2)
    for i in (0, 1, 3):
        s.submit(req("a", i))
    s.start()
    (plan,) = rec.wait_for(1)
    assert seqs(plan.compute) == [("a", 0), ("a", 1), ("a", 3)]
    assert s.expected_seq("a") == 4


def test_gap_that_never_fills_is_skipped_after_timeout(rec, make_sched):
    """A gap open for gap_timeout_s is skipped, and the thread wakes on its own deadline."""
    s = make_sched(gap_timeout_s=0.2)
    s.open_model("a")
    s.open_model("b")
    s.start()
    t0 = time.monotonic()
    s.submit(req("a", 1))  # seq 0 never arrives; nothing else ever notifies the thread
    (plan,) = rec.wait_for(1)
    elapsed = time.monotonic() - t0
    assert seqs(plan.compute) == [("a", 1)]
    assert 0.18 <= elapsed < 3.0
    assert s.expected_seq("a") == 2


def test_gap_in_one_model_does_not_block_another(rec, make_sched):
    """Model b's ready work runs while model a waits for its missing seq_id."""
    s = make_sched()
    s.open_model("a")
    s.open_model("b")
    s.submit(req("a", 1))
    s.submit(req("b", 0))
    s.start()
    (plan,) = rec.wait_for(1)
    assert seqs(plan.compute) == [("b", 0)]
    assert s.queue_depth() == 1


def test_used_seq_id_and_unknown_model_raise(rec, make_sched):
    """Re-submitting a pending or already-run seq_id raises ValueError; an unknown model KeyError."""
    s = make_sched()
    s.open_model("a")
    s.submit(req("a", 0))
    with pytest.raises(ValueError, match="already used"):
        s.submit(req("a", 0))  # still pending
    s.start()
    rec.wait_for(1)
    with pytest.raises(ValueError, match="already used"):
        s.submit(req("a", 0))  # already run
    with pytest.raises(KeyError):
        s.submit(req("nope", 0))


def test_pipelined_model_gathers_fb_with_its_optim(rec, make_sched):
    """An optim_step arriving while compute is in flight marks the model pipelined; its next fb
    then waits (up to gather_window_s) for the optim so both run in one cycle."""
    s = make_sched(gather_window_s=WAIT)
    s.open_model("a")
    rec.gate = threading.Event()
    s.start()
    s.submit(req("a", 0))
    assert rec.entered.wait(WAIT)  # fb0 is in flight
    s.submit(req("a", 1, "optim_step"))  # posted before fb0 finished: pipelining
    rec.gate.set()
    p1, p2 = rec.wait_for(2)
    assert seqs(p1.compute) == [("a", 0)] and p1.optim == []
    assert seqs(p2.optim) == [("a", 1)]

    t0 = time.monotonic()
    s.submit(req("a", 2))
    time.sleep(0.05)
    assert len(rec.plans) == 2  # fb2 is held for its optim, not run alone
    s.submit(req("a", 3, "optim_step"))
    plans = rec.wait_for(3)
    assert time.monotonic() - t0 < WAIT / 2  # the optim's arrival ended the wait, not the window
    assert seqs(plans[2].compute) == [("a", 2)] and seqs(plans[2].optim) == [("a", 3)]


def test_pipelined_hold_expires_after_gather_window(rec, make_sched):
    """A held fb whose optim never comes runs alone once gather_window_s has passed."""
    s = make_sched(gather_window_s=0.2)
    s.open_model("a")
    rec.gate = threading.Event()
    s.start()
    s.submit(req("a", 0))
    assert rec.entered.wait(WAIT)
    s.submit(req("a", 1, "optim_step"))
    rec.gate.set()
    rec.wait_for(2)
    t0 = time.monotonic()
    s.submit(req("a", 2))
    plans = rec.wait_for(3)
    assert time.monotonic() - t0 >= 0.18
    assert seqs(plans[2].compute) == [("a", 2)] and plans[2].optim == []


def test_held_pipelined_model_rides_along_with_another_models_cycle(rec, make_sched):
    """A pipelined model's held fb joins a cycle that another model's work triggers."""
    s = make_sched(gather_window_s=WAIT)
    s.open_model("a")
    s.open_model("b")
    rec.gate = threading.Event()
    s.start()
    s.submit(req("a", 0))
    assert rec.entered.wait(WAIT)
    s.submit(req("a", 1, "optim_step"))
    rec.gate.set()
    rec.wait_for(2)
    s.submit(req("a", 2))
    time.sleep(0.05)
    s.submit(req("b", 0))
    plans = rec.wait_for(3)
    assert sorted(seqs(plans[2].compute)) == [("a", 2), ("b", 0)]


def test_unpipelined_model_does_not_wait(rec, make_sched):
    """A model that never pipelined runs its fb at once even with a long gather window."""
    s = make_sched(gather_window_s=WAIT)
    s.open_model("a")
    s.start()
    t0 = time.monotonic()
    s.submit(req("a", 0))
    rec.wait_for(1)
    assert time.monotonic() - t0 < WAIT / 2


def test_exception_in_run_cycle_does_not_kill_thread(rec, make_sched):
    """run_cycle raising is logged; the thread keeps serving the next cycles."""
    s = make_sched()
    s.open_model("a")
    rec.raise_next = True
    s.start()
    s.submit(req("a", 0))
    rec.wait_for(1)
    s.submit(req("a", 1))
    plans = rec.wait_for(2)
    assert seqs(plans[1].compute) == [("a", 1)]
    assert s._thread is not None and s._thread.is_alive()


def test_stop_returns_when_idle_and_after_running_cycle(rec, make_sched):
    """stop() wakes an idle thread and returns; with a cycle in flight it lets it finish first."""
    s = make_sched()
    s.start()
    t0 = time.monotonic()
    s.stop(timeout=WAIT)
    assert time.monotonic() - t0 < 2.0 and not s._thread.is_alive()

    s2 = make_sched()
    s2.open_model("a")
    rec.gate = threading.Event()
    s2.start()
    s2.submit(req("a", 0))
    assert rec.entered.wait(WAIT)
    stopper = threading.Thread(target=s2.stop, kwargs={"timeout": WAIT})
    stopper.start()
    rec.gate.set()
    stopper.join(WAIT)
    assert not stopper.is_alive() and not s2._thread.is_alive()
    assert len(rec.plans) == 1  # the running cycle completed
