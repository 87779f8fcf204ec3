"""The built-in engine's KV-cache budget (sampling/kv_budget.py, engine.py), against the real engine
on the embedded model, in process, driven round by round as the device loop drives it when
training waits (one admission and one decode step per round), so every state between steps
can be looked at: the KV cache the engine really holds never passes the budget, a small job does
not wait behind a large one nor delays it (admission.py), a cancelled job's reservation comes
back, and a job larger than the whole budget is refused, never left waiting.
"""

from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from hosted_tinker.config.settings import DEFAULT_KV_TOKENS
from hosted_tinker.models.embedded import ensure_embedded_model
from hosted_tinker.runtime.trainer import TrainingRuntime
from hosted_tinker.sampling.engine import SamplingEngine
from hosted_tinker.sampling.jobs import SampleJob
from hosted_tinker.sampling.kv_budget import choose_kv_budget, job_kv_tokens, kv_bytes_per_token

PROMPT = [11, 12, 13, 14]
BUDGET = 100


@pytest.fixture(scope="module")
def model_parts(tmp_path_factory):
    path = ensure_embedded_model(tmp_path_factory.mktemp("models"))
    model = AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32)
    tokenizer = AutoTokenizer.from_pretrained(str(path))
    return model, tokenizer, TrainingRuntime(model, "embedded", device=torch.device("cpu"))


@pytest.fixture
def engine(model_parts) -> SamplingEngine:
    model, tokenizer, runtime = model_parts
    return SamplingEngine(model, runtime.routing, tokenizer, torch.device("cpu"), kv_budget_tokens=BUDGET)


class Outcome:
    def __init__(self, num_samples: int, max_tokens: int):
        self.done: list = []
        self.errors: list[str] = []
        # greedy, no stop tokens: every row generates exactly max_tokens
        self.job = SampleJob(prompt=PROMPT, num_samples=num_samples, max_tokens=max_tokens, adapter_id=None,
                             temperature=0.0, on_done=self.done.append, on_error=self.errors.append)

    @property
    def started(self) -> bool:
        return self.job.first_token_at is not None


def held_kv_tokens(engine: SamplingEngine) -> int:
    """The KV cache the engine's rows really hold now: each row's cached positions, its prompt's included."""
    return engine.held_kv_tokens


def step(engine: SamplingEngine) -> None:
    """One round that yields after its first step (one admission, one decode step per group)."""
    engine.run(should_yield=lambda: True, max_seconds=60.0)


def test_many_jobs_all_finish_and_the_cache_never_outgrows_the_budget(engine):
    outcomes = [Outcome(num_samples=2, max_tokens=16) for _ in range(10)]  # 40 KV tokens each, 400 together
    engine.submit_all([o.job for o in outcomes])
    most_held = 0
    while engine.has_work():
        step(engine)
        most_held = max(most_held, held_kv_tokens(engine))
        assert held_kv_tokens(engine) <= engine.reserved_kv_tokens <= BUDGET
    assert all(len(o.done) == 1 and not o.errors for o in outcomes)
    assert all(len(s.tokens) == 16 for o in outcomes for s in o.done[0].sequences)
    # they shared the device (two at a time), within the budget
    assert job_kv_tokens(outcomes[0].job) < engine.peak_reserved_kv_tokens <= BUDGET and most_held > 40
    assert engine.reserved_kv_tokens == 0 and engine.waiting_jobs == 0


def seeded(num_samples: int, max_tokens: int) -> Outcome:
    outcome = Outcome(num_samples, max_tokens)
    outcome.job.temperature, outcome.job.seed = 1.0, 7
    return outcome


def test_a_small_job_does_not_wait_behind_a_large_one_nor_delays_it(engine):
    """Issue 35: a large job that does not fit beside a running one waits; a small one sent after
    it starts at once (FIFO admission made it wait its turn). The large one starts in the step after
    the running one ends, as it did under FIFO: the small one, still running, is paused for it (its
    cache swapped out), and resumes after it with the samples it has when it runs alone."""
    running = Outcome(num_samples=2, max_tokens=16)  # 40
    engine.submit(running.job)
    step(engine)
    large, small = Outcome(num_samples=4, max_tokens=16), seeded(num_samples=1, max_tokens=30)  # 80, then 34
    engine.submit_all([large.job, small.job])
    step(engine)
    assert small.started and not large.started and engine.waiting_jobs == 1
    while not running.done:
        step(engine)
        assert not large.started and engine.reserved_kv_tokens <= BUDGET
    step(engine)
    assert large.started and not small.done and engine.requests_preempted == 1
    assert engine.reserved_kv_tokens == 80 and engine.waiting_jobs == 1  # the small one waits, paused
    while engine.has_work():
        step(engine)
        assert held_kv_tokens(engine) <= engine.reserved_kv_tokens <= BUDGET
    assert all(len(o.done) == 1 for o in (running, large, small))
    alone = seeded(num_samples=1, max_tokens=30)
    engine.submit(alone.job)
    while engine.has_work():
        step(engine)
    assert small.done[0].sequences[0].tokens == alone.done[0].sequences[0].tokens
    assert small.done[0].sequences[0].logprobs == pytest.approx(alone.done[0].sequences[0].logprobs, abs=1e-5)
    assert engine.pool.pages_in_use == 0


def test_a_cancelled_job_gives_its_reservation_back(engine):
    kept, cancelled = Outcome(num_samples=2, max_tokens=16), Outcome(num_samples=2, max_tokens=16)
    engine.submit_all([kept.job, cancelled.job])  # one group, 40 + 40 of 100
    step(engine)
    assert engine.reserved_kv_tokens == 80
    waiting = Outcome(num_samples=2, max_tokens=16)  # 40: waits for room
    engine.submit(waiting.job)
    step(engine)
    assert not waiting.started and engine.waiting_jobs == 1
    cancelled.job.cancelled = True  # its client left (EngineBackend.cancel)
    step(engine)  # its rows leave the batch at the next decode step, their reservation with them
    assert cancelled.errors and cancelled.errors[0].startswith("cancelled")
    assert engine.reserved_kv_tokens == 40
    step(engine)
    assert waiting.started and engine.reserved_kv_tokens == 80 and engine.waiting_jobs == 0
    while engine.has_work():
        step(engine)
    assert len(kept.done) == 1 and len(waiting.done) == 1 and not cancelled.done
    assert engine.reserved_kv_tokens == 0


def test_a_job_larger_than_the_whole_budget_is_refused_not_queued(engine):
    too_big = Outcome(num_samples=8, max_tokens=16)  # 8 x (4 + 16) = 160
    assert engine.refusal(too_big.job) == (
        "a sample job needs up to 160 KV-cache tokens (num_samples 8 x (prompt 4 + max_tokens 16)), more than the "
        "sampler's whole KV-cache budget of 100 tokens (max_sampling_kv_tokens): ask for fewer samples, fewer "
        "max_tokens or a shorter prompt")
    assert engine.refusal(Outcome(num_samples=5, max_tokens=16).job) is None  # exactly the budget fits
    after = Outcome(num_samples=1, max_tokens=2)
    engine.submit_all([too_big.job, after.job])  # reached the engine anyway: it fails, the next one runs
    while engine.has_work():
        step(engine)
    assert too_big.errors == [engine.refusal(too_big.job)] and not too_big.done and len(after.done) == 1


def test_the_budget_setting_and_its_automatic_value(model_parts):
    model = model_parts[0]
    assert kv_bytes_per_token(model) == 2 * 2 * 2 * 16 * 4  # layers x (K, V) x kv heads x head dim x float32
    assert choose_kv_budget(1234, model, torch.device("cpu")).tokens == 1234
    auto = choose_kv_budget(0, model, torch.device("cpu"))
    assert auto.tokens == DEFAULT_KV_TOKENS and "max_sampling_kv_tokens" in auto.how


def test_a_key_over_its_share_waits_without_holding_back_another_key(model_parts):
    """Each key's running jobs hold at most its share of the budget (issue 26, item 5): key a's
    second job waits for a's own rows, and key b's job, which fits, is admitted at once."""
    model, tokenizer, runtime = model_parts
    engine = SamplingEngine(model, runtime.routing, tokenizer, torch.device("cpu"), kv_budget_tokens=BUDGET,
                            kv_share_per_key=0.5)
    a1, a2, b = Outcome(2, 16), Outcome(2, 16), Outcome(2, 16)  # 40 each; a key may hold 50
    a1.job.owner = a2.job.owner = "a"
    b.job.owner = "b"
    engine.submit_all([a1.job, a2.job, b.job])
    step(engine)
    assert a1.started and b.started and not a2.started
    assert engine.reserved_kv_tokens_of("a") == 40 and engine.waiting_jobs == 1
    while not a1.done:
        step(engine)
        assert engine.reserved_kv_tokens_of("a") <= 50
    while engine.has_work():
        step(engine)
    assert all(len(o.done) == 1 for o in (a1, a2, b))
    too_big = Outcome(3, 16)  # 60: fits the budget, not one key's share
    assert "one API key's share of the sampler's KV-cache budget, 50 of 100 tokens" in engine.refusal(too_big.job)
