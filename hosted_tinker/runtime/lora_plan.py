"""The per-batch plan of the LoRA layers: which row blocks go through which adapter slots.

The plan (as vLLM's punica wrapper computes it in `update_metadata`): the runtime sets the row
layout of a batch once (`LoRARouting.batch(segments)`), and the first layer of each kind that
runs turns it into a `LayerPlan` -- which row blocks go through which slots, with the slot
indices already on the device -- that every other layer of that kind reuses; plans are kept
per row layout, so the next step of a training loop builds none. Consecutive segments of the
same rank, scaling and row count form one group: two batched matmuls for the group instead of
ops per tenant, and the backward adds the group's weight gradients straight into the layer's
gradient stack (one in-place add over the group's slots, not one per tenant), as Megatron's
fused gradient accumulation writes `main_grad` in its backward. On an fp32 base, where the
group's slots are consecutive (the usual case) the matmuls are autograd's own nodes on views of
the stack (`lora_delta`, `SlotStack.leaves`) and that add is autograd's AccumulateGrad; every
other call (a canonical pair, slots out of order, and every call of a 16-bit base, whose LoRA
math is bf16 with fp32 accumulation, its weight gradients summed per datum in fp32:
`lora_forward`, `weight_grad`) runs the `GroupedLoRA` function, which adds the gradients in place
on consecutive slots and by index otherwise. Both run the same kernels on the same layouts. The
sampler's decode steps ask for no exactness (`LoRARouting.batch(exact=False)`): every adapter of a
step in one call per projection, run without autograd.
"""

from __future__ import annotations

import heapq
from contextlib import contextmanager
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from .lora_slots import AdapterSlots, LoRACall, LoRAWeights

if TYPE_CHECKING:
    from .invariance import FusionPolicy


@dataclass(frozen=True)
class LayerPlan:
    """How one kind of layer runs the current batch: consecutive row blocks, each with its call
    (None = rows without an adapter in this layer). Shared by every layer of that kind."""

    sizes: list[int]
    calls: list[LoRACall | None]


# Row layouts whose plans `LoRARouting` keeps at most (then it starts over).
PLAN_CACHE_LAYOUTS = 256


class LoRARouting:
    """Shared by every `MultiLoRALinear` of a model: slot allocation and the current batch's plan.

    Slots are allocated per rank and an adapter holds the same slot index in every layer, so one
    plan (slot indices on the device) serves every layer with the same adapters.
    """

    def __init__(self, policy: "FusionPolicy | None" = None):
        self.policy = policy  # None: never group tenants (always each tenant's canonical pair)
        self.segments: list[tuple[str | None, int, int]] = []
        self.exact = True  # see `batch`
        # Plans are kept across batches, per row layout (a training loop repeats its layouts every
        # step): {(segments, CPU threads): {layer key: plan}}. A plan reads the adapters' slots,
        # so allocating or freeing a slot drops them all.
        self._plan_cache: dict[tuple, dict[tuple, object]] = {}  # see `_drop_plans`
        self._plans: dict[tuple, object] = {}  # LayerPlans, and what `per_layout` keeps
        # The plans of the last batch: a CUDA graph captured over them keeps them, and so the slot
        # index tensors its kernels read, alive after `_drop_plans` (runtime/graphs.py).
        self.last_plans: dict[tuple, object] = {}
        self._slot_tensors: dict[tuple[int, ...], torch.Tensor] = {}
        self._free: dict[int, list[int]] = {}  # rank -> freed slots (a heap: lowest first)
        self._next: dict[int, int] = {}
        # Interned sets of adapter ids (one object per distinct set, kept while a layer has it):
        # layers with the same adapters share plans, and a plan lookup compares by identity.
        self._sets: dict[frozenset[str], frozenset[str]] = {}
        self._set_users: dict[frozenset[str], int] = {}
        self._anchors: dict[torch.device, torch.Tensor] = {}
        # Bumped whenever a slot stack moves to new storage (it grows): CUDA graphs captured over
        # the old storage are stale (runtime/graphs.py).
        self.storage_version = 0
        # Bumped whenever a slot is allocated or freed: a graph captured over a plan's slots (the
        # sampler's decode steps, which key on adapter ids) is stale once an id may have moved.
        self.slot_version = 0

    def storage_moved(self) -> None:
        self.storage_version += 1

    # -- slots -------------------------------------------------------------------------------
    def _drop_plans(self) -> None:
        """Forget every kept plan and the slot index tensors they used (both bounded so)."""
        self._plan_cache.clear()
        self._slot_tensors.clear()

    def allocate(self, rank: int) -> int:
        self._drop_plans()
        self.slot_version += 1
        free = self._free.setdefault(rank, [])
        if free:
            return heapq.heappop(free)
        slot = self._next.get(rank, 0)
        self._next[rank] = slot + 1
        return slot

    def release(self, rank: int, slot: int) -> None:
        self._drop_plans()
        self.slot_version += 1
        heapq.heappush(self._free.setdefault(rank, []), slot)

    def grad_anchor(self, device: torch.device) -> torch.Tensor:
        """A leaf that requires grad, one per device: the input that makes autograd run
        `GroupedLoRA.backward` even where the projection input needs no gradient."""
        t = self._anchors.get(device)
        if t is None:
            t = self._anchors[device] = torch.zeros((), device=device, requires_grad=True)
        return t

    def member_set(self, adapter_ids, previous: frozenset[str] | None) -> frozenset[str]:
        """The interned set of `adapter_ids`, for a layer whose set was `previous`."""
        key = frozenset(adapter_ids)
        key = self._sets.setdefault(key, key)
        self._set_users[key] = self._set_users.get(key, 0) + 1
        if previous is not None:
            self._set_users[previous] -= 1
            if not self._set_users[previous]:
                del self._set_users[previous], self._sets[previous]
        return key

    # -- the batch -----------------------------------------------------------------------------
    @contextmanager
    def batch(self, segments: list[tuple[str | None, int, int]], *, exact: bool = True):
        """Route rows to adapters while the body runs: segments are (adapter id or None, start, end)
        over dim 0 of every projection input ([rows, seq, features] or [rows, features]).

        `exact=False` (the sampler's decode steps, on every device; sampling/step.py lays their
        rows out in equal blocks per adapter): tenants of one shape share one LoRA call without a
        probe, and the calls run without an autograd Function -- a decode step's few rows per
        tenant made canonical pairs and Python functions its cost (measured on an H200: 270 ms per
        step for 64 rows over 4 adapters, against 68 ms before fp32 LoRA math)."""
        self.segments = segments
        self.exact = exact
        # The fusion policy's answers depend on the CPU thread count (see invariance.py).
        layout = (tuple(segments), torch.get_num_threads(), exact)
        plans = self._plan_cache.get(layout)
        if plans is None:
            if len(self._plan_cache) >= PLAN_CACHE_LAYOUTS:  # the sampler's layouts vary every step
                self._drop_plans()
            plans = self._plan_cache[layout] = {}
        self._plans = self.last_plans = plans
        try:
            yield
        finally:
            self.segments = []
            self._plans = {}

    def per_layout(self, key: tuple, make):
        """`make()`, computed once per row layout and kept with the layout's plans (and so alive
        with a CUDA graph captured over them, and dropped when a slot is allocated or freed): the
        MoE layers' pair layouts and LoRA runs (runtime/moe_lora.py). Outside a batch, made anew."""
        if not self.segments:
            return make()
        try:
            return self._plans[key]
        except KeyError:
            got = self._plans[key] = make()
            return got

    def plan_for(self, layer: AdapterSlots, x: torch.Tensor) -> LayerPlan | None:
        if not self.segments or not layer.adapters:
            return None
        tokens_per_row = x.numel() // max(1, x.shape[0] * x.shape[-1])
        key = (layer.members, layer.in_features, layer.out_features, tokens_per_row, x.dtype)
        try:
            return self._plans[key]
        except KeyError:
            plan = self._plans[key] = self._build(layer, tokens_per_row, x.dtype, x.device)
            return plan

    def _build(self, layer: AdapterSlots, tokens_per_row: int, dtype: torch.dtype,
               device: torch.device) -> LayerPlan | None:
        # (rows, group key, adapters): consecutive segments of one key form one group.
        parts: list[tuple[int, tuple | None, list[LoRAWeights]]] = []
        for adapter_id, start, end in self.segments:
            w = layer.adapters.get(adapter_id) if adapter_id is not None else None
            key = None if w is None else (w.rank, w.scaling, end - start)
            if parts and parts[-1][1] == key:
                rows, _, ws = parts[-1]
                parts[-1] = (rows + end - start, key, ws + ([w] if w is not None else []))
            else:
                parts.append((end - start, key, [w] if w is not None else []))
        if all(key is None for _, key, _ in parts):
            return None
        sizes: list[int] = []
        calls: list[LoRACall | None] = []
        for rows, key, ws in parts:
            if key is None:
                sizes.append(rows)
                calls.append(None)
                continue
            rank, scaling, per = key
            tokens = per * tokens_per_row

            def proven(n: int) -> bool:  # n entries in one batch give each its canonical pair's bits
                if not self.exact:
                    return True
                return self.policy is not None and self.policy.group_lora(
                    tokens, layer.in_features, layer.out_features, rank, n, dtype,
                    per if dtype == torch.bfloat16 else 1)

            for group in ([ws] if len(ws) >= 2 and proven(len(ws)) else [[w] for w in ws]):
                slots = [w.slot for w in group]
                sizes.append(per * len(group))
                consecutive = slots == list(range(slots[0], slots[0] + len(group)))
                if len(slots) == 1 and not proven(1):
                    slots = slots * 2  # the canonical pair (see GroupedLoRA)
                calls.append(LoRACall(rank, len(group), per, self.slot_tensor(slots, device), scaling,
                                      slots[0] if consecutive else None, len(slots) != len(group)))
        return LayerPlan(sizes, calls)

    def slot_tensor(self, slots: list[int], device: torch.device) -> torch.Tensor:
        """`slots` as a long tensor on `device`, made once until a slot is allocated or freed."""
        key = tuple(slots)
        t = self._slot_tensors.get(key)
        if t is None:
            t = self._slot_tensors[key] = torch.tensor(slots, dtype=torch.long, device=device)
        return t

