"""Tiny random models of the families a server serves by path, saved as a checkpoint folder with
the embedded model's tokenizer: shared by the test modules that start servers on them."""

from __future__ import annotations

import shutil
from pathlib import Path

import torch
import transformers as T


def save_family_model(root: Path, name: str, config: T.PretrainedConfig, tokenizer_dir: Path) -> str:
    """A random model of `config` (weights fixed by the seed, fp32) saved under root/name with the
    tokenizer files of `tokenizer_dir`; its path."""
    out = root / name
    torch.manual_seed(0)
    model = (T.Gemma3ForCausalLM if name == "gemma3" else T.AutoModelForCausalLM.from_config)(config)
    with torch.no_grad():  # transformers may leave 3-D expert weights uninitialised
        for p in model.parameters():
            if p.dim() == 3:
                p.normal_(0, 0.1)
    model.to(torch.float32).save_pretrained(out)
    for f in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(tokenizer_dir / f, out / f)
    return str(out)
