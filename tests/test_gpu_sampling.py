"""The built-in sampler on a GPU (issue 35): decode steps as CUDA graphs, numbers that keep their meaning.

Run on a CUDA machine with `HOSTED_TINKER_TEST_DEVICE=cuda python -m pytest tests/test_gpu_sampling.py`;
elsewhere every test here skips (tests/test_engine_steps.py runs the same logic on CPU with a
stand-in capture). The model is the 512 x 8 preset in bfloat16, as a GPU serves it, with four
adapters (rank 8, B non-zero) and the base model in every step.
"""

from __future__ import annotations

import os

import numpy as np
import pytest
import torch
from transformers import AutoModelForCausalLM

from hosted_tinker.models.embedded import SPEC_PRESETS, ensure_embedded_model
from hosted_tinker.requests.kinds import DatumWork, FBWork
from hosted_tinker.runtime.adapters import LoRAConfig
from hosted_tinker.runtime.trainer import TrainingRuntime
from hosted_tinker.sampling.engine import SamplingEngine
from hosted_tinker.sampling.jobs import SampleJob
from tiny_model import randomize_b

pytestmark = pytest.mark.skipif(
    os.environ.get("HOSTED_TINKER_TEST_DEVICE") != "cuda" or not torch.cuda.is_available(),
    reason="GPU test: set HOSTED_TINKER_TEST_DEVICE=cuda on a machine with CUDA")

CUDA = torch.device("cuda")
ADAPTERS = ("a0", "a1", "a2", "a3")
BF16 = 1e-3  # the bound for bf16


@pytest.fixture(scope="module")
def model_path(tmp_path_factory):
    return ensure_embedded_model(tmp_path_factory.mktemp("models"), SPEC_PRESETS["medium"])


def make_runtime(path) -> TrainingRuntime:
    model = AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.bfloat16).to(CUDA)
    runtime = TrainingRuntime(model, "medium", device=CUDA)
    for i, name in enumerate((*ADAPTERS, "zero")):
        adapter = runtime.create_adapter(name, LoRAConfig(rank=8, seed=i))
        if name != "zero":  # B = 0: the base model, as the trainer scores it
            randomize_b(adapter, seed=i, std=0.02)
    return runtime


def sample(engine: SamplingEngine, n: int = 20, max_tokens: int = 24) -> list:
    results: list = [None] * n
    errors: list = []
    rng = np.random.default_rng(0)
    jobs = [SampleJob(prompt=rng.integers(0, 1000, int(rng.integers(5, 60))).tolist(), num_samples=1 + i % 2,
                      max_tokens=max_tokens - i % 5, adapter_id=None if i % 5 == 4 else ADAPTERS[i % 4],
                      temperature=1.0, seed=i, on_done=lambda r, i=i: results.__setitem__(i, r),
                      on_error=errors.append) for i in range(n)]
    engine.submit_all(jobs)
    engine.run(should_yield=lambda: False, max_seconds=600.0)
    assert not errors and all(results), errors
    return [(job, r) for job, r in zip(jobs, results)]


def test_captured_decode_steps_sample_as_eager_ones(model_path):
    eager_rt, graphed_rt = make_runtime(model_path), make_runtime(model_path)
    eager = SamplingEngine(eager_rt.model, eager_rt.routing, None, CUDA, cuda_graphs=False)
    graphed = SamplingEngine(graphed_rt.model, graphed_rt.routing, None, CUDA)
    graphs = graphed.decode_step.graphs
    assert graphs is not None
    for (_, want), (_, got) in zip(sample(eager), sample(graphed)):
        for w, g in zip(want.sequences, got.sequences):
            assert g.tokens == w.tokens
            np.testing.assert_allclose(g.logprobs, w.logprobs, atol=BF16, rtol=0)
    assert graphed.decode_step.graphs is graphs and not graphs.refused  # captured, never fell back to eager
    assert graphs.replays > graphs.captures > 0


def test_sampled_logprobs_equal_the_trainers(model_path):
    runtime = make_runtime(model_path)
    engine = SamplingEngine(runtime.model, runtime.routing, None, CUDA)
    worst = 0.0
    for job, result in sample(engine):
        for seq in result.sequences:
            tokens = np.asarray(job.prompt + seq.tokens, dtype=np.int64)
            work = FBWork(job.adapter_id or "zero", [DatumWork(tokens=tokens[:-1], inputs={
                "target_tokens": tokens[1:], "weights": np.ones(len(tokens) - 1, np.float32)})],
                "cross_entropy", {}, forward_only=True)
            trained = runtime.forward_backward([work])[0].outputs[0]["logprobs"][len(job.prompt) - 1:]
            worst = max(worst, float(np.abs(np.asarray(seq.logprobs) - trained).max()))
    print(f"sampler vs trainer logprobs on {torch.cuda.get_device_name()}: max |diff| {worst:.3g}")
    assert worst <= BF16
