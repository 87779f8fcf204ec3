"""The built-in engine decodes every model family the server takes, and its samples score as the
trainer scores them (issue 35: numbers keep their meaning), in process on tiny random models.

Per family, three jobs share the engine at once -- two adapters (one with two samples) and the
base model, prompts of three lengths -- and every prompt is prefilled in chunks of 4 tokens, so
each decode step reads the paged KV cache (sampling/kv_cache.py) across page boundaries, rows of
different lengths and adapters sit in one batch, and a sliding-window layer's window (5 here,
Gemma3 and GPT-OSS) is shorter than the rows. Each sampled token's logprob equals the training
forward's of the same sequence to 1e-5 (fp32), and a job's tokens are the ones it samples alone.
The model matrix (test_model_matrix.py) checks the families' prompt logprobs through a server;
this decodes them: Gemma3's sliding layers, GPT-OSS's sinks, DeepSeek-V3's latent (MLA) cache,
Qwen3.5's linear-attention state, GPT-2's learned positions, experts of the MoE families.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
import transformers as T

from family_models import SMALL, configs, family_model
from hosted_tinker.requests.kinds import DatumWork, FBWork
from hosted_tinker.runtime.adapters import LoRAConfig
from hosted_tinker.runtime.trainer import TrainingRuntime
from hosted_tinker.sampling.engine import SamplingEngine
from hosted_tinker.sampling.jobs import SampleJob
from tiny_model import randomize_b

VOCAB = 200
PROMPTS = [[5, 17, 130, 41, 99, 8, 77, 30, 12], [3, 14, 15, 92, 65], [27, 18, 28, 18, 28, 45, 90, 45, 23, 53, 60]]
NEW_TOKENS = 8
PARITY = 1e-5


def family_configs() -> dict[str, T.PretrainedConfig]:
    found = configs(VOCAB)
    found["gemma3"].sliding_window = found["gpt_oss"].sliding_window = 5  # shorter than the rows
    # Qwen3.5's text model: a linear-attention (Gated DeltaNet) layer, then a full-attention one
    found["qwen3_5"] = T.Qwen3_5TextConfig(
        vocab_size=VOCAB, layer_types=["linear_attention", "full_attention"], num_key_value_heads=2, head_dim=16,
        linear_key_head_dim=8, linear_value_head_dim=8, linear_num_key_heads=2, linear_num_value_heads=4, **SMALL)
    return found


FAMILIES = family_configs()


def build(name: str) -> torch.nn.Module:
    return family_model(name, FAMILIES[name]).eval()


def trainer_logprobs(runtime: TrainingRuntime, model_id: str, tokens: list[int]) -> np.ndarray:
    t = np.asarray(tokens, dtype=np.int64)
    work = FBWork(model_id, [DatumWork(tokens=t[:-1], inputs={"target_tokens": t[1:],
                                                              "weights": np.ones(len(t) - 1, np.float32)})],
                  "cross_entropy", {}, forward_only=True)
    return runtime.forward_backward([work])[0].outputs[0]["logprobs"]


def sample(engine: SamplingEngine, jobs: list[tuple[list[int], str | None, int]]) -> list:
    """Each (prompt, adapter, num_samples) as a job seeded by its prompt, all submitted at once; their
    sequences."""
    done: list = [None] * len(jobs)
    errors: list = []
    engine.submit_all([SampleJob(prompt=p, num_samples=n, max_tokens=NEW_TOKENS, adapter_id=a, temperature=1.0,
                                 seed=p[0], on_done=lambda r, i=i: done.__setitem__(i, r), on_error=errors.append)
                       for i, (p, a, n) in enumerate(jobs)])
    engine.run(should_yield=lambda: False, max_seconds=600.0)
    assert not errors and all(done), errors
    return [r.sequences for r in done]


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_every_family_decodes_and_its_samples_score_as_the_trainer_scores_them(family):
    runtime = TrainingRuntime(build(family), family, device=torch.device("cpu"))
    for i, name in enumerate(("a", "b", "zero")):
        adapter = runtime.create_adapter(name, LoRAConfig(rank=4, seed=i))
        if name != "zero":  # "zero" keeps B = 0: the base model, as the trainer scores it
            randomize_b(adapter, seed=i, std=0.05)
    engine = SamplingEngine(runtime.model, runtime.routing, None, torch.device("cpu"), prefill_chunk_tokens=4,
                            max_prefill_tokens=4)
    jobs = [(PROMPTS[0], "a", 2), (PROMPTS[1], "b", 1), (PROMPTS[2], None, 1)]
    together = sample(engine, jobs)
    for (prompt, adapter, _), sequences in zip(jobs, together):
        for seq in sequences:
            assert len(seq.tokens) == NEW_TOKENS
            want = trainer_logprobs(runtime, adapter or "zero", prompt + seq.tokens)[len(prompt) - 1:]
            np.testing.assert_allclose(seq.logprobs, want, atol=PARITY, rtol=0)
    (alone,) = sample(engine, jobs[:1])  # alone: the same samples
    assert [s.tokens for s in alone] == [s.tokens for s in together[0]]
    assert not engine.has_work() and engine.pool.pages_in_use == 0


@pytest.mark.parametrize("family", ["qwen3_5", "deepseek_v3", "gemma3"])
def test_a_paused_job_resumes_with_its_cache_as_it_was(family):
    """A job paused for an older one (admission.py) has its cache swapped out of the pool and back
    (kv_cache.py): its keys and values, Qwen3.5's linear-attention states, DeepSeek-V3's latents,
    the pages its samples share. It then samples what it samples alone."""
    runtime = TrainingRuntime(build(family), family, device=torch.device("cpu"))
    engine = SamplingEngine(runtime.model, runtime.routing, None, torch.device("cpu"), kv_budget_tokens=120)
    results: dict[str, list] = {}

    def submit(name: str, prompt: list[int], n: int, max_tokens: int) -> None:
        engine.submit(SampleJob(prompt=prompt, num_samples=n, max_tokens=max_tokens, adapter_id=None,
                                temperature=1.0, seed=3, on_done=lambda r: results.setdefault(name, r.sequences)))

    def tick() -> None:
        engine.run(should_yield=lambda: True, max_seconds=60.0)

    long_prompt = PROMPTS[0] + PROMPTS[2]  # 20 tokens: its samples share a full page
    submit("running", PROMPTS[1], 2, 15)  # 2 x (5 + 15) = 40 of 120
    tick()
    submit("large", PROMPTS[1], 4, 20)  # 100: waits for the running one
    submit("small", long_prompt, 2, 20)  # 2 x (20 + 20) = 80: starts at once, outlasts the running one
    while "running" not in results:
        tick()
    tick()
    assert engine.requests_preempted == 1 and "small" not in results  # paused for the large one
    engine.run(should_yield=lambda: False, max_seconds=600.0)
    paused = results.pop("small")
    submit("small", long_prompt, 2, 20)
    engine.run(should_yield=lambda: False, max_seconds=600.0)
    for got, want in zip(paused, results["small"]):
        assert got.tokens == want.tokens
        np.testing.assert_allclose(got.logprobs, want.logprobs, atol=PARITY, rtol=0)
    assert engine.pool.pages_in_use == 0
