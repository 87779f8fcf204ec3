"""The built-in engine confines a failure to the request it hits, and answers each request once.

Against the real engine on the embedded model, in process (one admission puts jobs in one group
deterministically, which a server's timing cannot). A job asking for more top-k logprobs than the
vocabulary has fails in `torch.topk` while the first tokens of a freshly prefilled group are
chosen: the group is already running by then, and it once kept decoding, so requests that had
been failed were answered a second time, and their rows held KV cache to the end. Such a failure,
or an adapter whose outputs are not finite (`torch.multinomial` raised on them), once failed every
job of its group: now only its own.
"""

from __future__ import annotations

import math

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from hosted_tinker.models.embedded import ensure_embedded_model
from hosted_tinker.runtime.adapters import LoRAConfig
from hosted_tinker.runtime.trainer import TrainingRuntime
from hosted_tinker.sampling.engine import SamplingEngine
from hosted_tinker.sampling.jobs import SampleJob


@pytest.fixture(scope="module")
def runtime(tmp_path_factory) -> TrainingRuntime:
    path = ensure_embedded_model(tmp_path_factory.mktemp("models"))
    model = AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32)
    return TrainingRuntime(model, "embedded", device=torch.device("cpu"))


@pytest.fixture(scope="module")
def engine(runtime) -> SamplingEngine:
    tokenizer = AutoTokenizer.from_pretrained(str(runtime.model.name_or_path))
    return SamplingEngine(runtime.model, runtime.routing, tokenizer, torch.device("cpu"))


class Answers:
    def __init__(self, **fields):
        self.done: list = []
        self.errors: list[str] = []
        fields = {"adapter_id": None, "temperature": 0.0, **fields}
        self.job = SampleJob(prompt=[11, 12, 13], num_samples=2, max_tokens=8, on_done=self.done.append,
                             on_error=self.errors.append, **fields)

    @property
    def count(self) -> int:
        return len(self.done) + len(self.errors)


def test_a_failure_choosing_first_tokens_fails_its_job_once_and_the_engine_goes_on(engine):
    vocab = engine.model.get_output_embeddings().out_features
    fine, broken = Answers(), Answers(topk_sample_logprobs=vocab + 1)
    engine.submit_all([fine.job, broken.job])  # one admission: one group
    engine.run(should_yield=lambda: False, max_seconds=60.0)
    assert fine.count == 1 and broken.count == 1, (fine.done, fine.errors, broken.done, broken.errors)
    assert broken.errors and "sampling failed on the server" in broken.errors[0]
    assert len(fine.done) == 1 and [len(s.tokens) for s in fine.done[0].sequences] == [8, 8]
    assert not engine.has_work() and engine.reserved_kv_tokens == 0

    after = Answers()  # the engine serves the next request as usual
    engine.submit(after.job)
    engine.run(should_yield=lambda: False, max_seconds=60.0)
    assert len(after.done) == 1 and [len(s.tokens) for s in after.done[0].sequences] == [8, 8]


def test_an_adapter_with_non_finite_outputs_fails_only_its_own_job(runtime, engine):
    """A NaN adapter (import and steps refuse them; this one is made in place) samples NaN logits:
    its job fails with a clear error; a base-model job and another tenant's job of the same group,
    sampled at temperature 1 (`torch.multinomial`, which raises on NaN), are answered."""
    poisoned = runtime.create_adapter("poisoned", LoRAConfig(rank=4))
    runtime.create_adapter("healthy", LoRAConfig(rank=4))
    with torch.no_grad():
        for w in poisoned.weights.values():
            w.B.fill_(math.nan)
    base, healthy, bad = (Answers(adapter_id=a, temperature=1.0, seed=1) for a in (None, "healthy", "poisoned"))
    engine.submit_all([base.job, bad.job, healthy.job])  # one admission: one group
    engine.run(should_yield=lambda: False, max_seconds=60.0)
    assert bad.count == 1 and bad.errors and "logits are not finite" in bad.errors[0], (bad.done, bad.errors)
    for fine in (base, healthy):
        assert not fine.errors and [len(s.tokens) for s in fine.done[0].sequences] == [8, 8]
    assert not engine.has_work() and engine.reserved_kv_tokens == 0


def test_a_decode_step_that_fails_part_way_leaves_no_trace_in_the_cache(engine):
    """A decode step that raises after its first layer has cached the new keys (here: the second
    layer refuses a batch of more than 2 rows) is put back as it was; each job then steps on alone
    and both get the samples they get alone, as if the step had never been tried."""
    def alone() -> list[list[int]]:
        a = Answers(temperature=1.0, seed=5)
        engine.submit(a.job)
        engine.run(should_yield=lambda: False, max_seconds=60.0)
        return [s.tokens for s in a.done[0].sequences]

    want = alone()
    layers = engine.model.model.layers

    def refuse_wide_batches(module, args):
        if args[0].shape[0] > 2 and args[0].shape[1] == 1:  # a decode step of both jobs
            raise RuntimeError("this layer refuses batches of more than 2 rows")

    first, second = Answers(temperature=1.0, seed=5), Answers(temperature=1.0, seed=5)
    hook = layers[1].register_forward_pre_hook(refuse_wide_batches)
    try:
        engine.submit_all([first.job, second.job])  # one admission: one group of 4 rows
        engine.run(should_yield=lambda: False, max_seconds=60.0)
    finally:
        hook.remove()
    assert not first.errors and not second.errors
    assert [s.tokens for s in first.done[0].sequences] == want == [s.tokens for s in second.done[0].sequences]
    assert not engine.has_work() and engine.reserved_kv_tokens == 0
