"""Batch invariance of the fused pass (issue 3, test 2), on the runtime in process.

One tenant's logprobs, loss and update are the same whether its request runs alone or in one
fused forward/backward with 7 other tenants that use other losses and other LoRA ranks, on this
machine's kernels (tests/test_exactness_other_kernels.py re-runs this module under others).
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from transformers import AutoModelForCausalLM

from hosted_tinker.models.embedded import SPEC_PRESETS, ensure_embedded_model
from hosted_tinker.requests.kinds import FBWork
from hosted_tinker.runtime.adapters import AdamParams, LoRAConfig
from hosted_tinker.runtime.trainer import TrainingRuntime
from helpers import TENANTS, TOPK_TENANTS, assert_each_tenant_matches_solo, random_work, train_tenants

@pytest.fixture(scope="module")
def runtime(tmp_path_factory):
    path = ensure_embedded_model(tmp_path_factory.mktemp("models"))
    model = AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32)
    return TrainingRuntime(model, "embedded", device=torch.device("cpu"), max_tokens_per_micro_batch=2048)


def test_cobatched_equals_solo_for_every_loss_and_rank(runtime):
    """Bit for bit, over three steps: logprobs, per-token losses, loss:sum, grad_norm (clipped
    tenants too), adapter weights and both AdamW moments."""
    fused_hist, fused_state = train_tenants(runtime, list(range(8)), steps=3)
    assert runtime.last_pass.models == 8  # really one fused pass over all eight
    assert_each_tenant_matches_solo(runtime, list(range(8)), fused_hist, fused_state, steps=3,
                                    outputs=("logprobs", "elementwise_loss"))


def test_topk_and_one_target_tenants_cobatched_equal_solo(runtime):
    """Tenants with (N, 5) and (N, 2) cross_entropy targets next to (N,) cross_entropy and an RL
    loss, two steps fused vs each alone: bit for bit. Where this machine lets tenants share
    micro-batches, rows of (N,) and (N, K) targets really share one."""
    tenants = [0, 1, *TOPK_TENANTS]
    fused_hist, fused_state = train_tenants(runtime, tenants, steps=2)
    works = [random_work(i * 10, f"t{i}", *TENANTS[i][:2], targets_k=TOPK_TENANTS.get(i, 0)) for i in tenants]
    both = [mb for mb in runtime.plan(works).micro_batches
            if len({bool(works[wi].targets_k) for wi, _, _ in mb.runs}) == 2]
    assert both or not runtime.policy.describe()["mix_tenants"]
    for i in tenants:
        assert all(fo["logprobs"].shape[1:] == ((TOPK_TENANTS[i],) if i in TOPK_TENANTS else ())
                   for f, _ in fused_hist[i] for fo in f.outputs)
    assert_each_tenant_matches_solo(runtime, tenants, fused_hist, fused_state, steps=2,
                                    outputs=("logprobs", "elementwise_loss"))


def test_cobatched_equals_solo_on_a_wider_model(tmp_path):
    """The same on the 256x4 preset, whose lm_head input gradient changes rows' bits with the row
    count on some CPUs: whatever the policy decides there (sharing with transposed weight copies,
    or each tenant alone), co-batched results equal solo ones."""
    path = ensure_embedded_model(tmp_path, SPEC_PRESETS["small"])
    runtime = TrainingRuntime(AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32), "small",
                              device=torch.device("cpu"), max_tokens_per_micro_batch=2048)
    tenants = [0, 2, 5]
    fused_hist, fused_state = train_tenants(runtime, tenants, steps=2)
    assert_each_tenant_matches_solo(runtime, tenants, fused_hist, fused_state, steps=2)


def test_removing_a_tenant_leaves_the_others_intact(runtime):
    _, state_before = train_tenants(runtime, [0, 1], steps=1)
    runtime.remove_adapter("t1")
    a = runtime.adapter("t0")
    assert all(torch.equal(v, state_before[0][k]) for k, v in a.named_tensors().items())
    out = runtime.forward_backward([FBWork("t0", random_work(5, "t0", "cross_entropy", {}).data, "cross_entropy", {}, True)])
    assert len(out[0].outputs) > 0


def test_paging_out_and_back_in_changes_nothing(runtime):
    _, reference = train_tenants(runtime, [0, 2, 4], steps=3, fused=False)
    runtime.max_live_adapters = 1  # every pass pages the previous tenant out
    try:
        _, paged = train_tenants(runtime, [0, 2, 4], steps=3, fused=False)
    finally:
        runtime.max_live_adapters = 64
    assert runtime.page_outs > 0
    for i in reference:
        for k in reference[i]:
            assert torch.equal(reference[i][k], paged[i][k]), (i, k)


@pytest.mark.parametrize("rank", [8, 1])
def test_same_shape_tenants_share_one_batched_matmul_and_equal_solo(runtime, rank):
    """Tenants of one rank and one request shape are computed together -- one micro-batch, one
    grouped LoRA call per layer -- wherever this machine's `FusionPolicy` has proven that sharing
    keeps every tenant's bits; each still gets exactly its solo result, shared or not."""
    losses = ["cross_entropy", "ppo", "importance_sampling", "dro", "cispo", "cross_entropy"]
    cfgs = {"dro": {"beta": 0.1}}
    layer = runtime.layers["model.layers.0.self_attn.q_proj"]
    calls: list[list[int]] = []  # per forward of the layer with adapters: tenants per grouped call

    def record(mod, args):
        plan = runtime.routing.plan_for(mod, args[0])
        if plan is not None:
            calls.append([c.n for c in plan.calls])

    hook = layer.register_forward_pre_hook(record)

    def train(ids: list[int]):
        for mid in list(runtime.adapters):
            runtime.remove_adapter(mid)
        for i in ids:
            runtime.create_adapter(f"s{i}", LoRAConfig(rank=rank, seed=100 + i))
        outs = {i: [] for i in ids}
        for step in range(2):
            works = [random_work(5000 + 10 * i + step, f"s{i}", losses[i], cfgs.get(losses[i], {}), lengths=(40, 37))
                     for i in ids]
            for i, out in zip(ids, runtime.forward_backward(works)):
                outs[i].append(out)
            # All tenants' steps in one multi-adapter AdamW step, as a server cycle does.
            runtime.optim_steps([(f"s{i}", AdamParams(learning_rate=1e-2, weight_decay=0.01)) for i in ids])
        return outs, {i: {k: v.detach().clone() for k, v in runtime.adapter(f"s{i}").named_tensors().items()}
                      for i in ids}

    try:
        fused_out, fused_state = train(list(range(len(losses))))
        # Two datums of 40 tokens per tenant: the 48-token bucket, 2 x 48 tokens per tenant.
        n = len(losses)
        mixed = runtime.policy.mix_tenants(48, 2 * n)
        grouped = mixed and runtime.policy.group_lora(2 * 48, layer.in_features, layer.out_features, rank, n,
                                                      torch.float32)
        if grouped:  # one micro-batch, one call for all six tenants
            assert calls[0] == [n]
        elif mixed:  # one micro-batch, each tenant its own canonical call
            assert calls[0] == [1] * n
        else:  # each tenant its own micro-batch
            assert calls[:n] == [[1]] * n
        for i in range(len(losses)):
            solo_out, solo_state = train([i])
            for f, s in zip(fused_out[i], solo_out[i]):
                assert f.metrics["loss:sum"] == s.metrics["loss:sum"]
                for fo, so in zip(f.outputs, s.outputs):
                    np.testing.assert_array_equal(fo["logprobs"], so["logprobs"])
                    np.testing.assert_array_equal(fo["elementwise_loss"], so["elementwise_loss"])
            for k in solo_state[i]:
                assert torch.equal(fused_state[i][k], solo_state[i][k]), (i, k)
    finally:
        hook.remove()
