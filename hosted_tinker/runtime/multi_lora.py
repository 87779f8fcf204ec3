"""`MultiLoRALinear`: one frozen base projection, many tenants' LoRA adapters, one pass.

Why not PEFT's layer: PEFT's mixed-adapter batching (`adapter_names=`) refuses to run in train
mode and loops per adapter anyway, and PEFT keeps one *active* adapter per model. A shared
training server needs every row of a batch to go through its own tenant's adapter, forward and
backward, in one call. So each wrapped projection holds the adapters of all live models, and a
shared `LoRARouting` says which rows of the current batch belong to which adapter.

The rows of a batch are laid out in contiguous segments, one per (adapter, run of rows); the
layer computes the base projection once for the whole batch and adds each segment's low-rank
delta. A segment with no adapter (base-model sampling, or a model that does not adapt this
projection) adds nothing. Adapter weights are plain float32 leaf tensors owned by their adapter,
so gradients and optimizer state can never leak from one tenant to another.

The delta is computed exactly as PEFT does (`lora_B(lora_A(x)) * scaling`), so a checkpoint
exported in PEFT's format reproduces our logprobs in PEFT.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from torch import nn


@dataclass
class LoRAWeights:
    """One adapter's low-rank factors for one projection: delta(x) = (x @ A.T @ B.T) * scaling."""

    A: torch.Tensor  # [rank, in_features], float32 leaf
    B: torch.Tensor  # [out_features, rank], float32 leaf
    scaling: float


@dataclass
class LoRARouting:
    """Row layout of the batch being run: a list of (adapter_id or None, row_start, row_end).

    Set by the runtime before each forward; read by every `MultiLoRALinear`. Rows are dim 0
    of the projection input ([rows, seq, features] or [rows, features]).
    """

    segments: list[tuple[str | None, int, int]] = field(default_factory=list)

    def set_single(self, adapter_id: str | None, rows: int) -> None:
        self.segments = [(adapter_id, 0, rows)]


class MultiLoRALinear(nn.Module):
    """A frozen `nn.Linear` plus the LoRA adapters of every live model that adapts it."""

    def __init__(self, base: nn.Linear, routing: LoRARouting):
        super().__init__()
        self.base = base
        self.routing = routing
        # Not registered as parameters: `model.parameters()` stays the frozen base only, and
        # each adapter's tensors are owned (and optimised) by that adapter alone.
        self.adapters: dict[str, LoRAWeights] = {}

    @property
    def in_features(self) -> int:
        return self.base.in_features

    @property
    def out_features(self) -> int:
        return self.base.out_features

    @property
    def weight(self) -> torch.Tensor:  # some HF code (tied embeddings, dtype probes) reads .weight
        return self.base.weight

    @staticmethod
    def _delta(x: torch.Tensor, w: LoRAWeights) -> torch.Tensor:
        A, B = w.A, w.B
        if A.dtype != x.dtype:  # bf16 base on GPU: fp32 master weights, cast in the graph
            A, B = A.to(x.dtype), B.to(x.dtype)
        return F.linear(F.linear(x, A), B) * w.scaling

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        result = self.base(x)
        segments = self.routing.segments
        if not self.adapters or not segments:
            return result
        if len(segments) == 1:
            adapter_id, start, end = segments[0]
            w = self.adapters.get(adapter_id) if adapter_id is not None else None
            if w is None:
                return result
            if start == 0 and end == x.shape[0]:
                return result + self._delta(x, w)
        parts: list[torch.Tensor] = []
        any_adapter = False
        # One split, not a slice per segment: the backward of N slices would zero-fill and add
        # N batch-sized gradients; a split stitches the pieces' gradients together once.
        pieces = torch.split(x, [end - start for _, start, end in segments], dim=0)
        for (adapter_id, start, end), piece in zip(segments, pieces):
            w = self.adapters.get(adapter_id) if adapter_id is not None else None
            if w is None:
                parts.append(result.new_zeros((end - start,) + result.shape[1:]))
            else:
                parts.append(self._delta(piece, w))
                any_adapter = True
        if not any_adapter:
            return result
        return result + torch.cat(parts, dim=0)


# Leaf module names of the projections each `train_*` flag adapts. These are the names used by
# Qwen2/Qwen3, Llama, Mistral and most decoder-only families in transformers.
ATTN_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj")
MLP_TARGETS = ("gate_proj", "up_proj", "down_proj")
UNEMBED_TARGETS = ("lm_head",)


def attach_multi_lora(model: nn.Module, routing: LoRARouting) -> dict[str, MultiLoRALinear]:
    """Replace every adaptable `nn.Linear` of `model` by a `MultiLoRALinear` (in place).

    Returns {dotted module path: layer}, e.g. "model.layers.0.self_attn.q_proj". Paths are the
    ones PEFT uses under "base_model.model.", which keeps checkpoint key names standard.
    """
    targets = set(ATTN_TARGETS + MLP_TARGETS + UNEMBED_TARGETS)
    found: list[tuple[str, nn.Module, str, nn.Linear]] = []
    for path, module in model.named_modules():
        for child_name, child in module.named_children():
            if child_name in targets and isinstance(child, nn.Linear):
                full = f"{path}.{child_name}" if path else child_name
                found.append((full, module, child_name, child))
    layers: dict[str, MultiLoRALinear] = {}
    for full, parent, child_name, child in found:
        layer = MultiLoRALinear(child, routing)
        setattr(parent, child_name, layer)
        layers[full] = layer
    if not layers:
        raise ValueError(
            "found no adaptable projections (q/k/v/o_proj, gate/up/down_proj, lm_head) in the model"
        )
    return layers


def module_kind(path: str) -> str:
    """'attn', 'mlp' or 'unembed' for a dotted module path."""
    leaf = path.rsplit(".", 1)[-1]
    if leaf in ATTN_TARGETS:
        return "attn"
    if leaf in MLP_TARGETS:
        return "mlp"
    return "unembed"
