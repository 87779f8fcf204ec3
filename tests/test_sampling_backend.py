"""`EngineBackend`, the built-in sampling backend, against the real engine on the embedded model
(in process): the backend contract that every submitted job gets exactly one of on_done /
on_error, through cancellation, shutdown and a failing round; and a request for a training
model's current weights keeps the version it started with across an optimizer step (driven
here round by round, the order the device loop runs them in, which a server test cannot pin).
"""

from __future__ import annotations

import threading

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from hosted_tinker.models.embedded import ensure_embedded_model
from hosted_tinker.runtime.adapters import AdamParams, LoRAConfig
from hosted_tinker.runtime.trainer import TrainingRuntime
from hosted_tinker.sampling.backend import EngineBackend
from hosted_tinker.sampling.engine import SamplingEngine
from hosted_tinker.sampling.jobs import SampleJob
from hosted_tinker.sampling.snapshots import SnapshotCache
from tiny_model import ce_work, random_seqs

CANCELLED = "cancelled: nobody is waiting for this request any more"


@pytest.fixture(scope="module")
def model_parts(tmp_path_factory):
    path = ensure_embedded_model(tmp_path_factory.mktemp("models"))
    model = AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32)
    tokenizer = AutoTokenizer.from_pretrained(str(path))
    runtime = TrainingRuntime(model, "embedded", device=torch.device("cpu"))
    return model, tokenizer, runtime


@pytest.fixture
def backend(model_parts):
    model, tokenizer, runtime = model_parts
    cpu = torch.device("cpu")
    wake = threading.Event()
    b = EngineBackend(SamplingEngine(model, runtime.routing, tokenizer, cpu), SnapshotCache(runtime.layers, cpu),
                      wake.set, runtime)
    b.rung = wake
    return b


class Outcome:
    """A job's terminal callbacks, counted."""

    def __init__(self, prompt: list[int], max_tokens: int = 12, adapter_id: str | None = None):
        self.done: list = []
        self.errors: list[str] = []
        self.job = SampleJob(prompt=prompt, num_samples=1, max_tokens=max_tokens, adapter_id=adapter_id,
                             temperature=0.0, on_done=self.done.append, on_error=self.errors.append)

    @property
    def answers(self) -> int:
        return len(self.done) + len(self.errors)

    def tokens(self) -> list[int]:
        return self.done[0].sequences[0].tokens


def one_step(backend: EngineBackend) -> None:
    """One round that yields after its first step, as when training is waiting."""
    backend.run_round(should_yield=lambda: True, min_seconds=0.0, max_seconds=60.0)


def drain(backend: EngineBackend) -> None:
    while backend.wants_round():
        backend.run_round(should_yield=lambda: False, min_seconds=0.0, max_seconds=60.0)


def test_submit_and_cancel_ring_the_device_loop(backend):
    a = Outcome([11, 12, 13])
    backend.submit(a.job)
    assert backend.rung.is_set()
    backend.rung.clear()
    backend.cancel(a.job)
    assert backend.rung.is_set() and backend.wants_round()


def test_cancelling_a_queued_job_answers_it_once(backend):
    a = Outcome([11, 12, 13])
    backend.submit(a.job)
    backend.cancel(a.job)
    drain(backend)
    assert a.errors == [CANCELLED] and a.done == []
    assert not backend.engine.has_work()


def test_cancelling_a_decoding_job_leaves_its_groupmate_decoding(backend):
    """A job cancelled mid-decode leaves its group at the next round and is answered once; the
    job decoding next to it goes on to its full answer."""
    a, b = Outcome([11, 12, 13]), Outcome([21, 22, 23, 24])
    backend.submit(a.job)
    backend.submit(b.job)
    one_step(backend)  # both admitted into one group, a token each
    assert backend.engine.active_rows == 2
    backend.cancel(a.job)
    one_step(backend)
    assert backend.engine.active_rows == 1
    assert a.errors == [CANCELLED] and a.done == []
    drain(backend)
    assert a.answers == 1 and b.errors == []
    assert len(b.tokens()) == 12 and b.done[0].sequences[0].stop_reason == "length"
    backend.cancel(b.job)  # already finished: nothing more is said
    drain(backend)
    assert b.answers == 1


def test_shutdown_answers_every_job_queued_or_decoding(backend):
    a, b = Outcome([11, 12, 13]), Outcome([14, 15])
    backend.submit(a.job)
    one_step(backend)
    backend.submit(b.job)  # queued behind a's group, not admitted yet
    backend.shutdown()
    for o in (a, b):
        assert o.done == [] and len(o.errors) == 1 and "shutting down" in o.errors[0]
    assert not backend.engine.has_work()


def test_a_round_that_raises_answers_every_job_in_flight(backend, monkeypatch):
    """An unexpected exception out of the engine (a bug: patched in here) fails the round's jobs
    with category-server text instead of leaving them waiting forever."""
    a = Outcome([11, 12, 13])
    backend.submit(a.job)
    one_step(backend)
    b = Outcome([14, 15])
    backend.submit(b.job)

    def broken_admit(resolve):
        raise RuntimeError("engine bug")

    monkeypatch.setattr(backend.engine, "_admit", broken_admit)
    one_step(backend)
    for o in (a, b):
        assert o.done == [] and o.errors == ["sampling failed on the server: RuntimeError: engine bug"]
    assert not backend.engine.has_work()


@pytest.fixture
def run(model_parts, backend):
    """A training model on the backend's runtime, announced as the worker does after create_model."""
    runtime = model_parts[2]
    runtime.create_adapter("run", LoRAConfig(rank=4, seed=3))
    backend.adapter_updated("run")
    yield "run"
    runtime.remove_adapter("run")
    backend.adapter_removed("run")


def train_step(runtime: TrainingRuntime, backend: EngineBackend, model_id: str, seed: int) -> None:
    """One forward_backward + optim_step, announced as the worker does after the step."""
    runtime.forward_backward([ce_work(model_id, random_seqs(2, seed))])
    runtime.optim_step(model_id, AdamParams(learning_rate=0.05))
    backend.adapter_updated(model_id)


def current(backend: EngineBackend, model_id: str, max_tokens: int = 12) -> Outcome:
    """A request (as /v1 plans one naming a training run) for the model's current weights, submitted."""
    o = Outcome([11, 12, 13, 14], max_tokens, adapter_id=backend.current_weights_ref(model_id))
    backend.submit(o.job)
    return o


def lps(o: Outcome) -> list[float]:
    return o.done[0].sequences[0].logprobs


def test_a_request_keeps_the_weights_it_started_with_across_an_optim_step(model_parts, backend, run):
    runtime = model_parts[2]
    train_step(runtime, backend, run, seed=1)
    before = current(backend, run)
    drain(backend)  # the whole answer before the next step: the reference

    mid = current(backend, run)
    one_step(backend)  # admitted on the same version, its first token chosen
    assert mid.answers == 0 and backend.engine.active_rows == 1
    train_step(runtime, backend, run, seed=2)  # lands while it decodes
    drain(backend)
    assert mid.tokens() == before.tokens()
    assert lps(mid) == pytest.approx(lps(before), abs=1e-6)

    after = current(backend, run)
    drain(backend)
    assert max(abs(x - y) for x, y in zip(lps(after), lps(before))) > 1e-3  # the step did change the answers
    # The version the finished request held is gone; only the one just sampled stays attached.
    assert len(backend.snapshots) == 1


def test_a_model_that_never_stepped_samples_its_initial_weights(backend, run):
    """A fresh LoRA (B = 0) leaves the model unchanged: its answers are the base model's."""
    fresh, base = current(backend, run), Outcome([11, 12, 13, 14])
    backend.submit(base.job)
    drain(backend)
    assert fresh.tokens() == base.tokens() and lps(fresh) == pytest.approx(lps(base), abs=1e-6)


def test_a_request_s_jobs_share_one_version(model_parts, backend, run):
    runtime = model_parts[2]
    ref = backend.current_weights_ref(run)
    first, second = (Outcome([11, 12, 13, 14], adapter_id=ref) for _ in range(2))
    backend.submit(first.job)
    one_step(backend)  # the first job binds the request to the current version
    train_step(runtime, backend, run, seed=3)
    backend.submit(second.job)  # admitted after the step, on the request's version
    drain(backend)
    assert second.tokens() == first.tokens() and lps(second) == pytest.approx(lps(first), abs=1e-6)
    assert backend.current_weights_ref("nobody") is None  # not loaded here: /v1 samples its latest sampler save
