"""Every weight matrix a LoRA is asked to train is trained, on the architectures Tinker users bring
(issue 23, parts 1 and 3).

Tiny random models of seven families, built here and served by path by ONE server process:
Qwen3, Llama, Gemma3 (plain q/k/v/o and gate/up/down), Phi (dense, fc1, fc2), Phi3 (fused
qkv_proj and gate_up_proj), GPT-NeoX (fused query_key_value, heads interleaved) and GPT-2
(transformers Conv1D, fused c_attn). Each, through the real SDK:
- trains with falling loss;
- adapts every attention and MLP weight matrix: the saved checkpoint holds a non-zero LoRA for
  each (a fused projection as one PEFT LoRA of rank 3r / 2r with a block-diagonal B);
- samples with sampler/trainer parity <= 1e-5 in fp32;
- exports with `hosted-tinker export --merged` (checkpoints/merge.py) to a plain transformers model
  whose logprobs equal the server's, and the same for an unembedding LoRA on a tied (Gemma3, GPT-2)
  or renamed (GPT-NeoX) head;
- goes, exported without --merged, through the cookbook's `build_lora_adapter` and `build_hf_model`,
  the merged model's logprobs equal to the server's. GPT-2 is the exception the cookbook makes: its
  2-D merge computes B @ A as [out, in] and GPT-2's Conv1D weights are [in, out], so it refuses them.
And four MoE families, Qwen3-MoE, Mixtral, GPT-OSS (transposed experts with biases, gate/up
interleaved, attention sinks) and DeepSeek-V3 (MLA attention q_a/q_b/kv_a_proj_with_mqa/kv_b/o, a
dense first layer, routed experts beside a shared expert): their experts' LoRA (w1, w2, w3 per
expert, runtime/moe_lora.py) goes the same way. The cookbook makes no PEFT adapter of DeepSeek-V3
(it refuses: no vLLM/SGLang LoRA for it) and merges it with its DeepSeek profile.
And Qwen3.5 as released, a vision-language model (text decoder under model.language_model) whose
first layer has linear attention (Gated DeltaNet: fused in_proj_qkv trained as in_proj_q/k/v,
in_proj_z/b/a, out_proj; the sampler keeps its recurrent state): its checkpoint names the LoRAs as
Tinker does (model.layers...), which the cookbook's Qwen3.5 profile maps back to the model's keys.
And Qwen3.5-MoE as released (Qwen3.5-35B-A3B, -397B-A17B): the same layers with routed experts beside
a gated shared expert, its experts' LoRA in Tinker's layout, merged by the same profile.
A checkpoint in Tinker's own layout of the fused projections (one LoRA per component beside the fused
module: tinker_layout.py) loads, samples and imports as ours does; a malformed one is a 400 naming the key.
"""

from __future__ import annotations

import json

import httpx
import numpy as np
import pytest
import torch
import transformers as T
from safetensors.torch import load_file

from family_models import configs, save_family_model
from helpers import checkpoint_dir, logprobs_of, read_adapter, sft_datum, tar_bytes
from hosted_tinker.models.embedded import ensure_embedded_model
from hosted_tinker.checkpoints.export import export_checkpoint
from hosted_tinker.runtime.projections import discover, tinker_name
from server_process import ServerProcess
from tinker_layout import rewrite_in_tinker_layout, split_fused, tinker_adapter_config
from tiny_vl_model import build_tiny_vl_model

pytestmark = pytest.mark.e2e

KEY = "tml-model-matrix"
TOKENS = [5, 17, 230, 41, 999, 8, 77, 300, 12, 640]
PARITY = 1e-5  # fp32: sampler and trainer run the same layers; the merged model is plain HF
# Qwen3.5 and Qwen3.5-MoE as released: their text decoder under model.language_model, a vision tower
VL = ("qwen3_5_vl", "qwen3_5_moe_vl")
MOE = ("qwen3_moe", "mixtral", "gpt_oss", "deepseek_v3", "qwen3_5_moe_vl")


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    root = tmp_path_factory.mktemp("matrix")
    tok_dir = ensure_embedded_model(root / "embedded")
    vocab = json.loads((tok_dir / "config.json").read_text())["vocab_size"]
    built = {name: save_family_model(root, name, cfg, tok_dir) for name, cfg in configs(vocab).items()}
    return {**built, **{arch: str(build_tiny_vl_model(root / arch, family=arch.removesuffix("_vl")))
                        for arch in VL}}


@pytest.fixture(scope="module")
def srv(models, tmp_path_factory):
    args = [a for path in models.values() for a in ("--base-model", path)]
    proc = ServerProcess(tmp_path_factory.mktemp("srv"), env={"TINKER_API_KEY": KEY}, args=tuple(args)).start()
    yield proc
    proc.stop()


def load_model(path: str, arch: str):
    return (T.AutoModelForImageTextToText if arch in VL else T.AutoModelForCausalLM).from_pretrained(
        path, dtype=torch.float32)


def expected_peft_modules(path: str, arch: str) -> set[str]:
    """The PEFT module paths a default LoRA (attention, MLP, unembedding) must cover, as Tinker
    names them (a vision-language model's text decoder as the text model's)."""
    model = load_model(path, arch)
    return {tinker_name(f"{p.path}.{w}" if p.kind == "experts" else p.path) for p in discover(model)
            if p.role in ("attn", "mlp", "unembed") for w in (("w1", "w2", "w3") if p.kind == "experts" else ("",))}


def logprobs_of_model(model, tokens: list[int]) -> np.ndarray:
    with torch.no_grad():
        lp = torch.log_softmax(model(torch.tensor([tokens])).logits[0].float(), -1)
    return lp[torch.arange(len(tokens) - 1), torch.tensor(tokens[1:])].numpy()


def check_peft_adapter(base: str, arch: str, ckpt, tensors: dict, peft_out) -> None:
    """The cookbook's `build_lora_adapter` writes our checkpoint's LoRAs as PEFT names them."""
    from tinker_cookbook.weights import build_lora_adapter

    build_lora_adapter(base_model=base, adapter_path=str(ckpt), output_path=str(peft_out))
    built = set(load_file(str(peft_out / "adapter_model.safetensors")))
    layers = "base_model.model.model.layers."
    if arch in VL:  # the cookbook names a vision-language model's PEFT LoRAs as vLLM serves them
        layers = "base_model.model.model.language_model.layers."
        tensors = {k.replace(".model.model.", ".model.model.language_model.", 1): v for k, v in tensors.items()}
    if arch in MOE:  # the cookbook writes an expert LoRA per expert, in HF's per-expert names
        per_expert = {k for k in built if ".experts." in k}
        moe_layers = {int(k.split(".layers.")[1].split(".")[0]) for k in tensors if ".experts." in k}
        assert per_expert == {f"{layers}{i}.mlp.experts.{e}.{proj}.lora_{ab}.weight"
                              for i in moe_layers for e in range(4) for proj in ("gate_proj", "up_proj", "down_proj")
                              for ab in "AB"}
        built = (built - per_expert) | {k for k in tensors if ".experts." in k}
    assert built == set(tensors)


@pytest.mark.parametrize("arch", ["qwen3", "llama", "gemma3", "phi3", "phi", "gpt_neox", "gpt2", *MOE, "qwen3_5_vl"])
def test_every_weight_matrix_is_trained_and_merges(srv, models, arch, tmp_path):
    from tinker import types
    from tinker_cookbook.exceptions import WeightsAdapterError
    from tinker_cookbook.weights import build_hf_model, build_lora_adapter

    base = models[arch]
    # A tied unembedding (Gemma3, GPT-NeoX, GPT-2 here) is not in the saved weights, and the cookbook
    # merges an unembedding LoRA of such a model into the shared input embeddings (Tinker's
    # `unembed_tokens`): not what the server trains, so those run without train_unembed.
    # GPT-NeoX's head is lm_head in transformers 5 and embed_out in its files, which the cookbook reads.
    tied = T.AutoConfig.from_pretrained(base).tie_word_embeddings or arch == "gpt_neox"
    with srv.client(KEY) as sc:
        tc = sc.create_lora_training_client(base_model=base, rank=4, seed=1, train_unembed=not tied).result()
        losses = []
        for _ in range(3):
            fb = tc.forward_backward([sft_datum(TOKENS)], "cross_entropy").result()
            losses.append(fb.metrics["loss:sum"])
            tc.optim_step(types.AdamParams(learning_rate=3e-3)).result()
        assert losses[-1] < losses[0], losses
        trained = logprobs_of(tc.forward([sft_datum(TOKENS)], "cross_entropy").result())[0]
        saved = tc.save_weights_for_sampler("matrix").result().path
        sampled = sc.create_sampling_client(model_path=saved).compute_logprobs(
            types.ModelInput.from_ints(TOKENS)).result()
    np.testing.assert_allclose(np.asarray(sampled[1:], dtype=np.float32), trained, atol=PARITY)

    ckpt = checkpoint_dir(srv, saved)
    tensors = load_file(str(ckpt / "adapter_model.safetensors"))
    modules = {k.removeprefix("base_model.model.").rsplit(".lora_", 1)[0] for k in tensors}
    assert modules == expected_peft_modules(base, arch) - ({"lm_head"} if tied else set())
    for m in modules:
        assert tensors[f"base_model.model.{m}.lora_B.weight"].abs().sum() > 0, f"{m} was not trained"

    # `hosted-tinker export --merged`: every LoRA merged as the server applies it (checkpoints/merge.py)
    merged_export = export_checkpoint(saved, tmp_path / "export-merged", merged=True, data_dir=srv.data_dir)
    np.testing.assert_allclose(logprobs_of_model(load_model(str(merged_export), arch), TOKENS), trained, atol=PARITY)

    # The plain export is the checkpoint's files, which the cookbook's weight tools take
    ckpt = export_checkpoint(saved, tmp_path / "export", data_dir=srv.data_dir)
    peft_out = tmp_path / "peft"
    if arch == "deepseek_v3":  # the cookbook offers DeepSeek-V3 adapters for merging only (no vLLM/SGLang LoRA)
        with pytest.raises(WeightsAdapterError, match="does not support LoRA adapter serving"):
            build_lora_adapter(base_model=base, adapter_path=str(ckpt), output_path=str(peft_out))
    else:
        check_peft_adapter(base, arch, ckpt, tensors, peft_out)

    merged = tmp_path / "merged"
    if arch == "gpt2":  # the cookbook's merge assumes [out, in] weights; Conv1D's are [in, out]
        with pytest.raises(Exception, match="[Ss]hape mismatch"):
            build_hf_model(base_model=base, adapter_path=str(ckpt), output_path=str(merged), dtype="float32")
        return
    # transformers saves Mixtral in its hub layout (block_sparse_moe.experts.N.w1) and GPT-OSS's experts
    # transposed, which the cookbook's shard-by-shard merge does not map; its full-model merge loads
    # them as transformers does.
    build_hf_model(base_model=base, adapter_path=str(ckpt), output_path=str(merged), dtype="float32",
                   merge_strategy="full" if arch in ("mixtral", "gpt_oss") else "auto")
    model = load_model(str(merged), arch)
    np.testing.assert_allclose(logprobs_of_model(model, TOKENS), trained, atol=PARITY)


@pytest.mark.parametrize("arch", ["gemma3", "gpt2", "gpt_neox"])
def test_merged_export_of_an_unembedding_lora_on_a_tied_or_renamed_head(srv, models, arch, tmp_path):
    """The unembedding LoRA the test above leaves out of these families for the cookbook's sake:
    `export --merged` unties a tied head (Gemma3, GPT-2) before merging, so the input embeddings keep
    the base weights as on the server; GPT-NeoX's head is lm_head in transformers 5, embed_out in
    its files."""
    from tinker import types

    base = models[arch]
    with srv.client(KEY) as sc:
        tc = sc.create_lora_training_client(base_model=base, rank=4, seed=4, train_attn=False, train_mlp=False,
                                            train_unembed=True).result()
        tc.forward_backward([sft_datum(TOKENS)], "cross_entropy").result()
        tc.optim_step(types.AdamParams(learning_rate=3e-3)).result()
        trained = logprobs_of(tc.forward([sft_datum(TOKENS)], "cross_entropy").result())[0]
        saved = tc.save_weights_for_sampler("unembed").result().path
    merged = load_model(str(export_checkpoint(saved, tmp_path / "merged", merged=True, data_dir=srv.data_dir)), arch)
    np.testing.assert_allclose(logprobs_of_model(merged, TOKENS), trained, atol=PARITY)
    original = load_model(base, arch)
    assert torch.equal(merged.get_input_embeddings().weight, original.get_input_embeddings().weight)
    assert not torch.equal(merged.get_output_embeddings().weight, original.get_output_embeddings().weight)


def test_the_startup_summary_says_what_a_lora_covers(srv, models):
    log = srv.log(tail=None)
    assert "LoRA       covers: attention q_proj k_proj v_proj o_proj; MLP gate_proj up_proj down_proj; unembed lm_head" in log
    assert "covers: attention o_proj qkv_proj (as q, k, v); MLP gate_up_proj (as gate, up) down_proj; unembed lm_head" in log
    assert "covers: attention c_attn (as q, k, v) c_proj; MLP c_fc c_proj; unembed lm_head" in log
    assert "covers: attention q_proj k_proj v_proj o_proj; MLP experts (w1, w3, w2 per expert); unembed lm_head" in log
    assert ("covers: attention q_a_proj q_b_proj kv_a_proj_with_mqa kv_b_proj o_proj; MLP gate_proj up_proj down_proj "
            "experts (w1, w3, w2 per expert); unembed lm_head") in log  # DeepSeek-V3: shared experts are the MLP's
    assert ("covers: attention out_proj in_proj_qkv (as in_proj_q, in_proj_k, in_proj_v) in_proj_z in_proj_b in_proj_a "
            "q_proj k_proj v_proj o_proj; MLP gate_proj up_proj down_proj; unembed lm_head") in log  # Qwen3.5
    assert ("in_proj_a q_proj k_proj v_proj o_proj; MLP experts (w1, w3, w2 per expert) gate_proj up_proj down_proj "
            "shared_expert_gate; unembed lm_head") in log  # Qwen3.5-MoE: the shared expert and its gate are the MLP's


FUSED = ("phi3", "gpt_neox", "gpt2", "qwen3_5_vl")  # qkv_proj + gate_up_proj; heads interleaved; Conv1D; in_proj_qkv


@pytest.mark.parametrize("arch", FUSED)
def test_a_checkpoint_in_tinkers_layout_for_fused_projections_loads(srv, models, arch, tmp_path):
    """Tinker keeps a fused projection's LoRA as one per component beside the fused module (Qwen3.5's
    linear_attn.in_proj_q/k/v; Phi3's self_attn.q_proj/k_proj/v_proj): such a checkpoint (ours,
    rewritten: tinker_layout.py) loads through load_state_with_optimizer,
    create_training_client_from_state, the sampler and an import (which stores it in our layout), and
    reproduces ours exactly."""
    from tinker import types

    base = models[arch]
    fused = [p for p in discover(load_model(base, arch)) if p.kind == "fused"]
    adam = types.AdamParams(learning_rate=3e-3)
    batch = [sft_datum(TOKENS)]
    with srv.client(KEY) as sc:
        tc = sc.create_lora_training_client(base_model=base, rank=4, seed=2, train_unembed=False).result()
        tc.forward_backward(batch, "cross_entropy").result()
        tc.optim_step(adam).result()
        path = tc.save_state("tinker-layout").result().path
        want = logprobs_of(tc.forward(batch, "cross_entropy").result())[0]
        tc.forward_backward(batch, "cross_entropy").result()
        tc.optim_step(adam).result()
        want_next = logprobs_of(tc.forward(batch, "cross_entropy").result())[0]
        ckpt = checkpoint_dir(srv, path)
        ours = set(load_file(str(ckpt / "adapter_model.safetensors")))
        rewrite_in_tinker_layout(ckpt, fused)

        tc.load_state_with_optimizer(path).result()  # the moments too: the next step is the same step
        np.testing.assert_allclose(logprobs_of(tc.forward(batch, "cross_entropy").result())[0], want, atol=PARITY)
        tc.forward_backward(batch, "cross_entropy").result()
        tc.optim_step(adam).result()
        np.testing.assert_allclose(logprobs_of(tc.forward(batch, "cross_entropy").result())[0], want_next,
                                   atol=PARITY)
        restored = sc.create_training_client_from_state(path).result()
        np.testing.assert_allclose(logprobs_of(restored.forward(batch, "cross_entropy").result())[0], want,
                                   atol=PARITY)
        sampled = sc.create_sampling_client(model_path=path).result().compute_logprobs(
            types.ModelInput.from_ints(TOKENS)).result()
        np.testing.assert_allclose(np.asarray(sampled[1:], dtype=np.float32), want, atol=PARITY)
        # as downloaded from Tinker: the adapter files alone
        files = {n: (ckpt / n).read_bytes() for n in ("adapter_model.safetensors", "adapter_config.json")}
        config = {**json.loads(files["adapter_config.json"]), "base_model_name_or_path": base}
        imported = import_tar(srv, f"tinker-{arch}", {**files, "adapter_config.json": json.dumps(config).encode()})
        assert imported.status_code == 200, imported.text
        # kept in our layout (which vLLM and the merged export read)
        assert set(read_adapter(srv, imported.json()["tinker_path"])) == ours
        from_import = sc.create_training_client_from_state(imported.json()["tinker_path"]).result()
        np.testing.assert_allclose(logprobs_of(from_import.forward(batch, "cross_entropy").result())[0], want,
                                   atol=PARITY)
    if arch == "qwen3_5_vl":  # the layout is the cookbook's: its Qwen3.5 merge of it is the server's model
        from tinker_cookbook.weights import build_hf_model

        build_hf_model(base_model=base, adapter_path=str(ckpt), output_path=str(tmp_path / "merged"), dtype="float32")
        np.testing.assert_allclose(logprobs_of_model(load_model(str(tmp_path / "merged"), arch), TOKENS), want,
                                   atol=PARITY)


def test_a_malformed_tinker_layout_is_refused_naming_the_key(srv, models):
    """A fused projection's components in Tinker's layout must all be there, each of the adapter's rank,
    and not beside a LoRA on the fused module itself: else a 400 names the key."""
    base = models["phi3"]
    fused = [p for p in discover(load_model(base, "phi3")) if p.kind == "fused"]
    with srv.client(KEY) as sc:
        tc = sc.create_lora_training_client(base_model=base, rank=4, seed=3, train_unembed=False).result()
        ckpt = checkpoint_dir(srv, tc.save_weights_for_sampler("malformed").result().path)
    ours = load_file(str(ckpt / "adapter_model.safetensors"))
    split = split_fused(ours, fused, rank=4)
    config = tinker_adapter_config({**json.loads((ckpt / "adapter_config.json").read_text()),
                                    "base_model_name_or_path": base}, split)
    q = "base_model.model.model.layers.1.self_attn.q_proj"
    v_b = "base_model.model.model.layers.0.mlp.up_proj.lora_B.weight"
    cases = {
        f"{q}.lora_A.weight is missing": {k: t for k, t in split.items() if k != f"{q}.lora_A.weight"},
        f"{v_b}: shape [48, 2]": {**split, v_b: split[v_b][:, :2].contiguous()},
        f"{q}.lora_A.weight and base_model.model.model.layers.1.self_attn.qkv_proj.lora_A.weight": {
            **split, **{k: t for k, t in ours.items() if ".layers.1.self_attn.qkv_proj." in k}},
    }
    for i, (needle, tensors) in enumerate(cases.items()):
        weights = safetensors_bytes(tensors)
        r = import_tar(srv, f"malformed-{i}", {"adapter_model.safetensors": weights,
                                               "adapter_config.json": json.dumps(config).encode()})
        assert r.status_code == 400 and needle in r.json()["detail"], (needle, r.status_code, r.text)


def import_tar(srv, name: str, files: dict[str, bytes]):
    with httpx.Client(timeout=120, headers={"X-API-Key": KEY}) as http:
        return http.post(f"{srv.base_url}/api/v1/checkpoints/import", params={"name": name}, content=tar_bytes(files))


def safetensors_bytes(tensors: dict[str, torch.Tensor]) -> bytes:
    from safetensors.torch import save

    return save({k: t.contiguous() for k, t in tensors.items()})


def with_manifest(files: dict[str, bytes], base: str, tmp_path) -> dict[str, bytes]:
    """`files` with the manifest.json of a hosted-tinker checkpoint (rank 4, no unembedding LoRA)
    whose checksums verify: a hostile one need only hash what it lies with."""
    from hosted_tinker.checkpoints.format import describe
    from hosted_tinker.runtime.adapters import LoRAConfig

    folder = tmp_path / f"manifest-{len(list(tmp_path.iterdir()))}"
    folder.mkdir()
    for name, data in files.items():
        (folder / name).write_bytes(data)
    manifest = describe(folder, list(files), base_model=base, config=LoRAConfig(rank=4, seed=3, train_unembed=False),
                        step=1)
    return {**files, "manifest.json": manifest.to_json().encode()}


def test_hostile_imports_of_fused_and_expert_loras_are_400s_naming_what_lies(srv, models, tmp_path):
    """Issue 33, not probed before: checkpoints for a fused-projection model (Phi3) and an MoE model
    (Qwen3-MoE) whose files lie, each imported over HTTP. Before: a fused LoRA without its B was a
    500 (KeyError); integer factors, an adapter_config that contradicts the manifest, and optimizer
    state of no tensor (junk, however large) or of some tensors only were taken and stored; a
    tensor far larger than any LoRA of the model was read whole before it was refused."""
    from safetensors.torch import save

    cases = []
    for arch in ("phi3", "qwen3_moe"):
        with srv.client(KEY) as sc:
            tc = sc.create_lora_training_client(base_model=models[arch], rank=4, seed=3, train_unembed=False).result()
            ckpt = checkpoint_dir(srv, tc.save_weights_for_sampler("hostile").result().path)
        tensors = load_file(str(ckpt / "adapter_model.safetensors"))
        config = {**json.loads((ckpt / "adapter_config.json").read_text()), "base_model_name_or_path": models[arch]}
        cases.append((arch, tensors, config))
    (_, phi3, phi3_config), (_, moe, moe_config) = cases
    qkv = "base_model.model.model.layers.0.self_attn.qkv_proj"
    o_proj = "model.layers.0.self_attn.o_proj.lora_A.weight"
    w1 = "base_model.model.model.layers.0.mlp.experts.w1"
    hostile = [  # (model, tensors, adapter_config, optimizer state or None, what the 400 says)
        ("phi3", {k: v for k, v in phi3.items() if k != f"{qkv}.lora_B.weight"}, phi3_config, None,
         f"{qkv}.lora_B.weight is missing beside its lora_A"),
        ("phi3", {**phi3, f"{qkv}.lora_A.weight": phi3[f"{qkv}.lora_A.weight"].to(torch.int64)}, phi3_config, None,
         f"{qkv}.lora_A.weight is of dtype I64; a LoRA and its optimizer state are floating point"),
        ("phi3", phi3, {**phi3_config, "r": 8}, None, "adapter_config.json says r=8"),
        ("phi3", {**phi3, "base_model.model.junk.lora_A.weight": torch.zeros(16, 1 << 16, dtype=torch.float16)},
         phi3_config, None, "a rank-4 LoRA of the served model holds at most"),
        ("phi3", phi3, phi3_config, {"junk": torch.zeros(1 << 20, dtype=torch.float16)},
         "the AdamW state of a rank-4 LoRA of the served model holds at most"),
        ("phi3", phi3, phi3_config, {"junk": torch.zeros(8)}, "'junk' is not the state of a LoRA tensor"),
        ("phi3", phi3, phi3_config, {f"{o_proj}.exp_avg": torch.zeros(4, 32), f"{o_proj}.exp_avg_sq": torch.zeros(4, 32),
                                     f"{o_proj}.step": torch.ones(1)}, "it holds the state of every LoRA tensor or of none"),
        ("qwen3_moe", {k: v for k, v in moe.items() if k != f"{w1}.lora_B.weight"}, moe_config, None,
         "model.layers.0.mlp.experts.w1: its lora_B.weight is missing beside its lora_A.weight"),
        ("qwen3_moe", {**moe, f"{w1}.lora_A.weight": moe[f"{w1}.lora_A.weight"].repeat(2, 1, 1)}, moe_config, None,
         "model.layers.0.mlp.experts.w1: LoRA shapes [8, 4, 32]"),
    ]
    for i, (arch, tensors, config, optimizer, needle) in enumerate(hostile):
        files = {"adapter_model.safetensors": safetensors_bytes(tensors), "adapter_config.json": json.dumps(config).encode()}
        if optimizer is not None:
            files["optimizer.safetensors"] = save(optimizer)
        r = import_tar(srv, f"hostile-{i}", with_manifest(files, models[arch], tmp_path))
        assert r.status_code == 400 and needle in r.json()["detail"], (i, needle, r.status_code, r.text)
