"""`MultiLoRALinear`: one frozen base projection, many tenants' LoRA adapters, one pass.

Why not PEFT's layer: PEFT's mixed-adapter batching (`adapter_names=`) refuses to run in train
mode and loops per adapter anyway, and PEFT keeps one *active* adapter per model. A shared
training server needs every row of a batch to go through its own tenant's adapter, forward and
backward, in one call. So each wrapped projection holds the adapters of all live models, and a
shared `LoRARouting` says which rows of the current batch belong to which adapter.

The rows of a batch are laid out in contiguous segments, one per (adapter, run of rows); the
layer computes the base projection once for the whole batch and adds each segment's low-rank
delta. Consecutive segments of the same rank and row count are computed together by two batched
matmuls, so the number of ops does not grow with the number of tenants. A segment with no
adapter (base-model sampling, or a model that does not adapt this projection) adds nothing. Adapter weights are plain float32 leaf tensors owned by their adapter,
so gradients and optimizer state can never leak from one tenant to another.

The delta is PEFT's (`lora_B(lora_A(x)) * scaling`, same operand order), so a checkpoint
exported in PEFT's format reproduces our logprobs in PEFT (to float rounding: a batched matmul
and PEFT's F.linear may round differently).
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


# Adapters of rank >= this go through batched matmuls, alone or with others. Every adapter takes
# the same path whether it runs alone or co-batched (the path depends on its own rank only), which
# is what keeps co-batching bit-exact: on CPU a `bmm` gives each batch entry the same bits for
# any batch size, except (measured, torch 2.13) when the rank is 1, where bmm of one and of many
# entries take different kernels. Rank-1 adapters therefore keep one F.linear pair per segment.
BATCHED_MIN_RANK = 2


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
        """One adapter's delta over its rows (the path of rank < BATCHED_MIN_RANK adapters)."""
        A, B = w.A, w.B
        if A.dtype != x.dtype:  # bf16 base on GPU: fp32 master weights, cast in the graph
            A, B = A.to(x.dtype), B.to(x.dtype)
        return F.linear(F.linear(x, A), B) * w.scaling

    @staticmethod
    def _batched_delta(x: torch.Tensor, ws: list[LoRAWeights]) -> torch.Tensor:
        """The deltas of n same-shape segments in two batched matmuls: x is n equal row blocks.

        Two `bmm`s per group instead of three ops per tenant: with many small tenants the
        per-segment ops (and their backward) cost more than the tenants' actual compute.
        """
        n = len(ws)
        xs = x.reshape(n, -1, x.shape[-1])  # [n, rows*seq, in]; a view (segments are contiguous)
        A = ws[0].A.unsqueeze(0) if n == 1 else torch.stack([w.A for w in ws])  # [n, r, in]
        B = ws[0].B.unsqueeze(0) if n == 1 else torch.stack([w.B for w in ws])  # [n, out, r]
        if A.dtype != x.dtype:
            A, B = A.to(x.dtype), B.to(x.dtype)
        d = torch.bmm(torch.bmm(xs, A.transpose(1, 2)), B.transpose(1, 2)) * ws[0].scaling
        return d.reshape(x.shape[:-1] + (B.shape[1],))

    def _plan(self, segments) -> list[tuple[int, int, list[LoRAWeights]]]:
        """Cut the batch into (start, end, adapters): consecutive segments of the same rank,
        scaling and row count become one batched group; rows without an adapter here get []."""
        plan: list[tuple[int, int, list[LoRAWeights]]] = []
        last_key = None
        for adapter_id, start, end in segments:
            w = self.adapters.get(adapter_id) if adapter_id is not None else None
            if w is None:
                key = "no adapter"  # consecutive gaps merge into one
            elif w.A.shape[0] < BATCHED_MIN_RANK:
                key = None  # never grouped with anything
            else:
                key = (w.A.shape[0], w.scaling, w.A.dtype, end - start)
            if plan and key is not None and key == last_key:
                s0, _, ws = plan[-1]
                plan[-1] = (s0, end, ws + [w] if w is not None else ws)
            else:
                plan.append((start, end, [w] if w is not None else []))
            last_key = key
        return plan

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        result = self.base(x)
        segments = self.routing.segments
        if not self.adapters or not segments:
            return result
        plan = self._plan(segments)
        if len(plan) == 1 and plan[0][1] - plan[0][0] == x.shape[0]:
            ws = plan[0][2]
            if not ws:
                return result
            return result + self._delta_of(x, ws)
        parts: list[torch.Tensor] = []
        any_adapter = False
        # One split, not a slice per segment: the backward of N slices would zero-fill and add
        # N batch-sized gradients; a split stitches the pieces' gradients together once.
        pieces = torch.split(x, [end - start for start, end, _ in plan], dim=0)
        for (start, end, ws), piece in zip(plan, pieces):
            if not ws:
                parts.append(result.new_zeros((end - start,) + result.shape[1:]))
            else:
                parts.append(self._delta_of(piece, ws))
                any_adapter = True
        if not any_adapter:
            return result
        return result + torch.cat(parts, dim=0)

    def _delta_of(self, x: torch.Tensor, ws: list[LoRAWeights]) -> torch.Tensor:
        if ws[0].A.shape[0] < BATCHED_MIN_RANK:
            return self._delta(x, ws[0])
        return self._batched_delta(x, ws)


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
