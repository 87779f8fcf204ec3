"""A tiny random Qwen3-VL or Qwen3.5 model directory built offline: the embedded model's tokenizer
plus Qwen-VL's vision tokens, a 2-layer text model, a 2-block vision tower and a Qwen2-VL image
processor whose 16-pixel patches merge 2x2 into one token (a 64x32 image is 2 tokens)."""

from __future__ import annotations

import io
from pathlib import Path

import numpy as np

VISION_TOKENS = ("<|vision_start|>", "<|vision_end|>", "<|image_pad|>", "<|video_pad|>")

# Qwen3-VL's chat template, less tools and video: a content list renders each image part as the
# image placeholder (which the server replaces with the image's own tokens) and text parts as text.
CHAT_TEMPLATE = (
    "{%- for message in messages %}"
    "{{- '<|im_start|>' + message.role + '\\n' }}"
    "{%- if message.content is string %}{{- message.content }}"
    "{%- else %}{%- for part in message.content %}"
    "{%- if part.type == 'image' or 'image' in part or 'image_url' in part %}"
    "{{- '<|vision_start|><|image_pad|><|vision_end|>' }}"
    "{%- elif 'text' in part %}{{- part.text }}{%- endif %}"
    "{%- endfor %}{%- endif %}"
    "{{- '<|im_end|>\\n' }}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}")


def qwen3_vl_config(vocab: int, eot: int, ids: dict[str, int]):
    from transformers import Qwen3VLConfig

    return Qwen3VLConfig(
        text_config=dict(vocab_size=vocab, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, head_dim=8, max_position_embeddings=512,
                         rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "mrope_section": [1, 1, 2],
                                          "mrope_interleaved": True},
                         tie_word_embeddings=False, bos_token_id=eot, eos_token_id=eot, pad_token_id=eot),
        vision_config=dict(depth=2, hidden_size=32, intermediate_size=64, num_heads=4, patch_size=16,
                           spatial_merge_size=2, temporal_patch_size=2, out_hidden_size=32,
                           num_position_embeddings=64, deepstack_visual_indexes=[0]),
        **_vision_token_ids(ids), tie_word_embeddings=False, dtype="float32")


def qwen3_5_config(vocab: int, eot: int, ids: dict[str, int]):
    """Qwen3.5: a linear-attention (Gated DeltaNet) layer, then a full-attention one, with partial
    rotary (half of the 16-dim heads) on Qwen-VL's 3-D positions."""
    from transformers import Qwen3_5Config

    return Qwen3_5Config(
        text_config=dict(vocab_size=vocab, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                         layer_types=["linear_attention", "full_attention"], num_attention_heads=4,
                         num_key_value_heads=2, head_dim=16, linear_key_head_dim=8, linear_value_head_dim=8,
                         linear_num_key_heads=2, linear_num_value_heads=4, max_position_embeddings=512,
                         rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "mrope_section": [1, 1, 2],
                                          "mrope_interleaved": True, "partial_rotary_factor": 0.5},
                         tie_word_embeddings=False, bos_token_id=eot, eos_token_id=eot, pad_token_id=eot),
        vision_config=dict(depth=2, hidden_size=32, intermediate_size=64, num_heads=4, patch_size=16,
                           spatial_merge_size=2, temporal_patch_size=2, out_hidden_size=32, num_position_embeddings=64),
        **_vision_token_ids(ids), tie_word_embeddings=False, dtype="float32")


def qwen3_5_moe_config(vocab: int, eot: int, ids: dict[str, int]):
    """Qwen3.5-MoE (Qwen3.5-35B-A3B, -397B-A17B): Qwen3.5's layers with a mixture of 4 experts
    (2 per token) beside a gated shared expert in place of the dense MLP."""
    from transformers import Qwen3_5MoeConfig

    text = qwen3_5_config(vocab, eot, ids).text_config.to_dict()
    text = {k: text[k] for k in ("vocab_size", "hidden_size", "num_hidden_layers", "layer_types",
                                 "num_attention_heads", "num_key_value_heads", "head_dim", "linear_key_head_dim",
                                 "linear_value_head_dim", "linear_num_key_heads", "linear_num_value_heads",
                                 "max_position_embeddings", "rope_parameters", "tie_word_embeddings",
                                 "bos_token_id", "eos_token_id", "pad_token_id")}
    return Qwen3_5MoeConfig(
        text_config=dict(text, moe_intermediate_size=16, shared_expert_intermediate_size=16, num_experts=4,
                         num_experts_per_tok=2),
        vision_config=dict(depth=2, hidden_size=32, intermediate_size=64, num_heads=4, patch_size=16,
                           spatial_merge_size=2, temporal_patch_size=2, out_hidden_size=32, num_position_embeddings=64),
        **_vision_token_ids(ids), tie_word_embeddings=False, dtype="float32")


def _vision_token_ids(ids: dict[str, int]) -> dict[str, int]:
    return dict(image_token_id=ids["<|image_pad|>"], video_token_id=ids["<|video_pad|>"],
                vision_start_token_id=ids["<|vision_start|>"], vision_end_token_id=ids["<|vision_end|>"])


CONFIGS = {"qwen3_vl": qwen3_vl_config, "qwen3_5": qwen3_5_config, "qwen3_5_moe": qwen3_5_moe_config}


def build_tiny_vl_model(out_dir: Path, seed: int = 0, family: str = "qwen3_vl", max_pixels: int = 128 * 128) -> Path:
    """`max_pixels`: the processor resizes larger images down to about this many pixels."""
    import torch
    import transformers
    from tokenizers import AddedToken
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

    from hosted_tinker.models.embedded import ENDOFTEXT, TinyModelSpec, _tokenizer_config, _write_json, build_tokenizer

    out_dir.mkdir(parents=True, exist_ok=True)
    spec = TinyModelSpec()
    tok = build_tokenizer(spec)
    tok.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in VISION_TOKENS])
    tok.save(str(out_dir / "tokenizer.json"))
    ids = {t: tok.token_to_id(t) for t in VISION_TOKENS}
    tok_config = _tokenizer_config(tok, spec)
    # transformers builds the tokenizer's added tokens from this list: without them AutoTokenizer
    # splits "<|image_pad|>" into pieces, and the chat route could not find the image placeholder
    tok_config["added_tokens_decoder"].update({str(i): {
        "content": t, "lstrip": False, "normalized": False, "rstrip": False, "single_word": False, "special": True}
        for t, i in ids.items()})
    tok_config["chat_template"] = CHAT_TEMPLATE
    _write_json(out_dir / "tokenizer_config.json", tok_config)
    eot = tok.token_to_id(ENDOFTEXT)
    vocab = -(-tok.get_vocab_size(with_added_tokens=True) // 64) * 64
    config = CONFIGS[family](vocab, eot, ids)
    rng = torch.random.get_rng_state()
    try:
        torch.manual_seed(seed)
        model_class = getattr(transformers, type(config).__name__.replace("Config", "ForConditionalGeneration"))
        model = model_class(config).float().eval()
    finally:
        torch.random.set_rng_state(rng)
    model.save_pretrained(out_dir)
    Qwen2VLImageProcessorPil(patch_size=16, merge_size=2, temporal_patch_size=2, min_pixels=32 * 32,
                             max_pixels=max_pixels, image_mean=[0.5] * 3, image_std=[0.5] * 3).save_pretrained(out_dir)
    return out_dir


def png(width: int, height: int, seed: int = 0, fmt: str = "PNG") -> bytes:
    from PIL import Image

    pixels = np.random.default_rng(seed).integers(0, 256, (height, width, 3), dtype=np.uint8)
    out = io.BytesIO()
    Image.fromarray(pixels).save(out, format=fmt)
    return out.getvalue()
