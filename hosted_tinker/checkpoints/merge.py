"""A checkpoint's LoRA merged into its base model's weights, exactly as the server applies it.

The server adds `scaling * B(A(x))` to each adapted projection's output; merged, that is
`scaling * B @ A` added into the projection's weight. The LoRAs are found with the server's own
knowledge of the model, not by PEFT's module-name matching (which merges nothing of a
vision-language model's checkpoint, whose LoRAs carry Tinker's text-model names, and nothing of
MoE experts, which are 3-D parameters, not modules): the trainer's LoRA layer map
(`projections.discover` + `attach_multi_lora` + `attach_moe_lora`, built on a meta-device copy of
the model) and the checkpoint reader, which gives every tensor under the runtime's LoRA path. Each
LoRA path then lands in its weight as the server computes it:

- a linear projection: W [out, in] += delta;
- a Conv1D (GPT-2): its weight is stored [in, out], so W.T += delta;
- a component of a fused projection (Phi3's qkv_proj, GPT-NeoX's query_key_value, GPT-2's c_attn,
  Qwen3.5's in_proj_qkv): delta goes into the component's output rows of the fused weight;
- MoE experts (`<experts>.w1|w3|w2`, 3-D factors, one of A or B possibly shared by every expert):
  per expert into the gate or up rows of `gate_up_proj` (halves or interleaved) or into `down_proj`,
  transposed where the module stores [E, in, out] (GPT-OSS);
- a LoRA on a tied unembedding: the unembedding is untied first, so the input embeddings keep
  the base weights (the server adapts only the output projection).

A LoRA that has no place in the model, or a projection the checkpoint's config adapts but whose
LoRA is missing, is a `CheckpointError` naming it (`adapter_io.check_fits`): never a partial merge.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

import torch
from torch import nn
from transformers.pytorch_utils import Conv1D

from ..runtime.lora_plan import LoRARouting
from ..runtime.moe_lora import DOWN, GATE, ExpertProjection, attach_moe_lora
from ..runtime.multi_lora import MultiLoRALinear, attach_multi_lora
from ..runtime.projections import discover
from .adapter_io import check_fits
from .format import read_checkpoint


def lora_layers(model: nn.Module) -> dict[str, MultiLoRALinear | ExpertProjection]:
    """The trainer's LoRA layer map of `model` ({LoRA path: layer}), built as the trainer builds
    it but on a copy of the model on the meta device: no memory, and `model` stays as it is."""
    with torch.device("meta"):
        skeleton = type(model)(model.config)
    projections = discover(skeleton)
    routing = LoRARouting()
    layers: dict = attach_multi_lora(skeleton, routing, projections)
    layers.update(attach_moe_lora(skeleton, routing, projections))
    return layers


def merge_lora(model: nn.Module, ckpt_dir: Path) -> list[str]:
    """Add every LoRA of the checkpoint in `ckpt_dir` into `model`'s weights (in place), as the
    server applies it; returns the LoRA paths merged. Raises `CheckpointError` for a checkpoint
    that does not fit the model."""
    layers = lora_layers(model)
    ckpt = read_checkpoint(ckpt_dir, with_optimizer=False, layers=layers)
    check_fits(ckpt, layers, max_rank=ckpt.config.rank)  # no server's rank limit applies to an export
    paths = sorted({k.rsplit(".lora_", 1)[0] for k in ckpt.tensors})
    if any(layers[p].role == "unembed" for p in paths):
        _untie_unembedding(model)
    with torch.no_grad():
        for path in paths:
            A, B = ckpt.tensors[f"{path}.lora_A.weight"], ckpt.tensors[f"{path}.lora_B.weight"]
            delta = (B @ A).mul_(ckpt.config.scaling)  # fp32, as the server's LoRA; experts [E, out, in]
            _add_delta(model, path, layers[path], delta)
    return paths


def _add_delta(model: nn.Module, path: str, layer: MultiLoRALinear | ExpertProjection, delta: torch.Tensor) -> None:
    """Add the delta of the LoRA at `path` into the weight (or the rows of it) the server adapts."""
    if isinstance(layer, ExpertProjection):
        experts = model.get_submodule(path.rpartition(".")[0])
        name = "down_proj" if layer.name == DOWN else "gate_up_proj"
        weight = getattr(experts, name)  # [E, out, in]; transposed [E, in, out]
        view = weight.transpose(1, 2) if layer.owner.transposed else weight
        rows = None
        if layer.name != DOWN:  # gate (w1) and up (w3) share gate_up_proj's outputs
            n = view.shape[1] // 2
            first = 0 if layer.name == GATE else (1 if layer.owner.interleaved else n)
            rows = range(first, 2 * n, 2) if layer.owner.interleaved else range(first, first + n)
        _add(view, delta, rows, dim=1)
        return
    part = layer.part
    module = model.get_submodule(part.path if part is not None else path)
    view = module.weight.t() if isinstance(module, Conv1D) else module.weight  # as [out, in]
    _add(view, delta, part.rows if part is not None else None, dim=0)


def _add(weight: torch.Tensor, delta: torch.Tensor, rows: Sequence[int] | None, dim: int) -> None:
    """weight += delta, or only its `rows` along `dim`: summed in fp32, rounded once to the
    weight's dtype (a 16-bit export)."""
    if rows is None:
        weight.copy_(weight.float() + delta)
        return
    index = torch.tensor(list(rows), device=weight.device)
    merged = weight.index_select(dim, index).float() + delta
    weight.index_copy_(dim, index, merged.to(weight.dtype))


def _untie_unembedding(model: nn.Module) -> None:
    """Give the unembedding its own weight where it shares the input embeddings': a LoRA on it must
    not reach the embeddings, and the saved model must not tie them again."""
    head, embeddings = model.get_output_embeddings(), model.get_input_embeddings()
    if head.weight is not embeddings.weight:
        return
    head.weight = nn.Parameter(head.weight.detach().clone())
    for config in {id(c): c for c in (model.config, model.config.get_text_config())}.values():
        config.tie_word_embeddings = False
