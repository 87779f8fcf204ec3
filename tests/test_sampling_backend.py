"""`EngineBackend`, the built-in sampling backend, against the real engine on the embedded model
(in process): the backend contract that every submitted job gets exactly one of on_done /
on_error, through cancellation, shutdown and a failing round.
"""

from __future__ import annotations

import threading

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from hosted_tinker.embedded_model import ensure_embedded_model
from hosted_tinker.runtime.trainer import TrainingRuntime
from hosted_tinker.sampling.backend import EngineBackend
from hosted_tinker.sampling.engine import SampleJob, SamplingEngine
from hosted_tinker.sampling.snapshots import SnapshotCache

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
                      wake.set)
    b.rung = wake
    return b


class Outcome:
    """A job's terminal callbacks, counted."""

    def __init__(self, prompt: list[int], max_tokens: int = 12):
        self.done: list = []
        self.errors: list[str] = []
        self.job = SampleJob(prompt=prompt, num_samples=1, max_tokens=max_tokens, adapter_id=None, temperature=0.0,
                             on_done=self.done.append, on_error=self.errors.append)

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
