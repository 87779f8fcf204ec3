"""The embedded tiny Qwen3 model: deterministic, loadable like a real checkpoint, and shaped
the way the server and the cookbook's Qwen3 renderers expect (special tokens, template, vocab).
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from hosted_tinker.models.embedded import (
    ADDED_NON_SPECIAL_TOKENS,
    SPECIAL_TOKENS,
    TinyModelSpec,
    build_tiny_model,
    ensure_embedded_model,
)

LORA_TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj",
                "lm_head"]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> Path:
    return ensure_embedded_model(tmp_path_factory.mktemp("cache"))


@pytest.fixture(scope="module")
def tokenizer(model_dir):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(model_dir)


@pytest.fixture(scope="module")
def model(model_dir):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(model_dir)


def _digests(d: Path) -> dict[str, str]:
    return {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in sorted(d.iterdir())}


def test_build_is_deterministic(model_dir, tmp_path):
    torch.manual_seed(999)  # a different global RNG state must not matter
    again = build_tiny_model(tmp_path / "again")
    assert _digests(again) == _digests(model_dir)
    assert set(_digests(model_dir)) == {
        "config.json", "generation_config.json", "model.safetensors", "tokenizer.json",
        "tokenizer_config.json",
    }


def test_tokenizer_is_deterministic_across_processes(model_dir):
    # The BPE trainer runs in Rust with per-process randomly seeded hash maps, so the
    # comparison that matters is with another process (only `tokenizers` is imported there).
    code = ("import sys; from hosted_tinker.models.embedded import build_tokenizer; "
            "sys.stdout.write(build_tokenizer().to_str(pretty=True))")
    for _ in range(2):
        out = subprocess.run([sys.executable, "-c", code], check=True, capture_output=True,
                             text=True, timeout=300).stdout
        assert json.loads(out) == json.loads((model_dir / "tokenizer.json").read_text())


def test_seed_changes_weights_but_not_tokenizer(model_dir, tmp_path):
    other = build_tiny_model(tmp_path / "s1", TinyModelSpec(seed=1))
    a, b = _digests(model_dir), _digests(other)
    assert a["model.safetensors"] != b["model.safetensors"]
    assert a["tokenizer.json"] == b["tokenizer.json"]


def test_build_leaves_global_rng_alone(tmp_path):
    torch.manual_seed(123)
    expected = torch.rand(3)
    torch.manual_seed(123)
    build_tiny_model(tmp_path / "m")
    assert torch.equal(torch.rand(3), expected)


def test_ensure_is_cached_and_atomic(model_dir):
    cache_root = model_dir.parent
    mtime = (model_dir / "model.safetensors").stat().st_mtime_ns
    assert ensure_embedded_model(cache_root) == model_dir
    assert (model_dir / "model.safetensors").stat().st_mtime_ns == mtime
    assert [p.name for p in cache_root.iterdir()] == [model_dir.name]  # no temp dirs left


def test_spec_variants_get_their_own_directory_and_shape(tmp_path):
    spec = TinyModelSpec(hidden_size=96, num_layers=3, num_heads=6, num_kv_heads=3,
                         head_dim=16, intermediate_size=160)
    d = ensure_embedded_model(tmp_path, spec)
    assert d.name == spec.dir_name() != TinyModelSpec().dir_name()
    cfg = json.loads((d / "config.json").read_text())
    assert (cfg["hidden_size"], cfg["num_hidden_layers"], cfg["num_attention_heads"],
            cfg["num_key_value_heads"], cfg["intermediate_size"]) == (96, 3, 6, 3, 160)


def test_config_is_qwen3_with_legacy_rope_keys(model_dir):
    cfg = json.loads((model_dir / "config.json").read_text())
    assert cfg["model_type"] == "qwen3" and cfg["architectures"] == ["Qwen3ForCausalLM"]
    # Readers pinned to transformers 4.x (vLLM builds) only understand rope_theta.
    assert cfg["rope_theta"] == 1_000_000.0 and "rope_parameters" not in cfg
    assert cfg["torch_dtype"] == "float32"


def test_loads_like_a_real_checkpoint(model, tokenizer):
    assert type(model).__name__ == "Qwen3ForCausalLM"
    assert model.dtype == torch.float32
    assert model.config.rope_parameters["rope_theta"] == 1_000_000.0
    assert type(tokenizer).__name__ == "Qwen2Tokenizer"
    assert tokenizer.is_fast


def test_special_tokens(tokenizer, model):
    vocab = tokenizer.get_vocab()
    ids = {t: vocab[t] for t in (*SPECIAL_TOKENS, *ADDED_NON_SPECIAL_TOKENS)}
    # Like Qwen's: right after the BPE vocabulary, in Qwen's order, contiguous.
    assert sorted(ids.values()) == list(range(min(ids.values()), min(ids.values()) + 9))
    assert ids["<|endoftext|>"] < ids["<|im_start|>"] < ids["<|im_end|>"]

    added = tokenizer.added_tokens_decoder
    for t in SPECIAL_TOKENS:
        assert added[ids[t]].special, t
    for t in ADDED_NON_SPECIAL_TOKENS:
        assert not added[ids[t]].special, t

    assert tokenizer.eos_token == "<|im_end|>" and tokenizer.eos_token_id == ids["<|im_end|>"]
    assert tokenizer.pad_token == "<|endoftext|>"
    assert tokenizer.bos_token is None
    assert model.config.eos_token_id == ids["<|im_end|>"]
    assert model.config.pad_token_id == ids["<|endoftext|>"]
    assert model.generation_config.eos_token_id == [ids["<|im_end|>"], ids["<|endoftext|>"]]

    # Every one of them is a single token even inside text...
    text = "a<|im_start|>b<|im_end|>c<think>d</think>e<tool_call>f</tool_call>"
    toks = tokenizer.encode(text, add_special_tokens=False)
    for t in ("<|im_start|>", "<|im_end|>", "<think>", "</think>", "<tool_call>"):
        assert toks.count(ids[t]) == 1
    # ...no BOS/EOS is added, and skipping specials keeps the non-special <think> markup.
    assert tokenizer.encode("hi") == tokenizer.encode("hi", add_special_tokens=False)
    assert tokenizer.decode(toks, skip_special_tokens=True) == \
        "abc<think>d</think>e<tool_call>f</tool_call>"


def test_text_round_trips_and_english_is_compact(tokenizer):
    for text in ["Hello, world!\n\n  indented\tcode()", "naïve café – 東京 🎉", "12345 + 678"]:
        assert tokenizer.decode(tokenizer.encode(text)) == text
    sentence = "The assistant explains the answer to the question carefully."
    assert len(tokenizer.encode(sentence)) <= 16  # a trained BPE, not bytes


def test_vocab_covers_tokenizer(tokenizer, model):
    n = model.config.vocab_size
    assert n % 64 == 0 and n >= len(tokenizer)
    assert max(tokenizer.get_vocab().values()) < n
    assert model.get_input_embeddings().weight.shape[0] == n
    assert model.get_output_embeddings().weight.shape[0] == n


def test_chat_template_renders_qwen3_chatml(tokenizer):
    messages = [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "Hi"},
        {"role": "assistant", "content": "Hello!"},
        {"role": "user", "content": "Bye"},
    ]
    text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    assert text == (
        "<|im_start|>system\nBe brief.<|im_end|>\n"
        "<|im_start|>user\nHi<|im_end|>\n"
        "<|im_start|>assistant\nHello!<|im_end|>\n"
        "<|im_start|>user\nBye<|im_end|>\n"
        "<|im_start|>assistant\n"
    )
    no_think = tokenizer.apply_chat_template(messages, tokenize=False,
                                             add_generation_prompt=True, enable_thinking=False)
    assert no_think == text + "<think>\n\n</think>\n\n"
    # The assistant turn being produced (after the last user message) is framed with <think>.
    done = tokenizer.apply_chat_template(messages + [{"role": "assistant", "content": "Bye!"}],
                                         tokenize=False)
    assert done.endswith("<|im_start|>assistant\n<think>\n\n</think>\n\nBye!<|im_end|>\n")


def test_flavors(tmp_path):
    from transformers import AutoTokenizer

    base = AutoTokenizer.from_pretrained(
        build_tiny_model(tmp_path / "base", TinyModelSpec(flavor="qwen3_base")))
    assert base.eos_token == "<|endoftext|>"
    instruct = AutoTokenizer.from_pretrained(
        build_tiny_model(tmp_path / "instruct", TinyModelSpec(flavor="qwen3_instruct")))
    messages = [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Yo"}]
    assert instruct.apply_chat_template(messages, tokenize=False) == (
        "<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\nYo<|im_end|>\n")


def test_forward_and_backward(model, tokenizer):
    ids = torch.tensor([tokenizer.encode("The quick brown fox jumps over the lazy dog.")])
    out = model(input_ids=ids, labels=ids)
    assert out.logits.shape == (1, ids.shape[1], model.config.vocab_size)
    assert torch.isfinite(out.logits).all()
    # A random init predicts ~uniformly: loss close to ln(vocab_size).
    assert abs(out.loss.item() - torch.log(torch.tensor(float(model.config.vocab_size)))) < 0.5
    out.loss.backward()
    model.zero_grad(set_to_none=True)


def test_peft_lora_attaches_to_all_projections(model_dir, tokenizer):
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    base = AutoModelForCausalLM.from_pretrained(model_dir)
    peft_model = get_peft_model(base, LoraConfig(r=8, lora_alpha=16, target_modules=LORA_TARGETS))
    wrapped = {name.rsplit(".", 1)[-1] for name, mod in peft_model.named_modules()
               if hasattr(mod, "lora_A")}
    assert wrapped == set(LORA_TARGETS)
    trainable = [n for n, p in peft_model.named_parameters() if p.requires_grad]
    assert trainable and all("lora_" in n for n in trainable)
    ids = torch.tensor([tokenizer.encode("Hello there, how are you?")])
    peft_model(input_ids=ids, labels=ids).loss.backward()
    assert any(p.grad is not None and p.grad.abs().sum() > 0
               for n, p in peft_model.named_parameters() if "lora_B" in n)


def test_spec_validation():
    with pytest.raises(ValueError):
        TinyModelSpec(num_heads=4, num_kv_heads=3)
    with pytest.raises(ValueError):
        dataclasses.replace(TinyModelSpec(), flavor="llama")
