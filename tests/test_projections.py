"""Discovery of LoRA targets by role (issue 23, part 1), without a server: what each family's LoRA
covers, that wrapping (Conv1D as Linear, fused projections as components) keeps the model's bits,
the PEFT form of fused LoRAs and its inverse, and the refusals (experts, vLLM layouts)."""

from __future__ import annotations

import pytest
import torch
import transformers as T

from hosted_tinker.checkpoints.format import (
    CheckpointError, from_peft, from_tinker_layout, tinker_component_path, to_peft,
)
from hosted_tinker.runtime.lora_plan import LoRARouting
from hosted_tinker.runtime.multi_lora import attach_multi_lora
from hosted_tinker.runtime.projections import coverage, discover, refusal
from hosted_tinker.sampling.vllm_adapters import layout_refusal

SMALL = dict(vocab_size=64, hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=4)
CONFIGS = {
    "qwen3": (T.Qwen3Config(head_dim=8, num_key_value_heads=2, **SMALL),
              "attention q_proj k_proj v_proj o_proj; MLP gate_proj up_proj down_proj; unembed lm_head"),
    "phi3": (T.Phi3Config(num_key_value_heads=2, pad_token_id=0, **SMALL),
             "attention o_proj qkv_proj (as q, k, v); MLP gate_up_proj (as gate, up) down_proj; unembed lm_head"),
    "phi": (T.PhiConfig(**SMALL), "attention q_proj k_proj v_proj dense; MLP fc1 fc2; unembed lm_head"),
    "gpt_neox": (T.GPTNeoXConfig(**SMALL),
                 "attention query_key_value (as q, k, v) dense; MLP dense_h_to_4h dense_4h_to_h; unembed lm_head"),
    "gpt2": (T.GPT2Config(vocab_size=64, n_embd=32, n_layer=2, n_head=4, n_positions=64),
             "attention c_attn (as q, k, v) c_proj; MLP c_fc c_proj; unembed lm_head"),
    # Linear attention first (its layers are found though layer 0 has no softmax attention), the
    # depthwise conv1d is no projection.
    "qwen3_5": (T.Qwen3_5TextConfig(head_dim=8, num_key_value_heads=2, layer_types=["linear_attention", "full_attention"],
                                    linear_key_head_dim=8, linear_value_head_dim=8, linear_num_key_heads=2,
                                    linear_num_value_heads=4, **SMALL),
                "attention out_proj in_proj_qkv (as in_proj_q, in_proj_k, in_proj_v) in_proj_z in_proj_b in_proj_a "
                "q_proj k_proj v_proj o_proj; MLP gate_proj up_proj down_proj; unembed lm_head"),
    # Qwen3.5-MoE's text model: the same attention, routed experts beside a gated shared expert.
    "qwen3_5_moe": (T.Qwen3_5MoeTextConfig(head_dim=8, num_key_value_heads=2,
                                           layer_types=["linear_attention", "full_attention"], linear_key_head_dim=8,
                                           linear_value_head_dim=8, linear_num_key_heads=2, linear_num_value_heads=4,
                                           moe_intermediate_size=16, shared_expert_intermediate_size=16, num_experts=4,
                                           num_experts_per_tok=2, **SMALL),
                    "attention out_proj in_proj_qkv (as in_proj_q, in_proj_k, in_proj_v) in_proj_z in_proj_b "
                    "in_proj_a q_proj k_proj v_proj o_proj; MLP experts (w1, w3, w2 per expert) gate_proj up_proj "
                    "down_proj shared_expert_gate; unembed lm_head"),
}


def model_of(config):
    torch.manual_seed(0)
    return T.AutoModelForCausalLM.from_config(config).eval()


@pytest.mark.parametrize("arch", list(CONFIGS))
def test_a_lora_covers_every_projection_and_wrapping_keeps_the_bits(arch):
    config, covers = CONFIGS[arch]
    model = model_of(config)
    ids = torch.randint(0, 64, (2, 7), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        want = model(ids).logits
    projections = discover(model)
    assert coverage(projections) == covers
    layers = attach_multi_lora(model, LoRARouting(None), projections)
    with torch.no_grad():
        assert torch.equal(model(ids).logits, want)
    fused = [p for p in projections if p.kind == "fused"]
    plain = [p for p in projections if p.kind != "experts"]  # experts are moe_lora.py's to wrap
    assert len(layers) == len(plain) + sum(len(p.components) - 1 for p in fused)


@pytest.mark.parametrize("arch", ["phi3", "gpt_neox"])
def test_fused_loras_go_to_peft_form_and_back(arch):
    model = model_of(CONFIGS[arch][0])
    layers = attach_multi_lora(model, LoRARouting(None), discover(model))
    rank, gen = 2, torch.Generator().manual_seed(3)
    tensors = {}
    for path, layer in layers.items():
        tensors[f"{path}.lora_A.weight"] = torch.randn(rank, layer.in_features, generator=gen)
        tensors[f"{path}.lora_B.weight"] = torch.randn(layer.out_features, rank, generator=gen)
    parts = {p: layer.part for p, layer in layers.items() if layer.part is not None}
    peft, counts = to_peft(tensors, parts)
    assert counts and all(k in (2, 3) for k in counts.values())
    assert not any(k.rsplit(".lora_", 1)[0] in parts for k in peft)  # only the fused modules' names
    back = from_peft(peft, layers, rank)
    assert back.keys() == tensors.keys() and all(torch.equal(back[k], tensors[k]) for k in tensors)
    # The merged delta of the PEFT form is each component's delta, in its own rows.
    fused_path, k = next(iter(counts.items()))
    delta = peft[f"{fused_path}.lora_B.weight"] @ peft[f"{fused_path}.lora_A.weight"]
    for path, part in parts.items():
        if part.path == fused_path:
            own = tensors[f"{path}.lora_B.weight"] @ tensors[f"{path}.lora_A.weight"]
            torch.testing.assert_close(delta[list(part.rows)], own)
    coupled = dict(peft)
    coupled[f"{fused_path}.lora_B.weight"] = torch.ones_like(peft[f"{fused_path}.lora_B.weight"])
    with pytest.raises(CheckpointError, match="not block-diagonal"):
        from_peft(coupled, layers, rank)
    with pytest.raises(CheckpointError, match=f"{fused_path}: a LoRA of shapes"):
        from_peft(peft, layers, rank + 1)


@pytest.mark.parametrize("arch", ["phi3", "gpt_neox", "gpt2", "qwen3_5"])
def test_fused_loras_in_tinkers_layout_read_back(arch):
    """Tinker keeps each component's LoRA beside the fused module (in_proj_qkv's as in_proj_q/k/v)."""
    model = model_of(CONFIGS[arch][0])
    layers = attach_multi_lora(model, LoRARouting(None), discover(model))
    rank, gen = 2, torch.Generator().manual_seed(4)
    ours = {f"{path}.lora_{ab}.weight": torch.randn(shape, generator=gen) for path, layer in layers.items()
            for ab, shape in (("A", (rank, layer.in_features)), ("B", (layer.out_features, rank)))}
    tinker = {(f"{tinker_component_path(k.split('.lora_')[0])}.lora_{k.split('.lora_')[1]}"
               if layers[k.split(".lora_")[0]].part else k): t for k, t in ours.items()}
    assert tinker.keys() != ours.keys()
    back = from_tinker_layout(tinker, layers, rank)
    assert back.keys() == ours.keys() and all(torch.equal(back[k], ours[k]) for k in ours)
    assert from_tinker_layout(ours, layers, rank) == ours  # nothing in Tinker's layout: as it was


def test_moe_experts_are_mlp_and_those_moe_lora_cannot_adapt_are_refused_by_name():
    model = model_of(T.Qwen3MoeConfig(head_dim=8, num_key_value_heads=2, moe_intermediate_size=16, num_experts=4,
                                      num_experts_per_tok=2, **SMALL))
    experts = [p for p in discover(model) if p.kind == "experts"]
    assert [p.role for p in experts] == ["mlp", "mlp"]  # train_mlp covers them (runtime/moe_lora.py)
    assert refusal(discover(model), {"attn": True, "mlp": True, "unembed": True}) is None
    model.model.layers[0].mlp.experts.has_post_expert_norm = True  # a kind moe_lora.py does not adapt
    projections = discover(model)
    why = refusal(projections, {"attn": True, "mlp": True, "unembed": True})
    assert why is not None and "model.layers.0.mlp.experts (" in why and "post-expert norm" in why
    assert refusal(projections, {"attn": True, "mlp": False, "unembed": True}) is None


def test_a_model_whose_decoder_layers_are_not_found_has_its_projections_refused_not_left_out():
    class Mixer(torch.nn.Module):  # a token mixer of a kind discovery does not know
        def __init__(self, proj):
            super().__init__()
            self.proj = proj

    model = model_of(CONFIGS["qwen3"][0])
    for layer in model.model.layers:
        layer.mixer = Mixer(layer.self_attn.q_proj)
        del layer.self_attn
    why = refusal(discover(model), {"attn": True, "mlp": False, "unembed": False})
    assert why is not None and why.startswith("model.layers.0.mlp.gate_proj cannot be adapted: no decoder layers")
    assert "(and 7 more like it)" in why  # the MLPs and the mixers of both layers
    assert refusal(discover(model), {"attn": False, "mlp": False, "unembed": True}) is None


def test_vllm_gets_only_the_layouts_it_is_launched_for():
    assert layout_refusal(discover(model_of(CONFIGS["qwen3"][0]))) is None
    assert layout_refusal(discover(model_of(CONFIGS["phi3"][0]))) is None  # tests/test_vllm_fused.py
    assert "query_key_value is a fused projection" in layout_refusal(discover(model_of(CONFIGS["gpt_neox"][0])))
    assert "dense is not among the modules vLLM" in layout_refusal(discover(model_of(CONFIGS["phi"][0])))
    assert "c_attn is a fused projection" in layout_refusal(discover(model_of(CONFIGS["gpt2"][0])))
