"""Checkpoint files: a standard PEFT adapter, plus optimizer state and a manifest for training state.

Layout of one checkpoint directory:

    adapter_config.json          PEFT LoraConfig (r, lora_alpha, target_modules, ...)
    adapter_model.safetensors    PEFT key names: base_model.model.<path>.lora_{A,B}.weight
    optimizer.safetensors        AdamW moments + step per tensor (training state only)
    manifest.json                base model, LoRA config, step, creation time, sizes, sha256

PEFT and vLLM load the first two as they are. Every directory is written under a temporary
name and renamed into place, so a reader (or a restart after kill -9) never sees half of one.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import time
import uuid
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from .adapters import LoRAAdapter, LoRAConfig
from .multi_lora import module_kind

PEFT_PREFIX = "base_model.model."
MANIFEST = "manifest.json"
ADAPTER_WEIGHTS = "adapter_model.safetensors"
ADAPTER_CONFIG = "adapter_config.json"
OPTIMIZER_STATE = "optimizer.safetensors"


class CheckpointError(ValueError):
    """A checkpoint that cannot be used (missing, corrupt, or for another base model)."""


@dataclass
class LoadedCheckpoint:
    config: LoRAConfig
    base_model: str
    step: int
    tensors: dict[str, torch.Tensor]  # '<path>.lora_A.weight' -> tensor (no PEFT prefix)
    optimizer: dict[str, torch.Tensor] | None


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def write_atomically(final_dir: Path, write, *, overwrite: bool = False) -> None:
    """Run `write(tmp_dir)` then rename tmp_dir to final_dir (replacing it if `overwrite`)."""
    final_dir.parent.mkdir(parents=True, exist_ok=True)
    tmp = final_dir.parent / f".tmp-{final_dir.name}-{uuid.uuid4().hex[:8]}"
    tmp.mkdir()
    try:
        write(tmp)
        for f in tmp.iterdir():
            with open(f, "rb+") as fh:
                os.fsync(fh.fileno())
        if final_dir.exists():
            if not overwrite:
                raise CheckpointError(f"checkpoint {final_dir.name!r} already exists")
            old = final_dir.parent / f".old-{final_dir.name}-{uuid.uuid4().hex[:8]}"
            os.rename(final_dir, old)
            os.rename(tmp, final_dir)
            shutil.rmtree(old, ignore_errors=True)
        else:
            os.rename(tmp, final_dir)
        _fsync_dir(final_dir.parent)
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)


def peft_adapter_config(config: LoRAConfig, base_model: str, module_paths: list[str]) -> dict:
    leaves = sorted({p.rsplit(".", 1)[-1] for p in module_paths})
    return {
        "peft_type": "LORA",
        "task_type": "CAUSAL_LM",
        "base_model_name_or_path": base_model,
        "r": config.rank,
        "lora_alpha": config.alpha,
        "lora_dropout": 0.0,
        "target_modules": leaves,
        "bias": "none",
        "fan_in_fan_out": False,
        "inference_mode": True,
        "init_lora_weights": True,
        "use_rslora": False,
        "use_dora": False,
        "modules_to_save": None,
    }


def save_adapter(adapter: LoRAAdapter, out_dir: Path, base_model: str, *, with_optimizer: bool,
                 overwrite: bool = False, extra_manifest: dict | None = None) -> int:
    """Write the adapter (and optionally its optimizer state) atomically; return total bytes."""
    tensors = {PEFT_PREFIX + k: v.detach().to("cpu", torch.float32).contiguous()
               for k, v in adapter.named_tensors().items()}
    optim: dict[str, torch.Tensor] = {}
    if with_optimizer:
        names = list(adapter.named_tensors())
        for name, p in zip(names, adapter.parameters()):
            state = adapter.optimizer.state.get(p)
            if not state:
                continue
            optim[f"{name}.exp_avg"] = state["exp_avg"].detach().cpu().contiguous()
            optim[f"{name}.exp_avg_sq"] = state["exp_avg_sq"].detach().cpu().contiguous()
            # A copy: an adapter's tensors share one step counter (adapters.adamw_step).
            optim[f"{name}.step"] = torch.as_tensor(state["step"], dtype=torch.float32).reshape(1).cpu().clone()

    def write(tmp: Path) -> None:
        save_file(tensors, str(tmp / ADAPTER_WEIGHTS), metadata={"format": "pt"})
        (tmp / ADAPTER_CONFIG).write_text(json.dumps(
            peft_adapter_config(adapter.config, base_model, list(adapter.weights)), indent=2))
        files = [ADAPTER_WEIGHTS, ADAPTER_CONFIG]
        if with_optimizer:
            save_file(optim, str(tmp / OPTIMIZER_STATE))
            files.append(OPTIMIZER_STATE)
        manifest = {
            "format": "hosted-tinker-lora/1",
            "base_model": base_model,
            "lora_config": adapter.config.to_dict(),
            "step": adapter.step,
            "has_optimizer": with_optimizer,
            "created_at": time.time(),
            "files": {f: {"bytes": (tmp / f).stat().st_size, "sha256": _sha256(tmp / f)} for f in files},
            **(extra_manifest or {}),
        }
        (tmp / MANIFEST).write_text(json.dumps(manifest, indent=2))

    write_atomically(out_dir, write, overwrite=overwrite)
    return sum(f.stat().st_size for f in out_dir.iterdir())


def _read_json(ckpt_dir: Path, name: str) -> dict:
    try:
        return json.loads((ckpt_dir / name).read_text())
    except ValueError as e:  # JSONDecodeError / UnicodeDecodeError
        raise CheckpointError(f"{ckpt_dir.name}/{name}: not valid JSON, the checkpoint is corrupt ({e})") from None


def read_checkpoint(ckpt_dir: Path, *, with_optimizer: bool) -> LoadedCheckpoint:
    """Read a checkpoint written by `save_adapter`, or a plain PEFT adapter directory."""
    if not (ckpt_dir / ADAPTER_WEIGHTS).is_file() or not (ckpt_dir / ADAPTER_CONFIG).is_file():
        raise CheckpointError(f"{ckpt_dir.name}: not a LoRA adapter (needs {ADAPTER_CONFIG} and {ADAPTER_WEIGHTS})")
    # Verify checksums before parsing anything they cover (adapter_config.json included).
    manifest = _read_json(ckpt_dir, MANIFEST) if (ckpt_dir / MANIFEST).is_file() else None
    if manifest is not None:
        for name, meta in manifest.get("files", {}).items():
            if _sha256(ckpt_dir / name) != meta["sha256"]:
                raise CheckpointError(f"{ckpt_dir.name}/{name}: checksum mismatch, the checkpoint is corrupt")
    peft_cfg = _read_json(ckpt_dir, ADAPTER_CONFIG)
    raw = load_file(str(ckpt_dir / ADAPTER_WEIGHTS))
    tensors: dict[str, torch.Tensor] = {}
    for key, value in raw.items():
        name = key[len(PEFT_PREFIX):] if key.startswith(PEFT_PREFIX) else key
        # PEFT writes adapter-named keys ("lora_A.default.weight") in some versions' in-memory
        # state dicts; the saved form drops the adapter name, but accept both.
        name = name.replace(".lora_A.default.weight", ".lora_A.weight").replace(
            ".lora_B.default.weight", ".lora_B.weight")
        tensors[name] = value.to(torch.float32)
    paths = sorted({k.rsplit(".lora_", 1)[0] for k in tensors})
    kinds = {module_kind(p) for p in paths}
    if manifest is not None:
        config = LoRAConfig(**manifest["lora_config"])
        base_model, step = manifest["base_model"], int(manifest.get("step", 0))
    else:  # an adapter made elsewhere (PEFT): derive the config from its files
        rank = int(peft_cfg["r"])
        config = LoRAConfig(rank=rank, seed=0, train_attn="attn" in kinds, train_mlp="mlp" in kinds,
                            train_unembed="unembed" in kinds, alpha=float(peft_cfg.get("lora_alpha", rank)),
                            target_modules=tuple(sorted({p.rsplit(".", 1)[-1] for p in paths})))
        base_model, step = peft_cfg.get("base_model_name_or_path") or "", 0
        if peft_cfg.get("use_dora") or peft_cfg.get("use_rslora"):
            raise CheckpointError("DoRA and rsLoRA adapters are not supported")
    optimizer = None
    if with_optimizer:
        if not (ckpt_dir / OPTIMIZER_STATE).is_file():
            raise CheckpointError(f"{ckpt_dir.name}: has no optimizer state (saved for sampling, "
                                  "not with save_state); load it without the optimizer")
        optimizer = load_file(str(ckpt_dir / OPTIMIZER_STATE))
    return LoadedCheckpoint(config=config, base_model=base_model, step=step, tensors=tensors,
                            optimizer=optimizer)


def restore_adapter(adapter: LoRAAdapter, ckpt: LoadedCheckpoint) -> None:
    """Copy checkpoint tensors (and optimizer moments, if loaded) into a fresh adapter."""
    own = adapter.named_tensors()
    missing = sorted(set(own) - set(ckpt.tensors))
    extra = sorted(set(ckpt.tensors) - set(own))
    if missing or extra:
        raise CheckpointError(
            f"checkpoint does not fit this model: missing {missing[:3]}{'...' if len(missing) > 3 else ''}, "
            f"unexpected {extra[:3]}{'...' if len(extra) > 3 else ''}")
    with torch.no_grad():
        for name, t in own.items():
            src = ckpt.tensors[name]
            if src.shape != t.shape:
                raise CheckpointError(f"{name}: shape {list(src.shape)} in checkpoint, model needs {list(t.shape)}")
            t.copy_(src.to(t.device))
    adapter.zero_grad()
    adapter.optimizer.state.clear()
    adapter.step = ckpt.step
    if ckpt.optimizer is not None:
        for name, p in zip(own, adapter.parameters()):
            if f"{name}.exp_avg" not in ckpt.optimizer:
                continue
            adapter.optimizer.state[p] = {
                "step": torch.tensor(float(ckpt.optimizer[f"{name}.step"].item()), device=p.device),
                "exp_avg": ckpt.optimizer[f"{name}.exp_avg"].to(p.device).clone(),
                "exp_avg_sq": ckpt.optimizer[f"{name}.exp_avg_sq"].to(p.device).clone(),
            }
