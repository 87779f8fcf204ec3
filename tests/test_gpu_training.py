"""Many tenants on one GPU: shared micro-batches, bit-exact, as CUDA graphs (issue 22).

Run on a CUDA machine with `HOSTED_TINKER_TEST_DEVICE=cuda python -m pytest tests/test_gpu_training.py`;
elsewhere every test here skips. The model is the 512 x 8 preset in bfloat16, as a GPU serves it.
"""

from __future__ import annotations

import dataclasses
import os

import pytest
import torch
from transformers import AutoModelForCausalLM

from hosted_tinker.models.embedded import SPEC_PRESETS, ensure_embedded_model
from hosted_tinker.runtime.adapters import AdamParams, LoRAConfig
from hosted_tinker.runtime.invariance import same_bits
from hosted_tinker.runtime.trainer import TrainingRuntime
from helpers import TENANTS, assert_each_tenant_matches_solo, random_work, split_batch_gap, train_tenants
from tiny_model import tiny_decoder

pytestmark = pytest.mark.skipif(
    os.environ.get("HOSTED_TINKER_TEST_DEVICE") != "cuda" or not torch.cuda.is_available(),
    reason="GPU test: set HOSTED_TINKER_TEST_DEVICE=cuda on a machine with CUDA")

CUDA = torch.device("cuda")


@pytest.fixture(scope="module")
def model_path(tmp_path_factory):
    return ensure_embedded_model(tmp_path_factory.mktemp("models"), SPEC_PRESETS["medium"])


def make_runtime(path, **kwargs) -> TrainingRuntime:
    model = AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.bfloat16).to(CUDA)
    return TrainingRuntime(model, "medium", device=CUDA, **kwargs)


@pytest.fixture(scope="module")
def runtime(model_path):
    return make_runtime(model_path)


def test_the_runtime_says_which_path_is_in_force(runtime):
    line = runtime.describe_training()
    assert line.startswith("tenants share micro-batches"), line
    assert "cuBLASLt, split-K off" in line and "CUDA graphs on" in line and "logits float32" in line, line


def test_cobatched_tenants_of_every_loss_and_rank_get_their_solo_bits(runtime):
    """Eleven tenants -- every loss (gspo eager, the others graphed), (N, K) cross_entropy targets
    too, ranks 1-32, ragged lengths, some clipping -- three steps fused vs each alone: losses,
    metrics, logprobs, grad norms, weights and AdamW moments bit for bit."""
    ids = list(range(len(TENANTS)))
    fused_hist, fused_state = train_tenants(runtime, ids, steps=3)
    policy = runtime.policy.describe()
    assert policy["mix_tenants"] and policy["mix_shapes_proven"] >= 2, policy  # they really shared
    assert runtime.graphs.replays > 0
    for i in ids:
        solo_hist, solo_state = train_tenants(runtime, [i], steps=3)
        for (f, f_norm), (s, s_norm) in zip(fused_hist[i], solo_hist[i]):
            assert f.metrics == s.metrics and f_norm == s_norm, (i, f.metrics, s.metrics, f_norm, s_norm)
            for fo, so in zip(f.outputs, s.outputs):
                assert same_bits(torch.from_numpy(fo["logprobs"]), torch.from_numpy(so["logprobs"])), i
        for k in solo_state[i]:
            assert same_bits(fused_state[i][k], solo_state[i][k]), (i, k)


def test_sixteen_same_shape_tenants_share_one_pass_and_equal_solo(runtime):
    """The benchmark's case: 16 tenants of one rank, 2 x 128 tokens each, one micro-batch."""
    for mid in list(runtime.adapters):
        runtime.remove_adapter(mid)
    works = [random_work(700 + t, f"s{t}", "cross_entropy", {}, lengths=(128, 128)) for t in range(16)]
    for t in range(16):
        runtime.create_adapter(f"s{t}", LoRAConfig(rank=16, seed=t))
        runtime.create_adapter(f"solo{t}", LoRAConfig(rank=16, seed=t))
    adam = AdamParams(learning_rate=1e-3)
    for step in range(3):
        fused = runtime.forward_backward(works)
        assert runtime.last_pass.micro_batches == 1
        fused_norms = runtime.optim_steps([(w.model_id, adam) for w in works])
        for t in (0, 7, 15):
            solo = runtime.forward_backward([dataclasses.replace(works[t], model_id=f"solo{t}")])[0]
            solo_norm = runtime.optim_step(f"solo{t}", adam)
            assert solo.metrics == fused[t].metrics and solo_norm == fused_norms[t], (step, t)
    for t in (0, 7, 15):
        a, b = runtime.adapter(f"s{t}"), runtime.adapter(f"solo{t}")
        assert all(same_bits(x, y) for x, y in zip(a.parameters(), b.parameters())), t


def test_splitting_a_batch_changes_logprobs_by_at_most_1e_3(model_path):
    """The same 8 datums as one micro-batch of 8 or two calls of 4, then one AdamW step: bf16
    activations, bf16 LoRA GEMMs whose weight gradients are summed per datum in fp32, fp32 logits."""
    rt = make_runtime(model_path, max_tokens_per_micro_batch=8 * 128)
    gap = split_batch_gap(rt, random_work(11, "one", "cross_entropy", {}, lengths=(128,) * 8), 1e-4)
    print(f"1 x 8 vs 2 x 4 micro-batches: logprobs after a step differ by {gap:.3e}")
    assert gap <= 1e-3


def test_replayed_steps_give_the_eager_steps_bits(model_path):
    """A runtime without CUDA graphs and one with them, on copies of the same model."""
    eager = make_runtime(model_path, cuda_graphs=False)
    graphed = make_runtime(model_path)
    tenants = [0, 2, 4]
    expected = train_tenants(eager, tenants, steps=2)
    got = train_tenants(graphed, tenants, steps=2)
    assert graphed.graphs.replays > 0
    for i in tenants:
        for (a, na), (b, nb) in zip(expected[0][i], got[0][i]):
            assert a.metrics == b.metrics and na == nb, i
        for k in expected[1][i]:
            assert same_bits(expected[1][i][k], got[1][i][k]), (i, k)


def test_a_captured_step_never_waits_for_the_device_before_its_results(runtime):
    """Once its layout is captured, a forward_backward launches everything without a host sync;
    the only wait is the one that collects its outputs (allowed by the runtime)."""
    for mid in list(runtime.adapters):
        runtime.remove_adapter(mid)
    for t in range(4):
        runtime.create_adapter(f"n{t}", LoRAConfig(rank=8, seed=t))
    works = [random_work(900 + t, f"n{t}", "cross_entropy", {}, lengths=(64, 50)) for t in range(4)]
    for _ in range(2):
        runtime.forward_backward(works)
        runtime.optim_steps([(w.model_id, AdamParams()) for w in works])
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        runtime.forward_backward(works)
    finally:
        torch.cuda.set_sync_debug_mode(0)


def test_moe_tenants_on_the_gpu_get_their_solo_bits():
    """Expert LoRA on CUDA in bfloat16 (issue 23): a tiny Qwen3-MoE's expert slots live on the GPU, and
    four tenants of other losses, ranks and train flags, trained together two steps, get the bits each
    gets alone (whether the start-up probe let them share micro-batches is printed, not required)."""
    rt = TrainingRuntime(tiny_decoder("moe", dtype=torch.bfloat16).to(CUDA), "qwen3_moe", device=CUDA)
    tenants = [0, 1, 3, 5]
    fused_hist, fused_state = train_tenants(rt, tenants, steps=2)
    assert all(t.device.type == "cuda" for state in fused_state.values() for t in state.values())
    print(f"MoE on CUDA: {rt.describe_training()}; mixing refused: {rt.policy.mixing_refused}")
    assert_each_tenant_matches_solo(rt, tenants, fused_hist, fused_state, steps=2)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=["bf16", "fp32"])
def test_a_captured_moe_cycle_waits_for_the_device_once(dtype):
    """Issue 34: a bf16 MoE's routing is planned on the device and its expert LoRA runs as bf16
    grouped GEMMs, so once its layout is captured a whole cycle -- the replayed pass and the
    optimizer steps (norms, clipping, the finite check, AdamW) -- launches without a host sync; the
    one wait reads both. Issue 44: so does an fp32 MoE's (its expert GEMMs a bmm per tenant over
    padded groups)."""
    rt = TrainingRuntime(tiny_decoder("moe", dtype=dtype).to(CUDA), "moe", device=CUDA)
    for t in range(4):
        rt.create_adapter(f"m{t}", LoRAConfig(rank=8, seed=t))
    works = [random_work(900 + t, f"m{t}", "cross_entropy", {}, lengths=(64, 50)) for t in range(4)]
    steps = [(w.model_id, AdamParams(learning_rate=1e-3, grad_clip_norm=1.0 if t % 2 else 0.0))
             for t, w in enumerate(works)]
    for _ in range(2):
        rt.forward_backward(works)
        rt.optim_steps(steps)
    assert rt.graphs.replays > 0
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        fb = rt.launch_forward_backward(works)
        opt = rt.launch_optim_steps(steps)
        rt.wait()
        outcomes, results = fb.outcomes(), opt.results()
    finally:
        torch.cuda.set_sync_debug_mode(0)
    assert len(outcomes) == 4 and all(r["grad_norm"] > 0 for r in results), results


def test_bf16_moe_split_batch_stays_within_1e_3():
    """Issue 34: the expert LoRA's weight gradients, taken per datum in bf16 and summed in fp32,
    keep a split batch within 1e-3 on the GPU too (tests/test_lora_precision.py on CPU)."""
    rt = TrainingRuntime(tiny_decoder("moe", dtype=torch.bfloat16).to(CUDA), "moe", device=CUDA,
                         max_tokens_per_micro_batch=8 * 48)
    gap = split_batch_gap(rt, random_work(11, "one", "cross_entropy", {}, lengths=(48,) * 8), 1e-4)
    print(f"MoE on CUDA, 1 x 8 vs 2 x 4 micro-batches: logprobs after a step differ by {gap:.3e}")
    assert gap <= 1e-3
