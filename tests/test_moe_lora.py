"""MoE experts get LoRA the way Tinker gives it (issue 23, part 2), on the runtime in process.

Tiny random Qwen3-MoE, Mixtral and GPT-OSS models (transformers >= 5: fused 3-D expert weights,
GPT-OSS with biases and interleaved gate/up) are built here and saved to a folder. Each trains a
few steps through the multi-LoRA runtime with falling loss; its checkpoint adapts every expert
of every layer in Tinker's layout (`experts.w1/w2/w3`, [experts, rank, dim]); the cookbook's
`build_lora_adapter` and `build_hf_model` take the checkpoint, and the merged Hugging Face model
gives the runtime's logprobs; a load of the checkpoint round-trips. Co-batched tenants (sharing
micro-batches) get the bits they get alone (tests/test_exactness_other_kernels.py re-runs this under AVX2 kernels).
"""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch
from safetensors.torch import load_file, save_file

from hosted_tinker.checkpoints.adapter_io import check_fits, restore_adapter, save_adapter
from hosted_tinker.checkpoints.format import ADAPTER_CONFIG, ADAPTER_WEIGHTS, CheckpointError, read_checkpoint
from hosted_tinker.runtime.adapters import AdamParams, LoRAConfig
from hosted_tinker.runtime.invariance import same_bits
from hosted_tinker.runtime.moe_lora import ExpertProjection, describe_expert_gemms
from hosted_tinker.runtime import moe_routing
from hosted_tinker.runtime.moe_routing import PaddedGroups
from hosted_tinker.runtime.trainer import TrainingRuntime
from helpers import assert_each_tenant_matches_solo, train_tenants
from tiny_model import ce_work, grads, one_torch_thread  # noqa: F401  (autouse: one CPU thread)

EXPERTS, LAYERS, RANK, VOCAB = 4, 2, 4, 1024
# hidden 32, expert width 48: neither equal nor half of the other, so the cookbook's merge finds
# the fused gate/up axis and the down projection's orientation unambiguously.
DIMS = dict(vocab_size=VOCAB, hidden_size=32, num_hidden_layers=LAYERS, num_attention_heads=4,
            num_key_value_heads=2, head_dim=8, max_position_embeddings=256, tie_word_embeddings=False)


def tiny_moe(kind: str) -> torch.nn.Module:
    """A 2-layer, 4-expert (top-2) model of `kind`, random weights fixed by the seed (fp32, eval)."""
    import transformers as tf

    torch.manual_seed(0)
    if kind == "qwen3_moe":
        model = tf.Qwen3MoeForCausalLM(tf.Qwen3MoeConfig(**DIMS, intermediate_size=64, moe_intermediate_size=48,
                                                         num_experts=EXPERTS, num_experts_per_tok=2))
    elif kind == "mixtral":
        model = tf.MixtralForCausalLM(tf.MixtralConfig(**DIMS, intermediate_size=48, num_local_experts=EXPERTS,
                                                       num_experts_per_tok=2))
    else:
        model = tf.GptOssForCausalLM(tf.GptOssConfig(**DIMS, intermediate_size=48, num_local_experts=EXPERTS,
                                                     num_experts_per_tok=2, layer_types=["full_attention"] * LAYERS))
    with torch.no_grad():  # transformers leaves 3-D expert weights and biases uninitialised
        for name, p in model.named_parameters():
            if p.dim() == 3 or name.endswith("bias"):
                p.normal_(0, 0.1)
            if p.dim() == 2 and p.shape[0] == EXPERTS:  # routers: spread the tokens over every expert
                p.normal_(0, 0.5)
    model.config.architectures = [type(model).__name__]
    return model.float().eval()


KINDS = ["qwen3_moe", "mixtral", "gpt_oss"]


@pytest.fixture(scope="module", params=KINDS)
def moe(request, tmp_path_factory):
    """(kind, folder of the saved base model, runtime serving it)."""
    folder = tmp_path_factory.mktemp(request.param)
    tiny_moe(request.param).save_pretrained(folder)
    rt = TrainingRuntime(tiny_moe(request.param), request.param, device=torch.device("cpu"))
    return request.param, folder, rt


def expert_paths() -> list[str]:
    return [f"model.layers.{i}.mlp.experts.{w}" for i in range(LAYERS) for w in ("w1", "w2", "w3")]


def logprobs(rt: TrainingRuntime, model_id: str, seqs: list[list[int]]) -> list[np.ndarray]:
    out = rt.forward_backward([ce_work(model_id, seqs, forward_only=True)])[0]
    return [o["logprobs"] for o in out.outputs]


def routed_experts(model: torch.nn.Module, seqs: list[list[int]]) -> list[set[int]]:
    """Per layer, the experts the base model's router sends any token of `seqs` to."""
    routed: list[set[int]] = [set() for _ in range(LAYERS)]
    hooks = [layer.mlp.experts.register_forward_pre_hook(lambda _, args, i=i: routed[i].update(args[1].flatten().tolist()))
             for i, layer in enumerate(model.model.layers)]
    with torch.no_grad():
        for seq in seqs:
            model(input_ids=torch.tensor([seq[:-1]]))
    for hook in hooks:
        hook.remove()
    return routed


SEQS = [[int(t) for t in np.random.default_rng(s).integers(0, VOCAB, 24)] for s in range(6)]


def test_experts_train_save_merge_and_load(moe, tmp_path):
    kind, base_dir, rt = moe
    from tinker_cookbook.weights import build_hf_model, build_lora_adapter
    from transformers import AutoModelForCausalLM

    adapter = rt.create_adapter("m", LoRAConfig(rank=RANK, seed=1))
    losses = []
    for _ in range(3):
        out = rt.forward_backward([ce_work("m", SEQS)])[0]
        losses.append(out.metrics["loss:sum"])
        rt.optim_step("m", AdamParams(learning_rate=1e-2))
    assert losses[-1] < losses[0], losses

    ckpt = tmp_path / "ckpt"
    save_adapter(adapter, ckpt, str(base_dir), with_optimizer=True)
    routed = routed_experts(tiny_moe(kind), SEQS)
    saved = load_file(str(ckpt / ADAPTER_WEIGHTS))
    hidden, inter = 32, 48
    for path in expert_paths():  # every expert of every layer's three projections, trained
        leaf = path.rsplit(".", 1)[1]
        a, b = (saved[f"base_model.model.{path}.lora_{x}.weight"] for x in "AB")
        in_f, out_f = (inter, hidden) if leaf == "w2" else (hidden, inter)
        assert a.shape == (EXPERTS, RANK, in_f) and b.shape == (EXPERTS, out_f, RANK), (path, a.shape, b.shape)
        trained = [bool(b[e].abs().sum() > 0) for e in range(EXPERTS)]
        # Every expert the router sends tokens (this tiny GPT-OSS's routers leave some without any).
        assert all(trained[e] for e in routed[int(path.split(".")[2])]), (path, trained)
        assert kind == "gpt_oss" or all(trained), (path, trained)
    assert {"w1", "w2", "w3"} <= set(json.loads((ckpt / ADAPTER_CONFIG).read_text())["target_modules"])

    peft = tmp_path / "peft"
    build_lora_adapter(base_model=str(base_dir), adapter_path=str(ckpt), output_path=str(peft))
    peft_keys = load_file(str(peft / "adapter_model.safetensors"))
    assert all(f"base_model.model.model.layers.{i}.mlp.experts.{e}.gate_proj.lora_A.weight" in peft_keys
               for i in range(LAYERS) for e in range(EXPERTS))

    merged = tmp_path / "merged"
    # transformers saves Mixtral in its hub layout (block_sparse_moe.experts.N.w1), which the
    # cookbook's shard-by-shard merge does not map; its full-model merge loads it as HF does.
    build_hf_model(base_model=str(base_dir), adapter_path=str(ckpt), output_path=str(merged), dtype="float32",
                   merge_strategy="full" if kind in ("mixtral", "gpt_oss") else "auto")
    hf = AutoModelForCausalLM.from_pretrained(str(merged), dtype=torch.float32).eval()
    ours = logprobs(rt, "m", SEQS)
    for seq, lp in zip(SEQS, ours):
        with torch.no_grad():
            full = hf(input_ids=torch.tensor([seq[:-1]])).logits[0].log_softmax(-1)
        theirs = full.gather(1, torch.tensor(seq[1:])[:, None])[:, 0].numpy()
        assert np.abs(theirs - lp).max() <= 1e-5, (kind, np.abs(theirs - lp).max())

    loaded = read_checkpoint(ckpt, with_optimizer=True)
    check_fits(loaded, rt.layers, max_rank=64)
    other = rt.create_adapter("copy", LoRAConfig(rank=RANK, seed=9))
    restore_adapter(other, loaded)
    assert all(same_bits(t, adapter.named_tensors()[k]) for k, t in other.named_tensors().items())
    assert all(np.array_equal(x, y) for x, y in zip(logprobs(rt, "copy", SEQS), ours))
    rt.remove_adapter("copy")
    rt.remove_adapter("m")


def test_an_expert_factor_shared_by_every_expert_is_broadcast_on_load(moe, tmp_path):
    """Tinker's checkpoints may hold one of A and B as [1, ...], shared by the experts."""
    _, base_dir, rt = moe
    adapter = rt.create_adapter("s", LoRAConfig(rank=RANK, seed=2))
    ckpt = tmp_path / "ckpt"
    save_adapter(adapter, ckpt, str(base_dir), with_optimizer=False)
    tensors = load_file(str(ckpt / ADAPTER_WEIGHTS))
    key = "base_model.model.model.layers.0.mlp.experts.w1.lora_A.weight"
    tensors[key] = tensors[key][:1].clone()
    save_file(tensors, str(ckpt / ADAPTER_WEIGHTS))
    (ckpt / "manifest.json").unlink()  # now a plain adapter made elsewhere
    loaded = read_checkpoint(ckpt, with_optimizer=False)
    check_fits(loaded, rt.layers, max_rank=64)
    restore_adapter(adapter, loaded)
    A = adapter.weights["model.layers.0.mlp.experts.w1"].A
    assert all(torch.equal(A[e], tensors[key][0]) for e in range(EXPERTS))
    tensors[key.replace("lora_A", "lora_B")] = tensors[key.replace("lora_A", "lora_B")][:1].clone()
    save_file(tensors, str(ckpt / ADAPTER_WEIGHTS))
    with pytest.raises(CheckpointError, match="do not fit"):  # both shared: not an expert LoRA
        check_fits(read_checkpoint(ckpt, with_optimizer=False), rt.layers, max_rank=64)
    rt.remove_adapter("s")


def force_device_plan(monkeypatch) -> None:
    """The expert GEMM plan of a CUDA device, forced on the CPU (no CUDA here): off bf16, a bmm per
    tenant over padded groups (`moe_routing.pads_groups`) instead of torch's loop of one `mm` per
    group."""
    monkeypatch.setattr(moe_routing, "pads_groups", lambda x: x.dtype != torch.bfloat16)


@pytest.mark.parametrize("plan", ["cpu", "device"])
@pytest.mark.parametrize("tenants", [[0, 1, 3, 5], [0, 4]], ids=["mixed", "one-rank"])
def test_cobatched_equals_solo_on_an_moe_model(moe, monkeypatch, tenants, plan):
    """Tenants sharing micro-batches, two steps fused vs each alone: logprobs, losses, grad norms,
    weights and moments bit for bit. Mixed: four tenants of other losses, ranks and train flags, two
    of them without expert LoRA (the LoRA gathers its rows); one-rank: two tenants whose expert LoRA
    runs on the base GEMMs' own groups. (Until the base expert GEMMs ran per (tenant, expert)
    group, the second step lost bits: a tenant's expert group grew with the other tenants' tokens
    and took other kernels.) With the CPU's fp32 plan and with a device's (issue 44: padded groups,
    a bmm per tenant)."""
    kind, _, rt = moe
    if kind != "qwen3_moe":
        pytest.skip("one MoE family is enough for the co-batching check")
    if plan == "device":
        force_device_plan(monkeypatch)
    # Only the start-up probe of this machine's kernels may keep tenants apart (under AVX2 kernels
    # it does so for dense models too), never the experts themselves.
    refused = rt.policy.mixing_refused
    assert refused is None or "at start-up" in refused, refused
    shared = []  # the tenants of each micro-batch
    batch = rt.routing.batch
    monkeypatch.setattr(rt.routing, "batch", lambda segments, **kw: (shared.append({s[0] for s in segments}),
                                                                      batch(segments, **kw))[1])
    fused_hist, fused_state = train_tenants(rt, tenants, steps=2)
    assert refused is not None or max(map(len, shared)) > 1, shared  # they did share micro-batches
    assert_each_tenant_matches_solo(rt, tenants, fused_hist, fused_state, steps=2)
    for mid in list(rt.adapters):
        rt.remove_adapter(mid)


def test_wide_experts_share_micro_batches_wherever_their_dense_twin_does():
    """With 1024-wide experts an expert's rows change bits as its group grows (AVX-512: groups of
    1-7 rows against longer ones), so the start-up probe used to refuse mixing for such a model;
    its rows now run as tenants do (each its own expert groups), so it mixes wherever the same
    model with a dense MLP does, and two tenants sharing micro-batches keep their solo bits."""
    import transformers as tf

    dims = dict(vocab_size=VOCAB, hidden_size=64, num_hidden_layers=1, num_attention_heads=4,
                num_key_value_heads=2, head_dim=16)
    torch.manual_seed(0)
    moe = tf.Qwen3MoeForCausalLM(tf.Qwen3MoeConfig(**dims, moe_intermediate_size=1024, num_experts=8,
                                                   num_experts_per_tok=2))
    with torch.no_grad():  # transformers leaves 3-D expert weights uninitialised
        for p in moe.parameters():
            if p.dim() == 3:
                p.normal_(0, 0.05)
    dense = tf.Qwen3ForCausalLM(tf.Qwen3Config(**dims, intermediate_size=1024))
    rt = TrainingRuntime(moe.float().eval(), "wide-moe", device=torch.device("cpu"))
    twin = TrainingRuntime(dense.float().eval(), "wide-dense", device=torch.device("cpu"))
    assert (rt.policy.mixing_refused is None) == (twin.policy.mixing_refused is None), rt.policy.mixing_refused
    fused_hist, fused_state = train_tenants(rt, [0, 5], steps=2)
    for i in (0, 5):
        solo_hist, solo_state = train_tenants(rt, [i], steps=2)
        assert [norm for _, norm in fused_hist[i]] == [norm for _, norm in solo_hist[i]]
        assert all(same_bits(fused_state[i][k], solo_state[i][k]) for k in solo_state[i]), i


def test_padded_groups_give_each_groups_products():
    """Issue 44: the fp32 expert GEMMs run as one bmm over groups padded to a bound the host knows
    (`PaddedGroups`, no group length read to the host): each group's rows get their products with
    its own matrix -- empty groups and a group as long as the bound included -- and the weight
    gradients sum each group's rows alone; a group longer than the bound fails loudly."""
    gen = torch.Generator().manual_seed(0)
    lengths = [3, 0, 5, 1, 0, 5]
    offs = torch.tensor(lengths).cumsum(0).to(torch.int32)
    x, w = torch.randn(sum(lengths), 7, generator=gen), torch.randn(len(lengths), 7, 4, generator=gen)
    b = torch.randn(sum(lengths), 4, generator=gen)
    padded = PaddedGroups.of(offs, sum(lengths), cap=5)
    y, grads = padded.mm(x, w), padded.weight_mm(x, b)
    at = 0
    for g, n in enumerate(lengths):
        torch.testing.assert_close(y[at:at + n], x[at:at + n] @ w[g], rtol=1e-6, atol=1e-6)
        torch.testing.assert_close(grads[g], x[at:at + n].T @ b[at:at + n], rtol=1e-6, atol=1e-6)
        at += n
    with pytest.raises(RuntimeError):
        PaddedGroups.of(offs, sum(lengths), cap=4)


def test_the_device_plan_computes_what_the_cpu_plan_does(moe, monkeypatch):
    """Issue 44: a device's fp32 expert GEMMs (a bmm per tenant over padded groups, forced here on
    the CPU) give the logprobs, loss and LoRA gradients of the CPU's (one `mm` per group), which
    match the merged PEFT model's (test_experts_train_save_merge_and_load): two tenants, one pass."""
    kind, _, rt = moe
    seqs = {"a": SEQS[:3], "b": SEQS[3:]}
    got = {}
    for plan in ("cpu", "device"):
        if plan == "device":
            force_device_plan(monkeypatch)
        for mid in seqs:
            rt.create_adapter(mid, LoRAConfig(rank=RANK, seed=len(mid) + ord(mid)))
            with torch.no_grad():  # non-zero B: the deltas and A's gradients count
                for w in rt.adapter(mid).weights.values():
                    w.B.normal_(0, 0.1, generator=torch.Generator().manual_seed(ord(mid)))
        outs = rt.forward_backward([ce_work(mid, s) for mid, s in seqs.items()])
        got[plan] = [(o.metrics["loss:sum"], [d["logprobs"] for d in o.outputs], grads(rt.adapter(mid)))
                     for mid, o in zip(seqs, outs)]
        for mid in seqs:
            rt.remove_adapter(mid)
    for (loss, lps, g), (loss_d, lps_d, g_d) in zip(got["cpu"], got["device"]):
        assert abs(loss - loss_d) <= 1e-5 * abs(loss), (kind, loss, loss_d)
        assert max(np.abs(x - y).max() for x, y in zip(lps, lps_d)) <= 1e-5, kind
        assert any(k.endswith("experts.w2.lora_A.weight") and g[k] is not None for k in g), sorted(g)[:4]
        for k in g:
            torch.testing.assert_close(g_d[k], g[k], rtol=1e-4, atol=1e-6, msg=f"{kind} {k}")


def test_the_start_up_summary_says_how_the_experts_run_and_what_fp32_costs_on_a_gpu(moe):
    """Issue 44: the training line of the start-up summary names the expert GEMMs' plan; for an fp32
    body on a device (its weights moved to the meta device here: no GPU) it says that MoE trains at
    the GPU's pace only in bf16, and what fp32 costs."""
    kind, _, rt = moe
    line = rt.describe_training()
    assert "MoE experts float32, one GEMM per (tenant, expert) group" in line, line
    experts = next(layer.owner for layer in rt.layers.values() if isinstance(layer, ExpertProjection))
    base = experts.base
    saved = base.gate_up_proj
    try:
        base.gate_up_proj = torch.nn.Parameter(saved.detach().to("meta"), requires_grad=False)
        on_gpu = describe_expert_gemms(rt.layers)
    finally:
        base.gate_up_proj = saved
    assert f"{EXPERTS} / top-k times the FLOPs" in on_gpu and "GPU's pace only in bfloat16" in on_gpu, on_gpu
