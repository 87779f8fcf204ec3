"""Tiny random models of the families the server takes (transformers' own classes): their configs,
the models themselves (the sampler decodes them in process, test_sampling_families.py), and the
same saved as a checkpoint folder with the embedded model's tokenizer, for the test modules that
start servers on them."""

from __future__ import annotations

import shutil
from pathlib import Path

import torch
import transformers as T

SMALL = dict(hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=4)


def configs(vocab: int) -> dict[str, T.PretrainedConfig]:
    kv = dict(num_key_value_heads=2)
    return {
        "qwen3": T.Qwen3Config(vocab_size=vocab, head_dim=8, **kv, **SMALL),
        "llama": T.LlamaConfig(vocab_size=vocab, **kv, **SMALL),
        "gemma3": T.Gemma3TextConfig(vocab_size=vocab, head_dim=8, **kv, **SMALL),
        "phi3": T.Phi3Config(vocab_size=vocab, pad_token_id=0, **kv, **SMALL),
        "phi": T.PhiConfig(vocab_size=vocab, **SMALL),
        "gpt_neox": T.GPTNeoXConfig(vocab_size=vocab, **SMALL),
        "gpt2": T.GPT2Config(vocab_size=vocab, n_embd=32, n_layer=2, n_head=4, n_positions=64),
        # An MoE model: LoRA on its experts too (per-expert w1, w2, w3).
        "qwen3_moe": T.Qwen3MoeConfig(vocab_size=vocab, head_dim=8, moe_intermediate_size=16, num_experts=4,
                                      num_experts_per_tok=2, **kv, **SMALL),
        "mixtral": T.MixtralConfig(vocab_size=vocab, num_local_experts=4, num_experts_per_tok=2, **kv, **SMALL),
        # GPT-OSS: transposed experts with biases, gate/up interleaved, attention sinks, sliding layers.
        "gpt_oss": T.GptOssConfig(vocab_size=vocab, head_dim=8, num_local_experts=4, num_experts_per_tok=2,
                                  **kv, **SMALL),
        # DeepSeek-V3: MLA attention (q_a/q_b, kv_a_proj_with_mqa/kv_b), a dense first layer, then
        # routed experts beside a shared expert.
        "deepseek_v3": T.DeepseekV3Config(vocab_size=vocab, moe_intermediate_size=16, n_routed_experts=4,
                                          num_experts_per_tok=2, n_shared_experts=1, first_k_dense_replace=1,
                                          n_group=1, topk_group=1, q_lora_rank=16, kv_lora_rank=16,
                                          qk_rope_head_dim=4, qk_nope_head_dim=4, v_head_dim=8,
                                          num_key_value_heads=4, **SMALL),
    }


def family_model(name: str, config: T.PretrainedConfig) -> torch.nn.Module:
    """A random model of family `name` with `config` (weights fixed by the seed, fp32)."""
    torch.manual_seed(0)
    model = (T.Gemma3ForCausalLM if name == "gemma3" else T.AutoModelForCausalLM.from_config)(config)
    with torch.no_grad():  # transformers may leave 3-D expert weights uninitialised
        for p in model.parameters():
            if p.dim() == 3:
                p.normal_(0, 0.1)
    return model.to(torch.float32)


def save_family_model(root: Path, name: str, config: T.PretrainedConfig, tokenizer_dir: Path) -> str:
    """`family_model` saved under root/name with the tokenizer files of `tokenizer_dir`; its path."""
    out = root / name
    family_model(name, config).save_pretrained(out)
    for f in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(tokenizer_dir / f, out / f)
    return str(out)
