"""The model bodies the training benchmarks run on (multi_tenant.py, profile_step.py), built locally:
no download. Dense bodies are Qwen3s of the embedded model's family; MoE bodies are Qwen3-MoEs
(transformers' fused 3-D experts); all use the embedded model's 1k vocabulary.

Sizes: tiny (the embedded model, hidden 64 x 2 layers), small (hidden 256 x 4), medium (hidden
512 x 8), 1b (hidden 2048 x 28: a Qwen3-1.7B-shaped body, 1.4B parameters, initialised in memory),
moe (a Qwen3-MoE of hidden 256 x 4, 8 experts of 256, top-2), a3b (Qwen3-30B-A3B's layer shapes --
hidden 2048, GQA 32/4, head_dim 128, 128 experts of 768, top-8 -- cut to 4 layers: 2.5B parameters)
and tiny-moe (hidden 64 x 2, 4 experts of 32, top-2: the profile's CPU preset).
"""

from __future__ import annotations

from pathlib import Path

import torch

from hosted_tinker.models.embedded import SPEC_PRESETS, TinyModelSpec, build_tiny_model

SIZES: dict[str, TinyModelSpec] = {
    "tiny": SPEC_PRESETS["tiny"],
    "small": SPEC_PRESETS["small"],
    "medium": SPEC_PRESETS["medium"],
    # Qwen3-1.7B's body (28 x 2048, GQA 16/8, head_dim 128, MLP 6144), the embedded vocabulary.
    "1b": TinyModelSpec(hidden_size=2048, num_layers=28, num_heads=16, num_kv_heads=8, head_dim=128,
                        intermediate_size=6144),
}
# Qwen3-MoE bodies (transformers' fused 3-D experts): the tenants' LoRA covers every expert's w1, w3
# and w2 too (runtime/moe_lora.py); the ideal's PEFT adapter covers them as `target_parameters`.
MOE = {
    "moe": dict(hidden_size=256, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2,
                head_dim=64, intermediate_size=512, moe_intermediate_size=256, num_experts=8,
                num_experts_per_tok=2),
    # Qwen3-30B-A3B's config.json, 48 layers cut to 4 (the expert count and sizes are its own).
    "a3b": dict(hidden_size=2048, num_hidden_layers=4, num_attention_heads=32, num_key_value_heads=4,
                head_dim=128, intermediate_size=6144, moe_intermediate_size=768, num_experts=128,
                num_experts_per_tok=8, norm_topk_prob=True),
    "tiny-moe": dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                     head_dim=16, intermediate_size=128, moe_intermediate_size=32, num_experts=4,
                     num_experts_per_tok=2),
}
LABELS = {"tiny": "tiny 64x2", "small": "256x4", "medium": "512x8", "1b": "2048x28 (1.4B)",
          "moe": "MoE 256x4 8e", "a3b": "30B-A3B 4L 128e", "tiny-moe": "MoE 64x2 4e"}
# Bodies too big to write to disk and read back: initialised in memory on the device.
IN_MEMORY = {"1b", "a3b"}


def _quiet_transformers() -> None:
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()
    hf_logging.set_verbosity_error()


def _config(size: str, tmp: Path):
    """The transformers config of `size`: the embedded model's, resized."""
    from transformers import AutoConfig, Qwen3MoeConfig

    config = AutoConfig.from_pretrained(build_tiny_model(tmp / "tiny-for-config", SIZES["tiny"]))
    if size in MOE:
        return Qwen3MoeConfig(vocab_size=config.vocab_size, **MOE[size])
    spec = SIZES[size]
    for k, v in dict(hidden_size=spec.hidden_size, intermediate_size=spec.intermediate_size,
                     num_hidden_layers=spec.num_layers, num_attention_heads=spec.num_heads,
                     num_key_value_heads=spec.num_kv_heads, head_dim=spec.head_dim,
                     max_window_layers=spec.num_layers).items():
        setattr(config, k, v)
    # One attention type per layer: the tiny config's list has its own 2 layers' entries.
    config.layer_types = [config.layer_types[0]] * spec.num_layers
    return config


def build_models(size: str, tmp: Path, device: torch.device, dtype: torch.dtype, copies: int = 1) -> list:
    """`copies` identical models of `size` on `device` in `dtype` (eval mode is the runtime's).
    Small dense bodies go through the server's loading path (saved, then from_pretrained)."""
    from transformers import AutoModelForCausalLM

    _quiet_transformers()
    if size not in MOE and size not in IN_MEMORY:
        src = build_tiny_model(tmp / size, SIZES[size])
        return [AutoModelForCausalLM.from_pretrained(src, dtype=dtype).to(device) for _ in range(copies)]
    config = _config(size, tmp)
    models = []
    for _ in range(copies):
        torch.manual_seed(0)
        with torch.device(device):
            models.append(AutoModelForCausalLM.from_config(config, dtype=dtype))
    for m in models[1:]:
        m.load_state_dict(models[0].state_dict())
    return models
