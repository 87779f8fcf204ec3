"""A live adapter written to a checkpoint folder and restored from one (the folder's format is
format.py's): its weights in PEFT's form, its AdamW moments and step; and a served model's
adapter saved, read and loaded through its runtime (`ModelRuntime`), which itself only trains.
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import TYPE_CHECKING

import torch
from safetensors.torch import save_file

from .. import faults
from ..runtime.adapters import LoRAAdapter, LoRAConfig
from ..runtime.multi_lora import FusedPart, MultiLoRALinear
from ..runtime.projections import tinker_name
from .format import (
    ADAPTER_CONFIG, ADAPTER_WEIGHTS, MANIFEST, OPTIMIZER_STATE, PEFT_PREFIX, CheckpointError, LoadedCheckpoint,
    describe, peft_adapter_config, read_checkpoint, to_peft, write_atomically,
)

if TYPE_CHECKING:  # the runtime's surface, for annotations only (it imports the whole trainer)
    from ..runtime.model_runtime import ModelRuntime


def write_peft_files(folder: Path, tensors: dict[str, torch.Tensor], parts: dict[str, FusedPart],
                     config: LoRAConfig, base_model: str) -> None:
    """An adapter's LoRA `tensors` (by LoRA path; `parts`: those of fused projections) written to
    `folder` as a checkpoint holds them: adapter_model.safetensors and adapter_config.json."""
    peft, fused = to_peft(tensors, parts)
    weights = {PEFT_PREFIX + tinker_name(k): v.detach().to("cpu", torch.float32).contiguous() for k, v in peft.items()}
    save_file(weights, str(folder / ADAPTER_WEIGHTS), metadata={"format": "pt"})
    faults.crash_point("checkpoint.after_tensors")
    (folder / ADAPTER_CONFIG).write_text(json.dumps(
        peft_adapter_config(config, base_model, sorted({k.rsplit(".lora_", 1)[0] for k in peft}), fused), indent=2))


def save_adapter(adapter: LoRAAdapter, out_dir: Path, base_model: str, *, with_optimizer: bool,
                 overwrite: bool = False) -> int:
    """Write the adapter (and optionally its optimizer state) atomically; return total bytes."""
    optim: dict[str, torch.Tensor] = {}
    if with_optimizer:
        names = list(adapter.named_tensors())
        for name, p in zip(names, adapter.parameters()):
            state = adapter.optimizer.state.get(p)
            if not state:
                continue
            optim[f"{name}.exp_avg"] = state["exp_avg"].detach().cpu().contiguous()
            optim[f"{name}.exp_avg_sq"] = state["exp_avg_sq"].detach().cpu().contiguous()
            # A copy: an adapter's tensors share one step counter (adamw._step_one).
            optim[f"{name}.step"] = torch.as_tensor(state["step"], dtype=torch.float32).reshape(1).cpu().clone()

    def write(tmp: Path) -> None:
        write_peft_files(tmp, adapter.named_tensors(), adapter.parts, adapter.config, base_model)
        files = [ADAPTER_WEIGHTS, ADAPTER_CONFIG]
        if with_optimizer:
            save_file(optim, str(tmp / OPTIMIZER_STATE))
            files.append(OPTIMIZER_STATE)
        manifest = describe(tmp, files, base_model=base_model, config=adapter.config, step=adapter.step)
        (tmp / MANIFEST).write_text(manifest.to_json())

    write_atomically(out_dir, write, overwrite=overwrite)
    return sum(f.stat().st_size for f in out_dir.iterdir())


def check_fits(ckpt: LoadedCheckpoint, layers: dict[str, MultiLoRALinear], *, max_rank: int) -> None:
    """Refuse an adapter the served model cannot load exactly, or above the server's rank limit."""
    if ckpt.config.rank > max_rank:
        raise CheckpointError(f"the adapter has LoRA rank {ckpt.config.rank}, above this server's limit of {max_rank}")
    present = sorted({k.rsplit(".lora_", 1)[0] for k in ckpt.tensors})
    unknown = [p for p in present if p not in layers]
    if unknown:
        raise CheckpointError(f"the adapter does not fit the served base model: it adapts {unknown[0][:200]!r}, "
                              "which is not a linear projection of this model")
    expected = [p for p in sorted(layers) if ckpt.config.adapts(p, layers[p])]
    missing = [p for p in expected if p not in present]
    if missing:
        raise CheckpointError(f"the adapter leaves out {missing[0]!r} among the projections it targets; adapters "
                              "restricted to some layers (layers_to_transform) are not supported")
    r = ckpt.config.rank
    for p in present:
        a, b = ckpt.tensors.get(f"{p}.lora_A.weight"), ckpt.tensors.get(f"{p}.lora_B.weight")
        if (a is None) != (b is None):
            raise CheckpointError(f"{p}: its lora_{'A' if a is None else 'B'}.weight is missing beside its "
                                  f"lora_{'B' if a is None else 'A'}.weight")
        if a is None or len(ckpt.tensors) != 2 * len(present):
            raise CheckpointError(f"the adapter has tensors other than lora_A/lora_B weights (at {p!r}); "
                                  "only plain LoRA (no bias, no modules_to_save, no embedding LoRA) is supported")
        layer = layers[p]
        want_a, want_b = (*layer.lora_lead, r, layer.in_features), (*layer.lora_lead, layer.out_features, r)
        if not _fits(a.shape, want_a, b.shape, want_b):
            raise CheckpointError(f"{p}: LoRA shapes {list(a.shape)} / {list(b.shape)} do not fit this model "
                                  f"(rank {r} needs {list(want_a)} / {list(want_b)})")
    for name, t in ckpt.tensors.items():  # a non-finite adapter would sample and train nothing but NaN
        if not t.isfinite().all():
            raise CheckpointError(f"{name} holds values that are not finite (NaN or inf): an adapter's weights "
                                  "must be finite")
    if ckpt.optimizer is not None:
        _check_optimizer_names(ckpt)
        for name, t in ckpt.tensors.items():
            if f"{name}.exp_avg" in ckpt.optimizer:
                _checked_moments(ckpt.optimizer, name, t.shape)


MOMENTS = ("exp_avg", "exp_avg_sq", "step")  # one LoRA tensor's AdamW state in optimizer.safetensors


def _check_optimizer_names(ckpt: LoadedCheckpoint) -> None:
    """The optimizer file holds the state of every LoRA tensor of the adapter (or of none, before
    its first step) and nothing else: a part of it would restart some tensors' moments silently."""
    wanted = {f"{name}.{k}" for name in ckpt.tensors for k in MOMENTS}
    unknown = sorted(set(ckpt.optimizer) - wanted)
    if unknown:
        raise CheckpointError(f"{OPTIMIZER_STATE}: {unknown[0][:200]!r} is not the state of a LoRA tensor of this "
                              "adapter")
    missing = sorted(wanted - set(ckpt.optimizer))
    if ckpt.optimizer and missing:
        raise CheckpointError(f"{OPTIMIZER_STATE}: {missing[0]!r} is missing: it holds the state of every LoRA "
                              "tensor or of none")


def _fits(a: torch.Size, want_a: tuple, b: torch.Size, want_b: tuple) -> bool:
    """Exact shapes; or, for MoE experts ([experts, ...] factors), one of A and B shared by every
    expert ([1, ...]) as Tinker's checkpoints may hold it (broadcast when restored)."""
    if tuple(a) == want_a and tuple(b) == want_b:
        return True
    if len(want_a) != 3 or len(a) != 3 or len(b) != 3 or (a[0] == 1 and b[0] == 1):
        return False
    return (tuple(a[1:]) == want_a[1:] and tuple(b[1:]) == want_b[1:]
            and a[0] in (1, want_a[0]) and b[0] in (1, want_b[0]))


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
            if src.shape != t.shape and not (src.dim() == 3 and src.shape[0] == 1 and src.shape[1:] == t.shape[1:]):
                raise CheckpointError(f"{name}: shape {list(src.shape)} in checkpoint, model needs {list(t.shape)}")
            t.copy_(src.to(t.device))
    adapter.zero_grad()
    adapter.optimizer.clear()
    adapter.step = ckpt.step
    if ckpt.optimizer is not None:
        for name, p in zip(own, adapter.parameters()):
            if f"{name}.exp_avg" not in ckpt.optimizer:
                continue
            adapter.optimizer.load(p, _moments(ckpt.optimizer, name, p))


def _checked_moments(optimizer: dict[str, torch.Tensor], name: str, shape: torch.Size):
    """(exp_avg, exp_avg_sq, step) of one parameter, checked: the optimizer step is fused across
    tenants, so a moment of another shape would fail every tenant's step in that cycle."""
    exp_avg, exp_avg_sq, step = (optimizer.get(f"{name}.{k}") for k in ("exp_avg", "exp_avg_sq", "step"))
    if exp_avg is None or exp_avg_sq is None or step is None:
        raise CheckpointError(f"{OPTIMIZER_STATE}: the state of {name} is incomplete")
    if exp_avg.shape != shape or exp_avg_sq.shape != shape or step.numel() != 1:
        raise CheckpointError(f"{OPTIMIZER_STATE}: the state of {name} does not fit its weights")
    if not (exp_avg.isfinite().all() and exp_avg_sq.isfinite().all()):
        raise CheckpointError(f"{OPTIMIZER_STATE}: the moments of {name} hold values that are not finite")
    steps = float(step.item())
    if not (math.isfinite(steps) and 0 <= steps <= 1 << 53):
        raise CheckpointError(f"{OPTIMIZER_STATE}: the step count of {name} is not a count")
    return exp_avg, exp_avg_sq, steps


def _moments(optimizer: dict[str, torch.Tensor], name: str, p: torch.Tensor) -> dict[str, torch.Tensor]:
    """One parameter's AdamW state on its device and in its dtype, as the fused step needs it."""
    exp_avg, exp_avg_sq, steps = _checked_moments(optimizer, name, p.shape)
    return {"step": torch.tensor(steps, device=p.device),
            "exp_avg": exp_avg.to(device=p.device, dtype=p.dtype).clone(),
            "exp_avg_sq": exp_avg_sq.to(device=p.device, dtype=p.dtype).clone()}


# -- a served model's adapter, through its runtime ---------------------------------------------------

def save_checkpoint(runtime: ModelRuntime, model_id: str, out_dir: Path, *, with_optimizer: bool,
                    overwrite: bool = False) -> int:
    return save_adapter(runtime.adapter(model_id), out_dir, runtime.base_model_name,
                        with_optimizer=with_optimizer, overwrite=overwrite)


def read_checkpoint_for(runtime: ModelRuntime, ckpt_dir: Path, *, with_optimizer: bool) -> LoadedCheckpoint:
    ckpt = read_checkpoint(ckpt_dir, with_optimizer=with_optimizer, layers=runtime.layers)
    if ckpt.base_model and ckpt.base_model != runtime.base_model_name:
        raise CheckpointError(
            f"checkpoint was trained on base model {ckpt.base_model!r}; this server serves "
            f"{runtime.base_model_name!r}")
    return ckpt


def load_checkpoint(runtime: ModelRuntime, model_id: str, ckpt: LoadedCheckpoint) -> LoRAAdapter:
    """(Re)build `model_id`'s adapter from a checkpoint: its LoRA config comes from the files."""
    old = runtime.adapters.get(model_id)
    runtime.remove_adapter(model_id)
    try:
        adapter = runtime.create_adapter(model_id, ckpt.config)
        restore_adapter(adapter, ckpt)
    except Exception:
        runtime.remove_adapter(model_id)
        if old is not None:  # leave the model as it was
            runtime.adapters[model_id] = old
            runtime.ensure_live([model_id])
        raise
    return adapter
