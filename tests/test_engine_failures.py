"""The built-in engine confines a failure to the requests it hits, and answers each of them once.

Against the real engine on the embedded model, in process. A job asking for more top-k logprobs
than the vocabulary has fails in `torch.topk` while the first tokens of a freshly prefilled group
are chosen: the group is already running by then, and it once kept decoding, so requests that had
been failed were answered a second time, and their rows held KV cache to the end.
"""

from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from hosted_tinker.embedded_model import ensure_embedded_model
from hosted_tinker.runtime.trainer import TrainingRuntime
from hosted_tinker.sampling.engine import SampleJob, SamplingEngine


@pytest.fixture(scope="module")
def engine(tmp_path_factory) -> SamplingEngine:
    path = ensure_embedded_model(tmp_path_factory.mktemp("models"))
    model = AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32)
    tokenizer = AutoTokenizer.from_pretrained(str(path))
    runtime = TrainingRuntime(model, "embedded", device=torch.device("cpu"))
    return SamplingEngine(model, runtime.routing, tokenizer, torch.device("cpu"))


class Answers:
    def __init__(self, **fields):
        self.done: list = []
        self.errors: list[str] = []
        self.job = SampleJob(prompt=[11, 12, 13], num_samples=2, max_tokens=8, adapter_id=None, temperature=0.0,
                             on_done=self.done.append, on_error=self.errors.append, **fields)

    @property
    def count(self) -> int:
        return len(self.done) + len(self.errors)


def test_a_failure_choosing_first_tokens_fails_its_group_once_and_the_engine_goes_on(engine):
    vocab = engine.model.get_output_embeddings().out_features
    fine, broken = Answers(), Answers(topk_sample_logprobs=vocab + 1)
    engine.submit_all([fine.job, broken.job])  # one admission: one group
    engine.run(should_yield=lambda: False, max_seconds=60.0)
    assert fine.count == 1 and broken.count == 1, (fine.done, fine.errors, broken.done, broken.errors)
    assert broken.errors and "sampling failed on the server" in broken.errors[0]
    assert not engine.has_work() and engine.reserved_kv_tokens == 0

    after = Answers()  # the engine serves the next request as usual
    engine.submit(after.job)
    engine.run(should_yield=lambda: False, max_seconds=60.0)
    assert len(after.done) == 1 and [len(s.tokens) for s in after.done[0].sequences] == [8, 8]
