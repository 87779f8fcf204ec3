"""Unit tests of `ClockCycleScheduler`: per-model seq_id order, the cycle prefix rule, fusion of
many models per cycle, gap handling, pipelining, and closing an unloaded model's queue.

The scheduler is a planner with no thread: each test asks it for plans the way the device loop
does (`next_plan`, then `cycle_done`) and moves its injected clock by hand, so no test sleeps
and none depends on timing. The loop that drives it is tested in test_device_loop.py.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from hosted_tinker.training import run_queues
from hosted_tinker.requests.kinds import DatumWork, FBWork, RequestKind
from hosted_tinker.training.scheduler import ClockCycleScheduler, CyclePlan, Request
from hosted_tinker.models.vision import Pixels

GAP = 60.0
WINDOW = 0.05


class FakeClock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now

    def advance(self, seconds: float) -> None:
        self.now += seconds


def req(model: str, seq: int, kind: RequestKind = RequestKind.FORWARD_BACKWARD) -> Request:
    return Request(request_id=f"{model}-{seq}", kind=kind, model_id=model, seq_id=seq)


def seqs(reqs: list[Request]) -> list[tuple[str, int]]:
    return [(r.model_id, r.seq_id) for r in reqs]


@pytest.fixture
def clock() -> FakeClock:
    return FakeClock()


@pytest.fixture
def make_sched(clock):
    def make(**kw) -> ClockCycleScheduler:
        kw.setdefault("gap_timeout_s", GAP)
        kw.setdefault("gather_window_s", WINDOW)
        return ClockCycleScheduler(clock=clock, **kw)

    return make


def run(s: ClockCycleScheduler) -> CyclePlan:
    """Take the next plan and, if it has work, report it done, as the device loop does."""
    plan, _ = s.next_plan()
    if plan:
        s.cycle_done(plan, 0.0)
    return plan


def test_out_of_order_seq_ids_run_in_order(make_sched):
    """seq_ids 2 and 3 arriving before 1 wait for it, then all run in seq_id order."""
    s = make_sched()
    s.open_model("a", first_seq=1)
    s.submit(req("a", 3))
    s.submit(req("a", 2))
    assert not run(s)
    s.submit(req("a", 1))
    plan = run(s)
    assert seqs(plan.compute) == [("a", 1), ("a", 2), ("a", 3)]
    assert s.expected_seq("a") == 4 and s.cycles == 1


def test_prefix_rule_never_runs_optim_before_earlier_compute(make_sched):
    """fb1,opt2,fb3,opt4 queued together run as (fb1+opt2) then (fb3+opt4), never opt4 early."""
    s = make_sched()
    s.open_model("a", first_seq=1)
    s.submit(req("a", 1))
    s.submit(req("a", 2, RequestKind.OPTIM_STEP))
    s.submit(req("a", 3))
    s.submit(req("a", 4, RequestKind.OPTIM_STEP))
    p1, p2 = run(s), run(s)
    assert seqs(p1.compute) == [("a", 1)] and seqs(p1.optim) == [("a", 2)] and p1.tail == []
    assert seqs(p2.compute) == [("a", 3)] and seqs(p2.optim) == [("a", 4)] and p2.tail == []


def test_forward_and_forward_backward_share_a_prefix(make_sched):
    """(fwd|fb)* optim tail*: fwd,fb,fwd,optim,save all fit one cycle."""
    s = make_sched()
    s.open_model("a")
    for i, kind in enumerate([RequestKind.FORWARD, RequestKind.FORWARD_BACKWARD, RequestKind.FORWARD,
                              RequestKind.OPTIM_STEP, RequestKind.SAVE_WEIGHTS]):
        s.submit(req("a", i, kind))
    plan = run(s)
    assert [r.kind for r in plan.compute] == ["forward", "forward_backward", "forward"]
    assert seqs(plan.optim) == [("a", 3)] and seqs(plan.tail) == [("a", 4)]


def test_several_models_fused_in_one_cycle(make_sched):
    """Ready compute of three models lands in one plan.compute; each model's optim in plan.optim."""
    s = make_sched()
    for m in ("a", "b", "c"):
        s.open_model(m)
        s.submit(req(m, 0))
        s.submit(req(m, 1))
        s.submit(req(m, 2, "optim_step"))
    plan = run(s)
    assert sorted(seqs(plan.compute)) == [(m, i) for m in ("a", "b", "c") for i in (0, 1)]
    for m in ("a", "b", "c"):  # per-model order inside the fused list
        assert [r.seq_id for r in plan.compute if r.model_id == m] == [0, 1]
    assert sorted(seqs(plan.optim)) == [("a", 2), ("b", 2), ("c", 2)]
    assert plan.models == {"a", "b", "c"}


def test_save_after_compute_same_cycle_compute_after_save_next_cycle(make_sched):
    """A save following compute is in the same cycle's tail; compute after a save waits a cycle."""
    s = make_sched()
    s.open_model("a")
    s.submit(req("a", 0))
    s.submit(req("a", 1, RequestKind.SAVE_WEIGHTS))
    s.submit(req("a", 2))
    s.submit(req("a", 3, RequestKind.LOAD_WEIGHTS))
    p1, p2 = run(s), run(s)
    assert seqs(p1.compute) == [("a", 0)] and seqs(p1.tail) == [("a", 1)]
    assert seqs(p2.compute) == [("a", 2)] and seqs(p2.tail) == [("a", 3)]


def test_tail_keeps_per_model_order(make_sched):
    """Consecutive tail requests (save, save_for_sampler, load) run in seq_id order."""
    s = make_sched()
    s.open_model("a")
    kinds = [RequestKind.SAVE_WEIGHTS, RequestKind.SAVE_WEIGHTS_FOR_SAMPLER, RequestKind.LOAD_WEIGHTS]
    for i, kind in enumerate(kinds):
        s.submit(req("a", i, kind))
    assert [r.kind for r in run(s).tail] == kinds


def test_submit_after_queue_runs_at_end_of_next_cycle(make_sched):
    """An unload (no seq_id) goes at the end of the next cycle's tail, after seq'd work."""
    s = make_sched()
    s.open_model("a")
    s.submit(req("a", 0))
    s.submit(req("a", 1, RequestKind.SAVE_WEIGHTS))
    s.submit_after_queue(Request("unload", RequestKind.UNLOAD_MODEL, "a", -1))
    assert [r.request_id for r in run(s).tail] == ["a-1", "unload"]


def test_unload_closes_the_queue_and_hands_back_its_requests(make_sched):
    """An unload forgets the model (nothing per model outlives it, nothing is scanned again);
    its requests still queued, and any that arrive later, come back as `orphaned` to be answered."""
    s = make_sched()
    for m in ("a", "b"):
        s.open_model(m)
    s.submit(req("a", 0))
    s.submit(req("a", 2))  # behind a gap: still queued when the unload runs
    s.submit_after_queue(Request("unload", RequestKind.UNLOAD_MODEL, "a", -1))
    plan = run(s)
    assert seqs(plan.compute) == [("a", 0)] and [r.request_id for r in plan.tail] == ["unload"]
    assert [r.request_id for r in plan.orphaned] == ["a-2"]
    assert not s.has_model("a") and s.expected_seq("a") is None and s.queue_depth() == 0
    assert "a" not in s.queues and "a" not in s.share  # no per-model state left behind

    s.submit(req("a", 3))  # raced the unload past the API's has_model check
    assert not s.has_model("a") and s.has_training_work()
    plan = run(s)
    assert [r.request_id for r in plan.orphaned] == ["a-3"] and not plan.compute and not plan.tail
    s.submit(req("b", 0))
    assert seqs(run(s).compute) == [("b", 0)]


def test_skip_of_rejected_seq_id_unblocks_later_ones(make_sched):
    """skip() of the missing seq_id lets later ones run at once (no gap timeout)."""
    s = make_sched()
    s.open_model("a")
    s.submit(req("a", 1))
    s.submit(req("a", 2))
    assert not run(s)
    s.skip("a", 0)
    assert seqs(run(s).compute) == [("a", 1), ("a", 2)]


def test_skip_ahead_of_next_seq_is_jumped_over(make_sched):
    """A seq_id skipped before its turn is jumped over when the queue reaches it."""
    s = make_sched()
    s.open_model("a")
    s.skip("a", 2)
    for i in (0, 1, 3):
        s.submit(req("a", i))
    assert seqs(run(s).compute) == [("a", 0), ("a", 1), ("a", 3)]
    assert s.expected_seq("a") == 4


def test_gap_that_never_fills_is_skipped_after_timeout(clock, make_sched):
    """A gap open for gap_timeout_s is skipped; until then the plan says when to look again."""
    s = make_sched(gap_timeout_s=0.2)
    s.open_model("a")
    s.open_model("b")
    s.submit(req("a", 1))  # seq 0 never arrives
    plan, deadline = s.next_plan()
    assert not plan and deadline == pytest.approx(clock.now + 0.2)
    clock.advance(0.19)
    plan, deadline = s.next_plan()
    assert not plan and deadline == pytest.approx(clock.now + 0.01)
    clock.advance(0.01)
    plan, deadline = s.next_plan()
    assert seqs(plan.compute) == [("a", 1)] and deadline is None
    assert s.expected_seq("a") == 2


def test_gap_in_one_model_does_not_block_another(make_sched):
    """Model b's ready work runs while model a waits for its missing seq_id."""
    s = make_sched()
    s.open_model("a")
    s.open_model("b")
    s.submit(req("a", 1))
    s.submit(req("b", 0))
    assert seqs(run(s).compute) == [("b", 0)]
    assert s.queue_depth() == 1


def test_used_seq_id_raises(make_sched):
    """Re-submitting a pending or already-run seq_id raises ValueError."""
    s = make_sched()
    s.open_model("a")
    s.submit(req("a", 0))
    with pytest.raises(ValueError, match="already used"):
        s.submit(req("a", 0))  # still pending
    run(s)
    with pytest.raises(ValueError, match="already used"):
        s.submit(req("a", 0))  # already run


def test_every_producer_rings_the_loop(clock):
    """submit, skip and submit_after_queue each ring `on_work`, the device loop's wake-up."""
    rings = []
    s = ClockCycleScheduler(clock=clock, on_work=lambda: rings.append(1))
    s.open_model("a")
    s.submit(req("a", 1))
    s.skip("a", 0)
    s.submit_after_queue(Request("unload", RequestKind.UNLOAD_MODEL, "a", -1))
    assert len(rings) == 3


def _pipelined(s: ClockCycleScheduler) -> None:
    """Model a posts optim_step while its forward_backward is in flight: it pipelines (its optim
    came after the pass had started its optimizer steps, so it runs in the next cycle)."""
    s.open_model("a")
    s.submit(req("a", 0))
    plan, _ = s.next_plan()  # fb0 is in flight
    s.submit(req("a", 1, RequestKind.OPTIM_STEP))
    s.cycle_done(plan, 0.0)
    assert seqs(plan.compute) == [("a", 0)] and plan.optim == []
    assert seqs(run(s).optim) == [("a", 1)]


def test_a_pipelined_fb_starts_at_once_and_its_optim_joins_the_running_cycle(clock, make_sched):
    """A pipelining model's fb is planned at once (no wait before the pass); its optim_step, arriving
    while the pass runs, joins that cycle (join_optim): one cycle per step, and nothing left queued."""
    s = make_sched(gather_window_s=5.0)
    _pipelined(s)
    s.submit(req("a", 2))
    plan, deadline = s.next_plan()
    assert seqs(plan.compute) == [("a", 2)] and plan.optim == [] and deadline is None
    clock.advance(0.01)
    s.submit(req("a", 3, RequestKind.OPTIM_STEP))  # during the pass
    assert s.join_optim(plan) is None  # joined: nothing more to wait for
    s.cycle_done(plan, 0.0)
    assert seqs(plan.optim) == [("a", 3)] and s.gather_window.joined_optim_steps == 1
    assert not run(s) and s.queue_depth() == 0 and s.expected_seq("a") == 4


def test_the_running_cycle_waits_for_a_pipelining_models_optim_within_the_window(clock, make_sched):
    """A model seen pipelining whose optim has not come yet: join_optim says until when to wait for
    it (the gather window from the fb's arrival); once the window has passed it stops waiting, and
    stops expecting the model to pipeline."""
    s = make_sched(gather_window_s=0.2)
    _pipelined(s)
    s.submit(req("a", 2))
    plan, _ = s.next_plan()
    assert s.join_optim(plan) == pytest.approx(clock.now + 0.2)
    clock.advance(0.2)
    assert s.join_optim(plan) is None and plan.optim == [] and s.pipelining_models() == 0
    s.cycle_done(plan, 0.0)
    s.submit(req("a", 3, RequestKind.OPTIM_STEP))
    assert seqs(run(s).optim) == [("a", 3)]


def test_a_model_that_never_pipelined_is_not_waited_for_but_its_arrived_optim_joins(make_sched):
    """join_optim waits only for models seen pipelining; an optim that is already there joins anyway."""
    s = make_sched(gather_window_s=5.0)
    s.open_model("a")
    s.open_model("b")
    s.submit(req("a", 0))
    s.submit(req("b", 0))
    plan, _ = s.next_plan()
    s.submit(req("b", 1, RequestKind.OPTIM_STEP))
    assert s.join_optim(plan) is None
    assert seqs(plan.optim) == [("b", 1)]


def test_only_the_models_next_request_joins_and_only_an_optim_step(make_sched):
    """join_optim never reorders a model: an optim behind a missing seq_id, another compute, or a
    model whose plan already has its optim_step or a tail request, or whose compute is a part with
    more to come, waits for a cycle of its own."""
    s = make_sched(max_tokens_per_cycle=100)
    for m in "abcde":
        s.open_model(m)
    s.submit(req("a", 0))
    s.submit(req("b", 0))
    s.submit(req("c", 0))
    s.submit(req("c", 1, RequestKind.OPTIM_STEP))
    s.submit(req("d", 0))
    s.submit(Request("d-1", RequestKind.SAVE_WEIGHTS, "d", 1))
    s.submit(Request("e-0", RequestKind.FORWARD_BACKWARD, "e", 0, tokens=60, more=[(None, 60)]))
    plan, _ = s.next_plan()
    s.submit(req("a", 2, RequestKind.OPTIM_STEP))  # seq 1 missing
    s.submit(req("b", 1))  # compute: cannot join a pass that ran
    s.submit(req("b", 2, RequestKind.OPTIM_STEP))
    s.submit(req("c", 2, RequestKind.OPTIM_STEP))
    s.submit(req("d", 2, RequestKind.OPTIM_STEP))
    s.submit(req("e", 1, RequestKind.OPTIM_STEP))
    s.join_optim(plan)
    assert seqs(plan.optim) == [("c", 1)]


def test_optim_posted_after_compute_answered_is_not_pipelining(clock, make_sched):
    """compute_done (the worker answered the fb mid-cycle): an optim posted from then on,
    even before the cycle ends, does not make the cycle wait for the model's optims later."""
    s = make_sched(gather_window_s=5.0)
    s.open_model("a")
    s.submit(req("a", 0))
    plan, _ = s.next_plan()
    s.compute_done({"a"})
    s.submit(req("a", 1, RequestKind.OPTIM_STEP))
    s.cycle_done(plan, 0.0)
    run(s)
    s.submit(req("a", 2))
    plan, _ = s.next_plan()
    assert seqs(plan.compute) == [("a", 2)] and s.join_optim(plan) is None


def test_unpipelined_model_does_not_wait(make_sched):
    """A model that never pipelined runs its fb at once even with a long gather window."""
    s = make_sched(gather_window_s=5.0)
    s.open_model("a")
    s.submit(req("a", 0))
    plan, deadline = s.next_plan()
    assert seqs(plan.compute) == [("a", 0)] and deadline is None


def test_cycle_done_keeps_the_cycle_metrics(make_sched):
    """A cycle is counted and cycle_done records the last one's size and duration."""
    s = make_sched()
    s.open_model("a")
    s.submit(req("a", 0))
    s.submit(req("a", 1, RequestKind.OPTIM_STEP))
    plan, _ = s.next_plan()
    s.cycle_done(plan, 0.5)
    assert (s.cycles, s.last_cycle_models, s.last_cycle_requests) == (1, 1, 2)
    assert s.last_cycle_seconds == 0.5 and s.cycle_seconds_total == 0.5


def test_a_cycle_counts_as_its_plan_is_handed_out(make_sched):
    """A cycle counts when it starts, so the count never lags an answer it gave (a client that
    has its result and reads /metrics sees that cycle); an empty plan is no cycle."""
    s = make_sched()
    s.open_model("a")
    assert not s.next_plan()[0] and s.cycles == 0
    s.submit(req("a", 0))
    plan, _ = s.next_plan()
    assert plan and s.cycles == 1  # before cycle_done
    s.cycle_done(plan, 0.1)
    assert s.cycles == 1


def test_pipelining_models_are_counted_until_their_window_passes_unused(clock, make_sched):
    """The /metrics gauge of pipelining clients: a model counts once it pipelined, and stops
    counting when a cycle's wait for its optim_step passes with none."""
    s = make_sched(gather_window_s=0.2)
    s.open_model("b")
    assert s.pipelining_models() == 0
    _pipelined(s)
    assert s.pipelining_models() == 1
    s.submit(req("a", 2))
    plan, _ = s.next_plan()
    clock.advance(0.2)
    s.join_optim(plan)
    assert s.pipelining_models() == 0


def test_a_request_in_parts_runs_one_part_per_cycle_with_other_models_between(make_sched):
    """A compute request larger than a cycle's budget arrives in parts: each cycle runs its next
    part (not final until the last), another model's work runs in the same cycles, and the
    model's later requests (its optim_step) wait for the last part."""
    s = make_sched(max_tokens_per_cycle=100)
    s.open_model("a", 1)
    s.open_model("b", 1)
    big = Request("a-1", RequestKind.FORWARD_BACKWARD, "a", 1, payload="part0", tokens=100,
                  more=[("part1", 100), ("part2", 40)])
    s.submit(big)
    s.submit(req("a", 2, RequestKind.OPTIM_STEP))
    s.submit(Request("b-1", RequestKind.FORWARD_BACKWARD, "b", 1, payload="b0", tokens=10))
    s.submit(Request("b-2", RequestKind.FORWARD_BACKWARD, "b", 2, payload="b1", tokens=10))
    parts = []
    while not parts or not parts[-1][2]:
        plan = run(s)
        mine = [r for r in plan.compute if r.model_id == "a"]
        assert len(mine) <= 1 and sum(r.tokens for r in plan.compute) <= 100
        if mine:
            parts.append((mine[0].payload, mine[0].tokens, mine[0].final))
            # The optim_step rides with the last part (fb + optim in one cycle), never before it.
            finishing = [r.request_id for r in plan.finishing if r.model_id == "a"]
            assert finishing == (["a-1", "a-2"] if mine[0].final else []), plan
    assert parts == [("part0", 100, False), ("part1", 100, False), ("part2", 40, True)]


def test_a_part_fills_the_budget_so_other_models_wait_a_cycle_not_the_whole_request(make_sched):
    s = make_sched(max_tokens_per_cycle=100)
    s.open_model("a", 1)
    s.open_model("b", 1)
    s.submit(Request("a-1", RequestKind.FORWARD_BACKWARD, "a", 1, payload=0, tokens=100,
                     more=[(i, 100) for i in range(1, 10)]))
    s.submit(Request("b-1", RequestKind.FORWARD, "b", 1, tokens=50))
    cycles_until_b = next(i for i in range(10) if any(r.model_id == "b" for r in run(s).compute))
    assert cycles_until_b <= 1


def test_a_part_is_its_models_only_compute_in_its_cycle(make_sched):
    """A model's compute before a request in parts runs a cycle before its first part, and its
    compute after it a cycle after its last part (its optim_step rides with the last part): the
    model's gradients before the first part are then exactly what a failed part puts back."""
    s = make_sched(max_tokens_per_cycle=100)
    s.open_model("a", 1)
    s.submit(Request("a-1", RequestKind.FORWARD_BACKWARD, "a", 1, payload="before", tokens=10))
    s.submit(Request("a-2", RequestKind.FORWARD_BACKWARD, "a", 2, payload="part0", tokens=60, more=[("part1", 60)]))
    s.submit(Request("a-3", RequestKind.FORWARD_BACKWARD, "a", 3, payload="after", tokens=10))
    s.submit(req("a", 4, RequestKind.OPTIM_STEP))
    cycles = [[(r.payload, r.first_part, r.in_parts) for r in plan.compute] + [r.kind for r in plan.optim]
              for plan in iter(lambda: run(s), CyclePlan())]
    assert cycles == [[("before", False, False)], [("part0", True, True)], [("part1", False, True)],
                      [("after", False, False), RequestKind.OPTIM_STEP]]


def test_a_failed_request_in_parts_drops_its_later_parts(make_sched):
    s = make_sched(max_tokens_per_cycle=100)
    s.open_model("a", 1)
    s.submit(Request("a-1", RequestKind.FORWARD_BACKWARD, "a", 1, tokens=90, more=[(i, 90) for i in range(5)]))
    s.submit(Request("a-2", RequestKind.FORWARD, "a", 2, tokens=10))
    first = run(s).compute[0]
    s.drop_rest(first)  # the worker failed it
    assert [r.request_id for r in run(s).compute] == ["a-2"]
    assert s.queue_depth() == 0


# -- images: planned once processed, asked for shortly before (issue 40, item 6) -----------------

def image_fb(model: str, seq: int, tokens: int, asked: list) -> Request:
    """A forward_backward of one datum with an image, its processing recorded in `asked` when asked."""
    pixels = Pixels(images=[], ask_decode=asked.append)
    work = FBWork(model, [DatumWork(np.zeros(tokens, dtype=np.int64), {}, pixels)], "cross_entropy", {}, False)
    return Request(request_id=f"{model}-{seq}", kind=RequestKind.FORWARD_BACKWARD, model_id=model, seq_id=seq,
                   payload=work, tokens=tokens)


def test_a_request_waits_for_its_images_and_no_one_waits_for_it(make_sched):
    """A's first request's images are asked for, with those of its next requests that one cycle's
    budget holds (not those further back); A waits, B's text request runs meanwhile, and the loop is
    not told there is training work while A's images are processed. Once they are, A runs."""
    s = make_sched(max_tokens_per_cycle=100)
    asked: list = []
    for m in ("a", "b"):
        s.open_model(m, 1)
    first, second, third = (image_fb("a", seq, 40, asked) for seq in (1, 2, 3))  # the third is over the budget
    for r in (first, second, third, req("b", 1)):
        s.submit(r)
    assert seqs(run(s).compute) == [("b", 1)]
    assert asked == [first.payload.data[0].pixels, second.payload.data[0].pixels]
    assert not s.has_training_work()
    assert seqs(run(s).compute) == []  # still processing: nothing to plan, nothing asked twice
    assert len(asked) == 2
    for r in (first, second):
        r.payload.data[0].pixels.decoded(torch.zeros(1, 1), torch.ones(1, 3, dtype=torch.long))
    assert s.has_training_work()
    assert seqs(run(s).compute) == [("a", 1), ("a", 2)]
    assert asked[2:] == [third.payload.data[0].pixels]  # next in line now: asked as these run


def test_a_plan_visits_no_idle_training_run(monkeypatch, clock, make_sched):
    """A plan looks only at models that may have work: 1,000 open runs with nothing queued, and 1,000
    whose next seq_id is missing (a client long-polling a request queued behind a gap), add no
    visit to any plan of an active model's cycles (visits counted, not time). A parked run comes
    back when its gap times out, and at once when a request wakes it."""
    visits = []
    ready = run_queues.RunQueue.ready
    monkeypatch.setattr(run_queues.RunQueue, "ready", lambda q: visits.append(q) or ready(q))
    s = make_sched()
    for i in range(2000):
        s.open_model(f"idle-{i}", first_seq=1)
    for i in range(1000):
        s.submit(req(f"idle-{i}", 2))  # seq_id 1 never comes
    run(s)  # parks them
    s.open_model("a")
    visits.clear()
    for seq in range(0, 20, 2):
        s.submit(req("a", seq))
        s.submit(req("a", seq + 1, RequestKind.OPTIM_STEP))
        plan = run(s)
        assert seqs(plan.compute + plan.optim) == [("a", seq), ("a", seq + 1)]
    assert len(visits) == 10  # one visit per plan: the active model's
    s.submit(req("idle-7", 1))  # a request wakes a parked run at once
    assert seqs(run(s).compute) == [("idle-7", 1), ("idle-7", 2)]
    clock.advance(GAP)  # the others' gaps time out: each is visited again, and runs (64 per cycle)
    assert sum(len(run(s).compute) for _ in range(16)) == 999


def test_a_plan_stops_at_a_full_budget_and_every_busy_run_gets_its_turn(monkeypatch, make_sched):
    """1,000 runs with work and room for 64 per cycle: a plan visits about 64 of them, not 1,000, and
    the round robin runs every one within ceil(1000 / 64) cycles (the ones that ran go last)."""
    visits = []
    ready = run_queues.RunQueue.ready
    monkeypatch.setattr(run_queues.RunQueue, "ready", lambda q: visits.append(q) or ready(q))
    s = make_sched(max_models_per_cycle=64)
    for i in range(1000):
        s.open_model(f"m{i}")
        s.submit(req(f"m{i}", 0))
    ran: list[str] = []
    for _ in range(16):
        visits.clear()
        plan = run(s)
        assert len(plan.compute) == (64 if len(ran) < 960 else 40) and len(visits) <= 65
        ran += [r.model_id for r in plan.compute]
    assert sorted(ran) == sorted(f"m{i}" for i in range(1000))
