"""gspo and stable_reinforce tenants co-batch bit-exactly (runtime in process).

gspo's ratio is a per-datum reduction and stable_reinforce reports means and a max: each must
depend only on its own datum's row. A tenant's outputs, every metric and its update are the same
whether its requests run alone or fused with others, across micro-batches and padding buckets.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from transformers import AutoModelForCausalLM

from hosted_tinker.models.embedded import ensure_embedded_model
from hosted_tinker.requests.kinds import DatumWork, FBWork
from hosted_tinker.runtime.adapters import AdamParams, LoRAConfig
from hosted_tinker.runtime.losses import prepare_inputs, resolve_loss_config
from hosted_tinker.runtime.trainer import TrainingRuntime

# Distinct ranks: tenants of one LoRA shape share a batched matmul, whose exactness is
# test_multi_tenant_runtime's subject; here each tenant's loss is.
TENANTS = [  # (loss, config, rank)
    ("gspo", {}, 8),
    ("stable_reinforce", {"kl_coeff": 0.2}, 4),
    ("gspo", {"clip_low_threshold": 0.9, "clip_high_threshold": 1.05}, 16),
    ("ppo", {}, 2),
    ("cross_entropy", {}, 32),
    ("stable_reinforce", {}, 1),
]


@pytest.fixture(scope="module")
def runtime(tmp_path_factory):
    path = ensure_embedded_model(tmp_path_factory.mktemp("models"))
    model = AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32)
    # a small budget: several micro-batches per pass, so metrics merge across them
    return TrainingRuntime(model, "embedded", device=torch.device("cpu"), max_tokens_per_micro_batch=512)


def _work(seed: int, model_id: str, loss_fn: str, cfg: dict) -> FBWork:
    """Datums shaped like the cookbook's: a prompt part (A = 0) then a sampled part."""
    rng = np.random.default_rng(seed)
    config = resolve_loss_config(loss_fn, cfg)
    lengths = [int(rng.integers(6, 70)) for _ in range(int(rng.integers(3, 7)))]
    data = []
    for n in lengths:
        prompt = int(rng.integers(1, n - 1))
        sampled = np.arange(n) >= prompt
        raw = {"target_tokens": rng.integers(0, 1000, n),
               "weights": rng.normal(0, 1, n).astype(np.float32),
               "logprobs": np.where(sampled, rng.normal(-7, 0.3, n), 0).astype(np.float32),
               "advantages": np.where(sampled, rng.normal(0, 1, n), 0).astype(np.float32)}
        if loss_fn == "ppo":
            raw["clip_high_threshold"] = rng.uniform(1.0, 1.5, n).astype(np.float32)
        if loss_fn == "gspo" and rng.random() < 0.5:
            raw["sequence_ratio_mask"] = sampled.astype(np.float32)
        recorded = np.where(sampled, rng.normal(-7, 0.3, n), 0).astype(np.float32)
        inputs = prepare_inputs(0, loss_fn, config, raw, len(lengths), sampled_rows=sampled,
                                recorded_logprobs=recorded)
        data.append(DatumWork(tokens=rng.integers(0, 1000, n), inputs=inputs))
    return FBWork(model_id, data, loss_fn, config, forward_only=False)


def _run(runtime: TrainingRuntime, tenants: list[int], fused: bool):
    for mid in list(runtime.adapters):
        runtime.remove_adapter(mid)
    for i in tenants:
        runtime.create_adapter(f"t{i}", LoRAConfig(rank=TENANTS[i][2], seed=i))
    history = {i: [] for i in tenants}
    for step in range(2):
        works = [_work(100 * i + step, f"t{i}", *TENANTS[i][:2]) for i in tenants]
        outs = runtime.forward_backward(works) if fused else [runtime.forward_backward([w])[0] for w in works]
        for i, out in zip(tenants, outs):
            history[i].append(out)
        for i in tenants:
            runtime.optim_step(f"t{i}", AdamParams(learning_rate=1e-2))
    state = {i: {k: v.detach().clone() for k, v in runtime.adapter(f"t{i}").named_tensors().items()}
             for i in tenants}
    return history, state


def test_rl_tenants_cobatched_equal_solo(runtime):
    everyone = list(range(len(TENANTS)))
    fused_hist, fused_state = _run(runtime, everyone, fused=True)
    assert runtime.last_pass.models == len(TENANTS) and runtime.last_pass.micro_batches > 1
    for i in everyone:
        solo_hist, solo_state = _run(runtime, [i], fused=False)
        for f, s in zip(fused_hist[i], solo_hist[i]):
            assert f.metrics == s.metrics, (i, TENANTS[i][0])  # every metric, bit for bit
            for fo, so in zip(f.outputs, s.outputs):
                for key in fo:
                    np.testing.assert_array_equal(fo[key], so[key])
        for k in solo_state[i]:
            assert torch.equal(fused_state[i][k], solo_state[i][k]), (i, k)
    sr = fused_hist[1][0].metrics
    assert set(sr) == {"loss:sum", "pg_loss:sum", "kl_penalty:sum", "sampled_tokens:sum",
                       "sampler_trainer_logprob_diff:mean", "datum_logprobs_mismatch:max"}
    assert set(fused_hist[0][0].metrics) == {"loss:sum", "seq_ratio:mean", "seq_clipped_frac:mean"}
