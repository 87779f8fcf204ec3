"""What one tick of the built-in engine does (issue 35), against the real engine on the embedded
model, in process, tick by tick as the device loop drives it when training waits:

- a decode step dispatches the same aten ops for 64 rows over 4 adapters as for 1 row: its rows
  are laid out in blocks per adapter and every adapter's LoRA delta is one grouped call per
  projection (sampling/step.py). Counted with a `TorchDispatchMode` at a layout's second step
  (its first makes the LoRA plans and views it keeps): every aten op the step dispatches, views
  and in-place ops included -- what a GPU launches, or a CUDA graph records;
- a long prompt is prefilled in chunks of at most `prefill_chunk_tokens` between decode steps, so
  a running row gets its token at every tick; its samples and prompt logprobs are those of an
  unchunked prefill;
- decode steps run through `StepGraphs`, as on CUDA (static input buffers, layouts rounded up to
  buckets, padding rows), give the eager engine's samples. CUDA graphs need CUDA, which this
  machine has not: the capture is tests/helpers.py's `RerunCapture` stand-in (a mock of
  torch.cuda.CUDAGraph alone), which re-runs the recorded step on its static buffers.
"""

from __future__ import annotations

import collections

import numpy as np
import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode
from transformers import AutoModelForCausalLM

from helpers import RerunCapture
from hosted_tinker.models.embedded import ensure_embedded_model
from hosted_tinker.runtime.adapters import LoRAConfig
from hosted_tinker.runtime.graphs import StepGraphs
from hosted_tinker.runtime.trainer import TrainingRuntime
from hosted_tinker.sampling.engine import SamplingEngine
from hosted_tinker.sampling.jobs import SampleJob
from tiny_model import randomize_b

CPU = torch.device("cpu")
ADAPTERS = ("a0", "a1", "a2", "a3")


def make_runtime(path) -> TrainingRuntime:
    runtime = TrainingRuntime(AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32), "embedded",
                              device=CPU)
    for i, name in enumerate(ADAPTERS):
        randomize_b(runtime.create_adapter(name, LoRAConfig(rank=4, seed=i)), seed=i, std=0.05)
    return runtime


@pytest.fixture(scope="module")
def model_path(tmp_path_factory):
    return ensure_embedded_model(tmp_path_factory.mktemp("models"))


@pytest.fixture(scope="module")
def runtime(model_path) -> TrainingRuntime:
    return make_runtime(model_path)


def job(i: int, done: list, *, prompt_len: int = 6, max_tokens: int = 8, adapter: str | None = None) -> SampleJob:
    return SampleJob(prompt=[11 + (i + k) % 90 for k in range(prompt_len)], num_samples=1, max_tokens=max_tokens,
                     adapter_id=adapter if adapter is not None else ADAPTERS[i % len(ADAPTERS)], temperature=1.0,
                     seed=i, on_done=done.append, on_error=done.append)


def tick(engine: SamplingEngine) -> None:
    engine.run(should_yield=lambda: True, max_seconds=60.0)


class AtenOps(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.count = collections.Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.count[str(func.overloadpacket)] += 1
        return func(*args, **(kwargs or {}))


def decode_step_ops(runtime: TrainingRuntime, rows: int) -> collections.Counter:
    engine = SamplingEngine(runtime.model, runtime.routing, None, CPU)
    done: list = []
    engine.submit_all([job(i, done) for i in range(rows)])
    with torch.no_grad():
        engine._receive()
        engine._admit(lambda j: j.adapter_id)
        engine._prefill_chunk()  # every row has its first token
        running = [row for j in engine.admission.running for row in j.rows]
        assert len(running) == rows
        engine._decode(running)  # the first step of a layout makes its plans and views, kept for the next
        with AtenOps() as ops:
            engine._decode(running)
    engine.run(should_yield=lambda: False, max_seconds=60.0)
    assert len(done) == rows and all(len(r.sequences[0].tokens) == 8 for r in done)
    return ops.count


def test_a_decode_step_of_64_rows_over_4_adapters_dispatches_the_ops_of_one_row(runtime):
    one, many = decode_step_ops(runtime, 1), decode_step_ops(runtime, 64)
    assert sum(one.values()) == sum(many.values()), (one - many, many - one)
    assert one["aten.bmm"] == many["aten.bmm"] > 0  # the LoRA: the same grouped calls


def test_a_long_prompt_is_prefilled_in_chunks_while_running_rows_decode(runtime):
    engine = SamplingEngine(runtime.model, runtime.routing, None, CPU, prefill_chunk_tokens=16)
    done: list = []
    running = job(0, done, max_tokens=40)
    engine.submit(running)
    tick(engine)
    long = job(1, done, prompt_len=200, max_tokens=4)
    long.prompt_logprobs = True  # its prompt's logits come from 13 forwards
    engine.submit(long)
    widths: list[int] = []
    hook = engine.model.register_forward_pre_hook(
        lambda module, args, kwargs: widths.append(kwargs["input_ids"].numel()), with_kwargs=True)
    try:
        ticks = 0
        while long.first_token_at is None:
            tokens = engine.recorder.tokens_generated
            tick(engine)
            ticks += 1
            assert engine.recorder.tokens_generated - tokens >= 1  # the running row got its token
    finally:
        hook.remove()
    assert ticks == 200 // 16 + 1 and max(widths) <= 16  # 13 chunks; no forward wider than one
    engine.run(should_yield=lambda: False, max_seconds=60.0)
    unchunked = SamplingEngine(runtime.model, runtime.routing, None, CPU)
    again: list = []
    whole = job(1, again, prompt_len=200, max_tokens=4)
    whole.prompt_logprobs = True
    unchunked.submit(whole)
    unchunked.run(should_yield=lambda: False, max_seconds=60.0)
    (chunked,) = [r for r in done if len(r.sequences[0].tokens) == 4]
    assert chunked.sequences[0].tokens == again[0].sequences[0].tokens
    assert chunked.sequences[0].logprobs == pytest.approx(again[0].sequences[0].logprobs, abs=1e-5)
    np.testing.assert_allclose(chunked.prompt_logprobs, again[0].prompt_logprobs, atol=1e-5)


def sampled(engine: SamplingEngine, jobs: list[SampleJob]) -> list[tuple[list[int], list[float]]]:
    engine.submit_all(jobs)
    engine.run(should_yield=lambda: False, max_seconds=120.0)
    return [(s.tokens, s.logprobs) for j in jobs for s in j.result.sequences]


def recorded(i: int, **fields) -> SampleJob:
    j = job(i, [], **fields)
    j.on_done = lambda result, j=j: setattr(j, "result", result)
    return j


def test_decode_steps_as_captured_graphs_sample_as_eager_steps(model_path):
    eager_rt, graphed_rt = make_runtime(model_path), make_runtime(model_path)
    eager = SamplingEngine(eager_rt.model, eager_rt.routing, None, CPU)
    graphs = StepGraphs(RerunCapture())
    graphed = SamplingEngine(graphed_rt.model, graphed_rt.routing, None, CPU, graphs=graphs)
    # 7 rows of 3 adapters and the base model, ending at different steps: blocks padded to buckets
    specs = [dict(adapter=ADAPTERS[i % 3] if i % 4 else "", max_tokens=3 + i, prompt_len=3 + i) for i in range(7)]
    for spec in specs:
        spec["adapter"] = spec["adapter"] or None
    want = sampled(eager, [recorded(i, **spec) for i, spec in enumerate(specs)])
    got = sampled(graphed, [recorded(i, **spec) for i, spec in enumerate(specs)])
    for (wt, wl), (gt, gl) in zip(want, got):
        assert gt == wt and gl == pytest.approx(wl, abs=1e-5)
    assert graphs.replays > graphs.captures > 0 and not graphs.refused
