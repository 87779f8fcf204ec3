"""Load the base model and tokenizer: the same `from_pretrained` path for every model.

The embedded default model is first built on disk (deterministically, no download) and then
loaded exactly like `Qwen/Qwen3-8B` would be, so the code the tests exercise is the code that
serves real models.
"""

from __future__ import annotations

import logging
import time
from pathlib import Path

import torch

from .embedded_model import EMBEDDED_MODEL_NAME, ensure_embedded_model

log = logging.getLogger(__name__)


def pick_device(spec: str) -> torch.device:
    if spec == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(spec)


def pick_dtype(spec: str, device: torch.device) -> torch.dtype:
    if spec == "auto":
        return torch.bfloat16 if device.type == "cuda" else torch.float32
    try:
        return {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}[spec]
    except KeyError:
        raise ValueError(f"unknown dtype {spec!r}; use auto, float32, bfloat16 or float16") from None


def resolve_model_source(name: str, data_dir: Path) -> str:
    """The directory or hub id `from_pretrained` should read for `name`."""
    if name == EMBEDDED_MODEL_NAME:
        return str(ensure_embedded_model(data_dir / "models"))
    return name


def load_base_model(name: str, data_dir: Path, device: torch.device, dtype: torch.dtype):
    """Return (model, tokenizer) for `name`, on `device`, frozen."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    source = resolve_model_source(name, data_dir)
    t0 = time.perf_counter()
    log.info("loading base model %s from %s (%s, %s) ...", name, source, device, dtype)
    tokenizer = AutoTokenizer.from_pretrained(source)
    model = AutoModelForCausalLM.from_pretrained(source, dtype=dtype)
    model.to(device)
    n_params = sum(p.numel() for p in model.parameters())
    log.info("base model %s ready: %.1fM parameters in %.1fs", name, n_params / 1e6, time.perf_counter() - t0)
    return model, tokenizer
