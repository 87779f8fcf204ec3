"""A tiny Qwen3-architecture model + tokenizer, built offline and deterministically.

Why this exists: development and CI machines cannot download weights or tokenizers from the
Hugging Face hub, and no package ships a pretrained causal LM. Yet the server must be
exercised through the *same* loading path it uses for a real model
(``AutoModelForCausalLM.from_pretrained(dir)`` / ``AutoTokenizer.from_pretrained(dir)``),
and the Tinker cookbook's Qwen3 renderers must work against its tokenizer. So we build a
model directory in Hugging Face layout from code:

* ``config.json`` / ``model.safetensors`` / ``generation_config.json``: a randomly
  initialised ``Qwen3ForCausalLM`` (float32), weights fixed by ``TinyModelSpec.seed`` (the
  same bytes on every build with the same torch version).
* ``tokenizer.json`` / ``tokenizer_config.json``: a byte-level BPE (~1k tokens) trained on a
  small corpus embedded in this module, with Qwen2/Qwen3's pre-tokenizer and special tokens
  (``<|endoftext|>``, ``<|im_start|>``, ``<|im_end|>``; ``<think>``... as non-special added
  tokens) and Qwen3's ChatML chat template, ``tokenizer_class = "Qwen2Tokenizer"``.

The server's default base model is :data:`EMBEDDED_MODEL_NAME`; it resolves that name with
:func:`ensure_embedded_model`, which builds once into a cache directory. Benchmarks build
bigger variants by passing another :class:`TinyModelSpec` (see :data:`SPEC_PRESETS`).

Run ``python -m hosted_tinker.models.embedded OUT_DIR [--preset small]`` to build one by hand.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import hashlib
import json
import logging
import os
import random
import shutil
import tempfile
from dataclasses import dataclass
from importlib import resources
from pathlib import Path
from typing import Literal

logger = logging.getLogger(__name__)

#: The server's default ``--base-model``: named for what it is, not for a real hub model.
EMBEDDED_MODEL_NAME = "hosted-tinker/tiny-qwen3-embedded"

#: Bump when the *output* of the builder changes (corpus, template, file layout...), so that
#: :func:`ensure_embedded_model` does not reuse a stale cached build.
BUILD_VERSION = 1

ChatFlavor = Literal["qwen3", "qwen3_instruct", "qwen3_base"]

# ---------------------------------------------------------------------------------------------
# Special tokens, as in Qwen3's tokenizer (ids differ: ours follow our ~1k BPE vocabulary, but
# like Qwen's they come right after the regular vocabulary, in this order).
# ---------------------------------------------------------------------------------------------
ENDOFTEXT = "<|endoftext|>"
IM_START = "<|im_start|>"
IM_END = "<|im_end|>"
#: Single *special* tokens: skipped by ``decode(skip_special_tokens=True)`` and, in the
#: cookbook's content tokenizer (``encode_special_tokens=True``), never matched inside text.
SPECIAL_TOKENS = (ENDOFTEXT, IM_START, IM_END)
#: Added but *non-special* tokens: they must stay single tokens when they appear in message
#: content (the cookbook renders ``<think>``/``<tool_call>`` blocks as content) and survive
#: ``skip_special_tokens=True`` decoding, exactly like Qwen3's.
ADDED_NON_SPECIAL_TOKENS = (
    "<tool_call>",
    "</tool_call>",
    "<tool_response>",
    "</tool_response>",
    "<think>",
    "</think>",
)

# Qwen2/Qwen3's pre-tokenisation regex (transformers' ``Qwen2Tokenizer.PRETOKENIZE_REGEX``).
_QWEN2_PRETOKENIZE_REGEX = (
    r"""(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*"""
    r"""|\s*[\r\n]+|\s+(?!\S)|\s+"""
)


@dataclass(frozen=True)
class TinyModelSpec:
    """Shape of a built model. Every field is part of the cache key.

    ``vocab_target`` is the size of the tokenizer (BPE + the 9 added tokens) we aim for; the
    model's ``vocab_size`` is ``len(tokenizer)`` rounded up to a multiple of 64, so it covers
    every token id (with the default 1024 there is no gap: no id the model can sample falls
    outside the tokenizer).

    ``flavor`` picks the tokenizer/template conventions of a Qwen3 checkpoint family:
    ``"qwen3"`` (hybrid thinking, like Qwen3-8B: eos ``<|im_end|>``, template with
    ``enable_thinking``), ``"qwen3_instruct"`` (like Qwen3-*-Instruct-2507: no ``<think>``
    framing) and ``"qwen3_base"`` (like Qwen3-8B-Base: eos ``<|endoftext|>``).
    """

    hidden_size: int = 64
    num_layers: int = 2
    num_heads: int = 4
    num_kv_heads: int = 2
    head_dim: int = 16
    intermediate_size: int = 128
    vocab_target: int = 1024
    max_position_embeddings: int = 4096
    tie_word_embeddings: bool = False
    rope_theta: float = 1_000_000.0
    flavor: ChatFlavor = "qwen3"
    seed: int = 0

    def __post_init__(self) -> None:
        if self.num_heads % self.num_kv_heads:
            raise ValueError("num_heads must be a multiple of num_kv_heads")
        if self.vocab_target < 256 + len(SPECIAL_TOKENS) + len(ADDED_NON_SPECIAL_TOKENS):
            raise ValueError("vocab_target must leave room for the 256 byte tokens")
        if self.flavor not in ("qwen3", "qwen3_instruct", "qwen3_base"):
            raise ValueError(f"unknown flavor {self.flavor!r}")

    @property
    def eos_token(self) -> str:
        """Base checkpoints end documents with ``<|endoftext|>``; chat ones end turns."""
        return ENDOFTEXT if self.flavor == "qwen3_base" else IM_END

    def dir_name(self) -> str:
        """A readable, unique directory name for this spec and builder version."""
        digest = hashlib.sha256(
            json.dumps(dataclasses.asdict(self), sort_keys=True).encode()
        ).hexdigest()[:10]
        return (
            f"tiny-{self.flavor.replace('_', '-')}-h{self.hidden_size}-l{self.num_layers}"
            f"-v{self.vocab_target}-s{self.seed}-b{BUILD_VERSION}-{digest}"
        )


#: Named shapes: "tiny" is the default embedded model (fast unit tests), "small" and
#: "medium" give benchmarks measurable compute on CPU while staying seconds to build.
SPEC_PRESETS: dict[str, TinyModelSpec] = {
    "tiny": TinyModelSpec(),
    "small": TinyModelSpec(
        hidden_size=256, num_layers=4, num_heads=4, num_kv_heads=2, head_dim=64,
        intermediate_size=768,
    ),
    "medium": TinyModelSpec(
        hidden_size=512, num_layers=8, num_heads=8, num_kv_heads=4, head_dim=64,
        intermediate_size=1536,
    ),
}


# ---------------------------------------------------------------------------------------------
# Chat templates and the BPE training corpus are text, kept as package data in embedded_text/.
# QWEN3_CHAT_TEMPLATE is Qwen3-8B's template (tokenizer_config.json on the hub): the cookbook's
# Qwen3Renderer is written to reproduce it token for token, and vLLM / an OpenAI-compatible
# endpoint render chats with it. The instruct variant drops the <think> framing, like
# Qwen3-*-Instruct-2507 (the cookbook's Qwen3InstructRenderer): the two share every part but
# the assistant turn and the generation prompt. Changing any of these files changes the
# built tokenizer: bump BUILD_VERSION.
# ---------------------------------------------------------------------------------------------
def _text(name: str) -> str:
    return resources.files("hosted_tinker.models.embedded_text").joinpath(name).read_text(encoding="utf-8")


def _template(*parts: str) -> str:
    return "".join(_text(f"template_{part}.jinja") for part in parts)


QWEN3_CHAT_TEMPLATE = _template("head", "assistant_thinking", "tail", "generation_thinking", "end")
QWEN3_INSTRUCT_CHAT_TEMPLATE = _template("head", "assistant_plain", "tail", "end")


def chat_template_for(flavor: ChatFlavor) -> str:
    """Base checkpoints ship the hybrid template too (Qwen3-8B-Base does)."""
    return QWEN3_INSTRUCT_CHAT_TEMPLATE if flavor == "qwen3_instruct" else QWEN3_CHAT_TEMPLATE


# Training corpus for the BPE. Hand-written prose (corpus_prose.txt) gives realistic English
# merges; the generated part adds volume (enough frequent pairs for ~1.3k merges), numbers,
# arithmetic, code, JSON and chat-like turns, so that typical test prompts tokenize compactly.
# Its phrases (corpus_phrases.json) fill sentence templates; the common English words
# (common_words.txt) make "word salad" lines, which give the BPE many distinct words.


def _generated_corpus(rng: random.Random, n_sentences: int) -> list[str]:
    """Template sentences, word salad, Q&A, arithmetic, code and chat turns (fixed-seed RNG)."""
    w = json.loads(_text("corpus_phrases.json"))
    common_words = _text("common_words.txt").split()
    lines: list[str] = []
    for i in range(n_sentences):
        kind = i % 7
        if kind == 0:
            s = f"{rng.choice(w['subject'])} {rng.choice(w['verb'])} {rng.choice(w['object'])} {rng.choice(w['adverb'])}."
            lines.append(s[0].upper() + s[1:])
        elif kind == 1:
            a, b = rng.randint(0, 999), rng.randint(0, 999)
            op = rng.choice(["+", "-", "*"])
            res = a + b if op == "+" else a - b if op == "-" else a * b
            lines.append(f"What is {a} {op} {b}? The answer is {res}.")
        elif kind == 2:
            lines.append(
                f"Can you tell me something about {rng.choice(w['topic'])}? "
                f"Of course. {rng.choice(w['topic']).capitalize()} is a wide field, and "
                f"{rng.choice(w['subject'])} often {rng.choice(w['verb'])} {rng.choice(w['object'])}."
            )
        elif kind == 3:
            lines.append(
                f"user\nPlease write {rng.choice(w['object'])} about {rng.choice(w['topic'])}.\n"
                f"assistant\nHere is {rng.choice(w['object'])}: {rng.choice(w['subject'])} "
                f"{rng.choice(w['verb'])} it {rng.choice(w['adverb'])}."
            )
        elif kind == 4:
            x = rng.randint(1, 99)
            lines.append(
                f"Let me think. If x = {x}, then 2x = {2 * x} and x squared is {x * x}. "
                f"So the answer is \\boxed{{{x * x}}}."
            )
        elif kind == 5:
            name = rng.choice(["value", "total", "count", "result", "items", "index"])
            lines.append(
                f"    {name} = {rng.randint(0, 100)}\n    if {name} > 10:\n"
                f"        return {name} * 2\n"
            )
        else:
            words = rng.sample(common_words, rng.randint(6, 14))
            lines.append(" ".join(words).capitalize() + rng.choice([".", "?", "!", ","]))
    return lines


def corpus_lines() -> list[str]:
    """The full, deterministic BPE training corpus (about 70 KB, ~1.6k BPE tokens at most)."""
    return _text("corpus_prose.txt").splitlines(keepends=True) + _generated_corpus(random.Random(1234), 900)


# ---------------------------------------------------------------------------------------------
# Builders
# ---------------------------------------------------------------------------------------------
def _round_up(n: int, multiple: int) -> int:
    return -(-n // multiple) * multiple


def build_tokenizer(spec: TinyModelSpec = TinyModelSpec()):
    """Train the byte-level BPE and add Qwen3's special/added tokens.

    Returns a ``tokenizers.Tokenizer``. The pipeline is Qwen2Tokenizer's (NFC normaliser,
    Qwen regex split + byte-level, byte-level decoder), so text round-trips byte for byte
    and any string (any language, emoji) is encodable through the 256 byte tokens.
    """
    from tokenizers import AddedToken, Regex, Tokenizer, decoders, normalizers, pre_tokenizers
    from tokenizers import processors, trainers
    from tokenizers.models import BPE

    tok = Tokenizer(
        BPE(unk_token=None, continuing_subword_prefix="", end_of_word_suffix="", fuse_unk=False,
            byte_fallback=False)
    )
    tok.normalizer = normalizers.NFC()
    tok.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(_QWEN2_PRETOKENIZE_REGEX), behavior="isolated", invert=False),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
    ])
    tok.decoder = decoders.ByteLevel()
    tok.post_processor = processors.ByteLevel(add_prefix_space=False, trim_offsets=False,
                                              use_regex=False)
    n_added = len(SPECIAL_TOKENS) + len(ADDED_NON_SPECIAL_TOKENS)
    trainer = trainers.BpeTrainer(
        vocab_size=spec.vocab_target - n_added,
        min_frequency=2,
        show_progress=False,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        special_tokens=[],
    )
    tok.train_from_iterator(corpus_lines(), trainer=trainer)
    # Training resets the model's affixes to null; Qwen's tokenizer.json (and what
    # transformers' Qwen2Tokenizer rebuilds from it) has "". Same behaviour, but keeping the
    # file identical to what transformers would produce makes round-trips exact.
    state = json.loads(tok.to_str())
    state["model"]["continuing_subword_prefix"] = ""
    state["model"]["end_of_word_suffix"] = ""
    tok = Tokenizer.from_str(json.dumps(state))
    if tok.get_vocab_size() < spec.vocab_target - n_added:
        logger.debug("corpus yields only %d BPE tokens (< %d asked); model vocab is padded",
                     tok.get_vocab_size(), spec.vocab_target - n_added)
    tok.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in SPECIAL_TOKENS])
    tok.add_tokens([AddedToken(t, special=False, normalized=False)
                    for t in ADDED_NON_SPECIAL_TOKENS])
    return tok


def _tokenizer_config(tok, spec: TinyModelSpec) -> dict:
    """tokenizer_config.json as Qwen3 checkpoints write it (transformers loads either way)."""
    added = {}
    for token in (*SPECIAL_TOKENS, *ADDED_NON_SPECIAL_TOKENS):
        added[str(tok.token_to_id(token))] = {
            "content": token, "lstrip": False, "normalized": False, "rstrip": False,
            "single_word": False, "special": token in SPECIAL_TOKENS,
        }
    return {
        "add_bos_token": False,
        "add_prefix_space": False,
        "added_tokens_decoder": added,
        "additional_special_tokens": [IM_START, IM_END],
        "bos_token": None,
        "chat_template": chat_template_for(spec.flavor),
        "clean_up_tokenization_spaces": False,
        "eos_token": spec.eos_token,
        "errors": "replace",
        "model_max_length": spec.max_position_embeddings,
        "pad_token": ENDOFTEXT,
        "split_special_tokens": False,
        "tokenizer_class": "Qwen2Tokenizer",
        "unk_token": None,
    }


def _write_json(path: Path, obj: dict) -> None:
    path.write_text(json.dumps(obj, indent=2, ensure_ascii=False, sort_keys=True) + "\n",
                    encoding="utf-8")


def build_tiny_model(out_dir: Path, spec: TinyModelSpec = TinyModelSpec()) -> Path:
    """Write a complete Hugging Face model directory for ``spec`` into ``out_dir``.

    Files: config.json, generation_config.json, model.safetensors, tokenizer.json,
    tokenizer_config.json. Deterministic: same spec + same torch/transformers versions ->
    identical bytes. Takes well under a second for the default spec.
    """
    import torch
    from transformers import GenerationConfig, Qwen3Config, Qwen3ForCausalLM

    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)

    tok = build_tokenizer(spec)
    tok.save(str(out_dir / "tokenizer.json"), pretty=True)
    _write_json(out_dir / "tokenizer_config.json", _tokenizer_config(tok, spec))

    eot_id = tok.token_to_id(ENDOFTEXT)
    eos_id = tok.token_to_id(spec.eos_token)
    config = Qwen3Config(
        vocab_size=_round_up(tok.get_vocab_size(with_added_tokens=True), 64),
        hidden_size=spec.hidden_size,
        intermediate_size=spec.intermediate_size,
        num_hidden_layers=spec.num_layers,
        num_attention_heads=spec.num_heads,
        num_key_value_heads=spec.num_kv_heads,
        head_dim=spec.head_dim,
        max_position_embeddings=spec.max_position_embeddings,
        rope_parameters={"rope_type": "default", "rope_theta": spec.rope_theta},
        tie_word_embeddings=spec.tie_word_embeddings,
        max_window_layers=spec.num_layers,
        bos_token_id=eot_id,
        eos_token_id=eos_id,
        pad_token_id=eot_id,
        dtype="float32",
    )
    # Seed *before* construction: the initialisers draw from the global torch RNG. We restore
    # the caller's RNG state so building a model never perturbs an unrelated test.
    rng_state = torch.random.get_rng_state()
    try:
        torch.manual_seed(spec.seed)
        model = Qwen3ForCausalLM(config).to(torch.float32)
    finally:
        torch.random.set_rng_state(rng_state)
    # Stop ids like Qwen3's generation_config (chat models stop on either token). No sampling
    # defaults (temperature/top_p/top_k): vLLM would apply them to every request.
    stop_ids = [eos_id] if eos_id == eot_id else [eos_id, eot_id]
    model.generation_config = GenerationConfig(
        bos_token_id=eot_id, eos_token_id=stop_ids, pad_token_id=eot_id
    )
    _save_quietly(model, out_dir)
    _write_legacy_config_keys(out_dir / "config.json", spec)
    logger.debug("built %s into %s", spec, out_dir)
    return out_dir


@contextlib.contextmanager
def no_progress_bars():
    """transformers without its progress bars on stderr ("Writing model shards", "Loading weights"):
    the server logs each stage itself, and a bar would break a JSON log's one record per line."""
    from transformers.utils import logging as hf_logging

    was_enabled = hf_logging.is_progress_bar_enabled()
    hf_logging.disable_progress_bar()
    try:
        yield
    finally:
        if was_enabled:
            hf_logging.enable_progress_bar()


def _save_quietly(model, out_dir: Path) -> None:
    with no_progress_bars():
        model.save_pretrained(out_dir)


def _write_legacy_config_keys(path: Path, spec: TinyModelSpec) -> None:
    """Rewrite config.json with the keys real Qwen3 checkpoints use (``rope_theta``,
    ``rope_scaling``, ``torch_dtype``) instead of transformers 5's ``rope_parameters``.

    transformers 5 reads either form (it converts the legacy keys on load), but consumers
    pinned to transformers 4.x -- notably vLLM builds -- silently ignore ``rope_parameters``
    and fall back to rope_theta=10000, which would make their logprobs disagree with ours.
    """
    config = json.loads(path.read_text(encoding="utf-8"))
    rope = config.pop("rope_parameters", None) or {}
    config["rope_theta"] = rope.get("rope_theta", spec.rope_theta)
    config["rope_scaling"] = None
    config["torch_dtype"] = config.get("dtype", "float32")
    _write_json(path, config)


def default_cache_root() -> Path:
    """Where the server caches built models: $HOSTED_TINKER_CACHE or ~/.cache/hosted-tinker."""
    env = os.environ.get("HOSTED_TINKER_CACHE")
    base = Path(env) if env else Path.home() / ".cache" / "hosted-tinker"
    return base / "models"


def ensure_embedded_model(cache_root: Path, spec: TinyModelSpec = TinyModelSpec()) -> Path:
    """Return ``cache_root/<spec dir>``, building it there first if it does not exist yet.

    The build goes to a temporary sibling directory that is renamed into place, so a
    concurrent or interrupted build never leaves a half-written model where a reader looks;
    if two processes race, the loser discards its copy. Later calls are a stat().
    """
    cache_root = Path(cache_root)
    final = cache_root / spec.dir_name()
    if final.is_dir():
        return final
    cache_root.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{final.name}.tmp-", dir=cache_root))
    try:
        build_tiny_model(tmp, spec)
        try:
            os.rename(tmp, final)
        except OSError:
            if not final.is_dir():  # not a lost race: a real error
                raise
            logger.debug("another process built %s first", final)
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)
    logger.info("built embedded model into %s", final)
    return final


def _main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("out_dir", type=Path)
    parser.add_argument("--preset", choices=sorted(SPEC_PRESETS), default="tiny")
    parser.add_argument("--flavor", choices=["qwen3", "qwen3_instruct", "qwen3_base"],
                        default="qwen3")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    spec = dataclasses.replace(SPEC_PRESETS[args.preset], flavor=args.flavor, seed=args.seed)
    print(build_tiny_model(args.out_dir, spec))


if __name__ == "__main__":
    _main()
