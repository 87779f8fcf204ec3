"""A checkpoint of ours rewritten as Tinker keeps fused projections: one LoRA per component, of the
adapter's rank, beside the fused module ("...linear_attn.in_proj_q" for Qwen3.5's in_proj_qkv,
"...self_attn.q_proj" for Phi3's qkv_proj), which is how the cookbook's weight tools read Tinker's
checkpoints (its Qwen3.5 profile, `fused_projection_map`). Ours holds the PEFT form instead: one LoRA
of rank components x rank on the fused module, B block-diagonal (`checkpoints.format.to_peft`).
The split is the cookbook's `_merge_fused_projections` read backwards."""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from hosted_tinker.checkpoints.format import (
    ADAPTER_CONFIG, ADAPTER_WEIGHTS, MANIFEST, OPTIMIZER_STATE, PEFT_PREFIX, describe, read_manifest,
)
from hosted_tinker.runtime.projections import Projection, tinker_name


def split_fused(tensors: dict[str, torch.Tensor], fused: list[Projection], rank: int) -> dict[str, torch.Tensor]:
    """`tensors` (a checkpoint file's) with each fused projection's LoRA split into its components'."""
    out = dict(tensors)
    for proj in fused:
        key = PEFT_PREFIX + tinker_name(proj.path)
        A, B = out.pop(f"{key}.lora_A.weight"), out.pop(f"{key}.lora_B.weight")
        beside = key.rpartition(".")[0]
        for i, (name, rows) in enumerate(proj.components):
            out[f"{beside}.{name}.lora_A.weight"] = A[i * rank:(i + 1) * rank].clone()
            out[f"{beside}.{name}.lora_B.weight"] = B[list(rows), i * rank:(i + 1) * rank].clone()
    return out


def tinker_adapter_config(config: dict, tensors: dict[str, torch.Tensor]) -> dict:
    """A PEFT adapter_config.json as Tinker writes one: one rank for every module, no patterns."""
    leaves = sorted({k.rsplit(".lora_", 1)[0].rsplit(".", 1)[-1] for k in tensors})
    return {**config, "target_modules": leaves, "rank_pattern": {}, "alpha_pattern": {}}


def rewrite_in_tinker_layout(folder: Path, fused: list[Projection]) -> None:
    """Our checkpoint `folder` in Tinker's layout, its manifest describing the new files."""
    manifest = read_manifest(folder)
    tensors = split_fused(load_file(str(folder / ADAPTER_WEIGHTS)), fused, manifest.lora_config.rank)
    save_file(tensors, str(folder / ADAPTER_WEIGHTS), metadata={"format": "pt"})
    config = json.loads((folder / ADAPTER_CONFIG).read_text())
    (folder / ADAPTER_CONFIG).write_text(json.dumps(tinker_adapter_config(config, tensors)))
    names = [ADAPTER_WEIGHTS, ADAPTER_CONFIG] + ([OPTIMIZER_STATE] if manifest.has_optimizer else [])
    (folder / MANIFEST).write_text(describe(folder, names, base_model=manifest.base_model,
                                            config=manifest.lora_config.config(), step=manifest.step).to_json())
