"""`MultiLoRALinear`: one frozen base projection, many tenants' LoRA adapters, one pass.

Why not PEFT's layer: PEFT's mixed-adapter batching (`adapter_names=`) refuses to run in train
mode and loops per adapter anyway, and PEFT keeps one *active* adapter per model. A shared
training server needs every row of a batch to go through its own tenant's adapter, forward and
backward, in one call.

Storage (as vLLM's LoRA layers keep it): each wrapped projection holds, per LoRA rank, one
preallocated stack of adapter slots -- A [slots, rank, in], B [slots, out, rank], and their
gradients [slots, ...] -- and every live adapter occupies one slot (the same index in every
layer). An adapter's own tensors (`LoRAWeights.A/B`, what the optimizer, checkpoints and tests
see) are views of its slot while it is live, and plain tensors while it is paged out.

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
math is fp32: `lora_forward`) runs the `GroupedLoRA` function, which adds the gradients in place
on consecutive slots and by index otherwise. Both run the same kernels on the same layouts. The
sampler on CUDA asks for no exactness (`LoRARouting.batch(exact=False)`) and runs its calls as
plain functions.

Exactness: a tenant's bits may not depend on who shares a call with it. Measured on CPU (torch
2.13, MKL): a `bmm` gives entry 0 different bits when it holds 1 entry than when it holds 2 or
more (14-18 of 72 LoRA shapes), while batches of 2, 3, 4, 8 and 16 entries all agree. So the
canonical computation of one tenant's delta is a batch of two -- the tenant and a copy of
itself -- and a batch of n tenants (n = 1 included) runs only where `FusionPolicy.group_lora`
has checked, for that shape on this machine, that it gives every entry its canonical bits;
otherwise each tenant runs its own canonical pair.

The delta is PEFT's (`lora_B(lora_A(x)) * scaling`), so a checkpoint exported in PEFT's format
reproduces our logprobs in PEFT (to float rounding).
"""

from __future__ import annotations

import heapq
from contextlib import contextmanager
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F
from torch import nn

from .projections import ROLES, Projection, SplitProjection, as_linear

if TYPE_CHECKING:
    from .invariance import FusionPolicy


@dataclass(eq=False)
class LoRAWeights:
    """One adapter's low-rank factors for one projection: delta(x) = (x @ A.T @ B.T) * scaling.

    `A` and `B` keep their identity for the adapter's whole life (the optimizer's state is keyed
    by them); while the adapter is live they alias its slot of the layer's `SlotStack`.
    """

    A: torch.Tensor  # [rank, in_features], float32
    B: torch.Tensor  # [out_features, rank], float32
    scaling: float
    slot: int | None = None  # while live: the slot, its stack, and views of the slot's gradient rows
    stack: "SlotStack | None" = None
    grad_views: tuple[torch.Tensor, torch.Tensor] | None = None

    @property
    def rank(self) -> int:
        return self.A.shape[-2]  # A is [rank, in], or [experts, rank, in] (runtime/moe_lora.py)


class SlotStack:
    """One layer's adapters of one rank: weights and gradients, one row (slot) per adapter.

    Grows by doubling when a slot past its end is needed (re-pointing the live adapters' views);
    never shrinks (the slot count is bounded by the live adapters plus sampler snapshots).
    """

    def __init__(self, rank: int, in_features: int, out_features: int, device: torch.device,
                 on_grow=lambda: None, lead: tuple[int, ...] = ()):
        self.rank = rank
        self.lead = lead  # per-slot leading dims: (experts,) for MoE experts (runtime/moe_lora.py)
        self._on_grow = on_grow  # new storage: what was captured over the old one is stale
        self.in_features = in_features
        self.out_features = out_features
        self.device = device
        self.capacity = 0
        self.A = self.B = self.grad_A = self.grad_B = torch.empty(0)
        self.owners: dict[int, LoRAWeights] = {}
        self._leaves: dict[tuple[int, int], tuple[torch.Tensor, torch.Tensor]] = {}
        self._grad_spans: dict[tuple[int, int], tuple[torch.Tensor, torch.Tensor]] = {}
        self._grow(4)

    def _grow(self, capacity: int) -> None:
        def bigger(old: torch.Tensor, *shape: int) -> torch.Tensor:
            t = torch.zeros(capacity, *shape, device=self.device)
            if self.capacity:
                t[:self.capacity] = old
            return t

        r, i, o = self.rank, self.in_features, self.out_features
        with torch.no_grad():
            self.A, self.B = bigger(self.A, *self.lead, r, i), bigger(self.B, *self.lead, o, r)
            self.grad_A, self.grad_B = bigger(self.grad_A, *self.lead, r, i), bigger(self.grad_B, *self.lead, o, r)
        if self.capacity:
            self._on_grow()
        self.capacity = capacity
        self._leaves.clear()  # views of the old tensors
        self._grad_spans.clear()
        for slot, w in self.owners.items():
            self._alias(slot, w)

    def _alias(self, slot: int, w: LoRAWeights) -> None:
        pending = w.A.grad is not None
        w.A.grad = w.B.grad = None  # a tensor's gradient must stay on its device while it moves
        w.A.data, w.B.data = self.A[slot], self.B[slot]
        w.grad_views = (self.grad_A[slot], self.grad_B[slot])
        if pending:
            w.A.grad, w.B.grad = w.grad_views

    def put(self, slot: int, w: LoRAWeights) -> None:
        """Copy an adapter's tensors (and pending gradients) into `slot`; alias them to it."""
        if slot >= self.capacity:
            self._grow(max(2 * self.capacity, slot + 1))
        with torch.no_grad():
            self.A[slot].copy_(w.A)
            self.B[slot].copy_(w.B)
            if w.A.grad is not None:
                self.grad_A[slot].copy_(w.A.grad)
                self.grad_B[slot].copy_(w.B.grad)
            else:
                self.grad_A[slot].zero_()
                self.grad_B[slot].zero_()
        self.owners[slot] = w
        w.slot, w.stack = slot, self
        self._alias(slot, w)

    def take(self, slot: int, w: LoRAWeights, device: torch.device) -> None:
        """Copy `slot` out into tensors of the adapter's own on `device`; free the slot."""
        pending = w.A.grad is not None
        w.A.grad = w.B.grad = None
        with torch.no_grad():
            w.A.data = self.A[slot].to(device, copy=True)
            w.B.data = self.B[slot].to(device, copy=True)
            if pending:
                w.A.grad = self.grad_A[slot].to(device, copy=True)
                w.B.grad = self.grad_B[slot].to(device, copy=True)
        del self.owners[slot]
        w.slot = w.stack = w.grad_views = None

    def factors(self, call: "LoRACall") -> tuple[torch.Tensor, torch.Tensor]:
        """A [entries, r, in] and B [entries, out, r] of a `GroupedLoRA` call: views of consecutive
        slots, else gathered (a canonical pair, or slots out of order)."""
        if call.first is not None and not call.pair:
            return self.A[call.first:call.first + call.n], self.B[call.first:call.first + call.n]
        return self.A.index_select(0, call.slots), self.B.index_select(0, call.slots)

    def leaves(self, first: int, n: int) -> tuple[torch.Tensor, torch.Tensor]:
        """A.T [n, in, r] and B.T [n, r, out] of slots first..first+n-1 as autograd leaves whose
        `.grad` is those slots' gradient rows: autograd's own AccumulateGrad adds each backward's
        weight gradients into the rows in place (it adds into a `.grad` that is already there).
        Made once per slot span and kept: they are views, valid until the stack grows."""
        got = self._leaves.get((first, n))
        if got is None:
            end = first + n
            At = self.A[first:end].transpose(1, 2).detach().requires_grad_()
            Bt = self.B[first:end].transpose(1, 2).detach().requires_grad_()
            At.grad = self.grad_A[first:end].transpose(1, 2)
            Bt.grad = self.grad_B[first:end].transpose(1, 2)
            got = self._leaves[(first, n)] = (At, Bt)
        return got

    def grad_span(self, lo: int, hi: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The gradient rows of slots lo..hi-1 (views, kept until the stack grows): the optimizer
        reduces and zeroes the slots of the adapters it steps through them every step."""
        got = self._grad_spans.get((lo, hi))
        if got is None:
            got = self._grad_spans[(lo, hi)] = (self.grad_A[lo:hi], self.grad_B[lo:hi])
        return got

    def accumulate(self, call: "LoRACall", grad_A: torch.Tensor, grad_B: torch.Tensor) -> None:
        """Add a `GroupedLoRA` call's weight gradients ([n, ...], one per tenant, fp32) to its slots'
        gradient rows: in place on the rows of consecutive slots (one tenant included), by index
        otherwise (distinct slots: one addition per element either way)."""
        if call.first is not None:
            self.grad_A[call.first:call.first + call.n].add_(grad_A)
            self.grad_B[call.first:call.first + call.n].add_(grad_B)
            return
        slots = call.slots[:call.n]
        self.grad_A.index_add_(0, slots, grad_A)
        self.grad_B.index_add_(0, slots, grad_B)


# ---- the grouped LoRA kernel -----------------------------------------------------------------
def lora_forward(xs: torch.Tensor, A: torch.Tensor, B: torch.Tensor, scaling: float):
    """n adapters' deltas in two batched matmuls: xs [n, M, in], A [n, r, in], B [n, out, r].

    Computed in the factors' dtype (the fp32 master weights) whatever the activations' dtype: on
    a 16-bit base the shrink, expand and weight gradients are fp32 GEMMs (a few % of a layer's
    FLOPs at rank 16), so a micro-batch's gradient is not rounded to 16 bits before it is added
    to the others'. Measured on an H200, 8 datums as 1 x 8 or 2 x 4 micro-batches: logprobs
    after an AdamW step differed by 1.6e-2 with 16-bit LoRA GEMMs and by 0 with fp32 ones."""
    h = torch.bmm(xs.to(A.dtype), A.transpose(1, 2))  # [n, M, r]
    return h, torch.bmm(h, B.transpose(1, 2)) * scaling  # [n, M, out]


def lora_delta(xs: torch.Tensor, At: torch.Tensor, Bt: torch.Tensor, scaling: float) -> torch.Tensor:
    """`lora_forward`'s delta recorded by autograd, from `SlotStack.leaves` (A.T, B.T).

    The same kernels on the same layouts as `GroupedLoRA` (and so as the fusion probe, which runs
    `lora_forward`/`lora_backward`): autograd's bmm backward takes g = grad * scaling, grad_h =
    g @ B, grad_Bt = h.T @ g, grad_xs = grad_h @ A and grad_At = xs.T @ grad_h, the incoming
    gradient in the layout autograd hands over, as `GroupedLoRA.backward` takes it. Without a
    Python autograd Function (or a Python hook: ~15 us a call) a layer's LoRA costs about 80 us
    less per forward and backward on the embedded model (2 cores), and the weight gradients are
    added by AccumulateGrad in C++.
    """
    return torch.bmm(torch.bmm(xs, At), Bt) * scaling


def lora_backward(gd: torch.Tensor, xs: torch.Tensor, A: torch.Tensor, B: torch.Tensor, h: torch.Tensor,
                  scaling: float, need_x: bool):
    """Gradients of `lora_forward` w.r.t. xs (if need_x, in xs's dtype), A and B (in theirs), as
    autograd would take them."""
    g = gd.to(A.dtype) * scaling
    grad_B = torch.bmm(h.transpose(1, 2), g).transpose(1, 2)  # [n, out, r]
    gh = torch.bmm(g, B)  # [n, M, r]
    grad_A = torch.bmm(xs.to(A.dtype).transpose(1, 2), gh).transpose(1, 2)  # [n, r, in]
    grad_x = torch.bmm(gh, A).to(xs.dtype) if need_x else None
    return grad_x, grad_A, grad_B


class GroupedLoRA(torch.autograd.Function):
    """Deltas of `x.shape[0]` tenants (equal row blocks) through their slots of one `SlotStack`.

    forward(x [n, M, in], anchor, stack, call, out_dtype) -> [n, M, out]: `call.slots` has n
    entries, or two (the same slot twice) where one tenant runs as its canonical pair. The weight
    gradients go straight into the stack's gradient rows (nothing is returned for them); `anchor`
    is a leaf that requires grad, so the backward runs even where x needs no gradient. x is saved
    in its own dtype (a 16-bit activation the base keeps anyway) and cast to fp32 in the backward.
    Runs the calls that `lora_delta` does not: pairs, slots out of order, and a 16-bit base's.
    """

    @staticmethod
    def forward(ctx, x, anchor, stack: SlotStack, call: "LoRACall", out_dtype: torch.dtype):
        A, B = stack.factors(call)
        h, d = lora_forward(torch.cat([x, x]) if call.pair else x, A, B, call.scaling)
        ctx.save_for_backward(x, A, B, h)
        ctx.stack, ctx.call = stack, call
        return (d[:1] if call.pair else d).to(out_dtype)

    @staticmethod
    def backward(ctx, gd):
        x, A, B, h = ctx.saved_tensors
        call = ctx.call
        if call.pair:
            gd, x = torch.cat([gd, gd]), torch.cat([x, x])
        grad_x, grad_A, grad_B = lora_backward(gd, x, A, B, h, call.scaling, ctx.needs_input_grad[0])
        if call.pair:
            grad_x, grad_A, grad_B = (None if grad_x is None else grad_x[:1]), grad_A[:1], grad_B[:1]
        ctx.stack.accumulate(call, grad_A, grad_B)
        return grad_x, None, None, None, None


class Fp32Linear(torch.autograd.Function):
    """`F.linear(x, weight, bias)` of a frozen 16-bit projection, with a float32 result: the GEMM
    accumulates in fp32 and its output is not rounded to 16 bits. For the unembedding (logits) of
    a 16-bit base on CUDA (`MultiLoRALinear.fp32_output`); the input gradient is the 16-bit GEMM
    autograd would run."""

    @staticmethod
    def forward(ctx, x, weight, bias):
        ctx.weight = weight  # frozen: nothing for autograd to version-check
        out = torch.mm(x.reshape(-1, x.shape[-1]), weight.t(), out_dtype=torch.float32)
        if bias is not None:
            out = out + bias.float()
        return out.reshape(*x.shape[:-1], weight.shape[0])

    @staticmethod
    def backward(ctx, grad_out):
        w = ctx.weight
        gx = torch.mm(grad_out.reshape(-1, grad_out.shape[-1]).to(w.dtype), w)
        return gx.reshape(*grad_out.shape[:-1], w.shape[1]), None, None


def fp32_logits_refused(weight: torch.Tensor) -> str | None:
    """Why `Fp32Linear` cannot serve `weight` on this machine, or None: it must run, and keep a
    row's bits at any row count (the tenants of a micro-batch share the unembedding GEMM)."""
    try:
        gen = torch.Generator(device="cpu").manual_seed(7)
        x = torch.randn(1024, weight.shape[1], generator=gen).to(weight.device, weight.dtype)
        whole = Fp32Linear.apply(x, weight, None)
        for rows in (1, 7, 64, 513):
            if not torch.equal(Fp32Linear.apply(x[:rows], weight, None), whole[:rows]):
                return f"its rows change bits with the row count ({rows} rows alone vs in 1024)"
    except Exception as e:  # a torch without mm(out_dtype=) for this dtype or device
        return f"{type(e).__name__}: {e}"
    return None


class FrozenProjection(torch.autograd.Function):
    """`F.linear(x, weight, bias)` of a frozen projection whose input gradient is read from
    `weight_t`, a contiguous copy of `weight.T` (see `MultiLoRALinear.keep_transposed_weight`).

    autograd takes the input gradient of `F.linear` as `gy @ weight`, reading `weight` [out, in]
    as stored. On CPU, MKL picks its kernel for that layout by the row count: measured single-
    threaded (torch 2.13, AVX-512), rows 0-63 of `gy @ weight` get other bits inside 192+ rows
    than alone for [1024, 256], [1024, 512], [2048, 512] and [4096, 1024] weights -- the
    256x4 benchmark model's `lm_head` among them -- and for every shape tried under AVX2.
    `F.linear(gy, weight_t)` is the forward's own layout, `x @ W.T` with W contiguous, whose
    rows kept their bits at every row count for all those shapes under both kernel settings.
    """

    @staticmethod
    def forward(ctx, x, weight, bias, weight_t):
        ctx.weight_t = weight_t  # frozen: no version to check, nothing to save for autograd
        return F.linear(x, weight, bias)

    @staticmethod
    def backward(ctx, grad_out):
        return F.linear(grad_out, ctx.weight_t), None, None, None


# ---- the batch plan ----------------------------------------------------------------------------
@dataclass(frozen=True)
class LoRACall:
    """One `GroupedLoRA` call: `n` tenants of one rank, `rows` rows each, through `slots`."""

    rank: int
    n: int
    rows: int
    slots: torch.Tensor  # [n] on the device, or [2] (one slot twice) for a canonical pair
    scaling: float
    first: int | None  # the tenants' slots are first, ..., first + n - 1 (see `SlotStack.factors`)
    pair: bool  # one tenant computed as its canonical pair (itself and a copy; module docstring)


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
        self._plan_cache: dict[tuple, dict[tuple, LayerPlan | None]] = {}  # see `_drop_plans`
        self._plans: dict[tuple, LayerPlan | None] = {}
        # The plans of the last batch: a CUDA graph captured over them keeps them, and so the slot
        # index tensors its kernels read, alive after `_drop_plans` (runtime/graphs.py).
        self.last_plans: dict[tuple, LayerPlan | None] = {}
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

    def storage_moved(self) -> None:
        self.storage_version += 1

    # -- slots -------------------------------------------------------------------------------
    def _drop_plans(self) -> None:
        """Forget every kept plan and the slot index tensors they used (both bounded so)."""
        self._plan_cache.clear()
        self._slot_tensors.clear()

    def allocate(self, rank: int) -> int:
        self._drop_plans()
        free = self._free.setdefault(rank, [])
        if free:
            return heapq.heappop(free)
        slot = self._next.get(rank, 0)
        self._next[rank] = slot + 1
        return slot

    def release(self, rank: int, slot: int) -> None:
        self._drop_plans()
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

        `exact=False` (the sampler on CUDA, whose base GEMMs run with torch's defaults and are not
        batch-invariant anyway): tenants of one shape share one LoRA call without a probe, and
        the calls run without an autograd Function -- a decode step's few rows per tenant made
        canonical pairs and Python functions its cost (measured on an H200: 270 ms per step for
        64 rows over 4 adapters, against 68 ms before fp32 LoRA math)."""
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

    def plan_for(self, layer: "MultiLoRALinear", x: torch.Tensor) -> LayerPlan | None:
        if not self.segments or not layer.adapters:
            return None
        tokens_per_row = x.numel() // max(1, x.shape[0] * x.shape[-1])
        key = (layer.members, layer.in_features, layer.out_features, tokens_per_row, x.dtype)
        try:
            return self._plans[key]
        except KeyError:
            plan = self._plans[key] = self._build(layer, tokens_per_row, x.dtype, x.device)
            return plan

    def _build(self, layer: "MultiLoRALinear", tokens_per_row: int, dtype: torch.dtype,
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
                    tokens, layer.in_features, layer.out_features, rank, n, dtype)

            for group in ([ws] if len(ws) >= 2 and proven(len(ws)) else [[w] for w in ws]):
                slots = [w.slot for w in group]
                sizes.append(per * len(group))
                consecutive = slots == list(range(slots[0], slots[0] + len(group)))
                if len(slots) == 1 and not proven(1):
                    slots = slots * 2  # the canonical pair (see GroupedLoRA)
                calls.append(LoRACall(rank, len(group), per, self._slot_tensor(slots, device), scaling,
                                      slots[0] if consecutive else None, len(slots) != len(group)))
        return LayerPlan(sizes, calls)

    def _slot_tensor(self, slots: list[int], device: torch.device) -> torch.Tensor:
        key = tuple(slots)
        t = self._slot_tensors.get(key)
        if t is None:
            t = self._slot_tensors[key] = torch.tensor(slots, dtype=torch.long, device=device)
        return t


@dataclass(frozen=True)
class FusedPart:
    """A component of a fused projection (`projections.SplitProjection`): PEFT and the cookbook
    see the fused module's components as one LoRA on it (`checkpoints.format.to_peft`)."""

    path: str  # the fused module's path
    index: int  # which component, in Tinker's order (q, k, v; gate, up)
    count: int
    rows: tuple[int, ...]  # where its outputs sit in the fused output
    fused_out: int  # the fused output size


class AdapterSlots:
    """The adapters attached to one projection, in slot stacks of their rank: a `MultiLoRALinear`,
    or an expert projection (runtime/moe_lora.py, whose factors lead with the experts). The
    projection sets `routing`, `in_features`, `out_features`, `adapters`, `stacks`, `members`
    and says where its slots live (`slot_device`)."""

    lora_lead: tuple[int, ...] = ()  # LoRA factors are [*lead, rank, in] / [*lead, out, rank]

    @property
    def slot_device(self) -> torch.device:
        raise NotImplementedError

    def attach(self, adapter_id: str, w: LoRAWeights, slot: int) -> None:
        stack = self.stacks.get(w.rank)
        if stack is None:
            stack = self.stacks[w.rank] = SlotStack(w.rank, self.in_features, self.out_features, self.slot_device,
                                                    self.routing.storage_moved, lead=self.lora_lead)
        stack.put(slot, w)
        self.adapters[adapter_id] = w
        self.members = self.routing.member_set(self.adapters, self.members)

    def detach(self, adapter_id: str, device: torch.device) -> None:
        w = self.adapters.pop(adapter_id)
        self.stacks[w.rank].take(w.slot, w, device)
        self.members = self.routing.member_set(self.adapters, self.members)


class MultiLoRALinear(AdapterSlots, nn.Module):
    """A frozen `nn.Linear` plus the LoRA adapters of every live model that adapts it."""

    def __init__(self, base: nn.Linear, routing: LoRARouting, role: str, part: FusedPart | None = None):
        super().__init__()
        self.base = base
        self.routing = routing
        self.role = role  # "attn", "mlp" or "unembed": which train_* flag covers it
        self.part = part  # set for a component of a fused projection
        # Plain attributes, not properties reading `base` (a submodule: nn.Module.__getattr__ per
        # read), as the plan lookup reads them in every layer's forward.
        self.in_features = base.in_features
        self.out_features = base.out_features
        # Not registered as parameters or buffers: `model.parameters()` stays the frozen base.
        self.adapters: dict[str, LoRAWeights] = {}
        self.stacks: dict[int, SlotStack] = {}
        self.members = routing.member_set((), None)  # ids of the adapters attached here
        self.weight_t: torch.Tensor | None = None  # see `keep_transposed_weight`
        self.fp32_output = False  # a 16-bit unembedding with float32 logits (`Fp32Linear`)

    @property
    def weight(self) -> torch.Tensor:  # some HF code (tied embeddings, dtype probes) reads .weight
        return self.base.weight

    @property
    def slot_device(self) -> torch.device:
        return self.base.weight.device

    def keep_transposed_weight(self, keep: bool) -> int:
        """Take the input gradient of the frozen projection from a transposed copy of its weight
        (`FrozenProjection`), or not; returns the bytes the copy holds. The runtime turns this on
        where it lets rows keep their bits in any batch (`TrainingRuntime.check_fusion`)."""
        with torch.no_grad():
            self.weight_t = self.base.weight.t().contiguous() if keep else None
        return 0 if self.weight_t is None else self.weight_t.numel() * self.weight_t.element_size()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.fp32_output:
            result = Fp32Linear.apply(x, self.base.weight, self.base.bias)
        elif self.weight_t is not None and x.requires_grad:
            result = FrozenProjection.apply(x, self.base.weight, self.base.bias, self.weight_t)
        else:
            result = self.base(x)
        plan = self.routing.plan_for(self, x)
        if plan is None:
            return result
        if len(plan.calls) == 1:
            return result + self._delta(x, plan.calls[0], result.dtype)
        # One split of the input, not a slice per block: the backward of N slices would zero-fill
        # and add N batch-sized gradients; a split stitches the pieces' gradients together once.
        # Rows without an adapter keep `result` untouched (no +0 that could flip a -0).
        xs = torch.split(x, plan.sizes)
        rs = torch.split(result, plan.sizes)
        out = [r if call is None else r + self._delta(xp, call, r.dtype) for xp, r, call in zip(xs, rs, plan.calls)]
        return torch.cat(out)

    def _delta(self, x: torch.Tensor, call: LoRACall, out_dtype: torch.dtype) -> torch.Tensor:
        xs = x.reshape(call.n, -1, x.shape[-1])  # a view: the call's row blocks are contiguous
        stack = self.stacks[call.rank]
        if not self.routing.exact:  # the sampler on CUDA (see `LoRARouting.batch`): no autograd
            d = lora_forward(xs, *stack.factors(call), call.scaling)[1].to(out_dtype)
        elif call.first is not None and not call.pair and xs.dtype == stack.A.dtype == out_dtype:
            # fp32 activations, consecutive slots: views of the stack, autograd's own nodes
            d = lora_delta(xs, *stack.leaves(call.first, call.n), call.scaling)
        else:  # a canonical pair, slots out of order, or a 16-bit base (fp32 LoRA math)
            d = GroupedLoRA.apply(xs, self.routing.grad_anchor(x.device), stack, call, out_dtype)
        return d.reshape(x.shape[:-1] + (self.out_features,))


def attach_adapter(layers: dict[str, MultiLoRALinear], adapter_id: str, weights: dict[str, LoRAWeights]) -> None:
    """Give an adapter (training or sampler snapshot) a slot per rank it uses -- the same slot
    index in every layer it adapts -- and copy its weights into them."""
    routing = layers[next(iter(weights))].routing
    slots = {rank: routing.allocate(rank) for rank in sorted({w.rank for w in weights.values()})}
    for path, w in weights.items():
        layers[path].attach(adapter_id, w, slots[w.rank])


def detach_adapter(layers: dict[str, MultiLoRALinear], adapter_id: str, weights: dict[str, LoRAWeights],
                   device: torch.device) -> None:
    """Copy an adapter out of its slots into tensors of its own on `device`; free the slots."""
    freed = {(w.rank, w.slot) for w in weights.values() if w.slot is not None}
    for path, w in weights.items():
        if w.slot is not None:
            layers[path].detach(adapter_id, device)
    routing = layers[next(iter(weights))].routing
    for rank, slot in sorted(freed):
        routing.release(rank, slot)


EXPERT_TARGETS = ("w1", "w2", "w3")  # MoE experts' gate, down, up, Tinker's names (runtime/moe_lora.py)


def attach_multi_lora(model: nn.Module, routing: LoRARouting, projections: list[Projection],
                      moved: dict[str, MultiLoRALinear] | None = None) -> dict[str, MultiLoRALinear]:
    """Put a `MultiLoRALinear` around every projection `discover` found a role for (in place).

    Returns {LoRA path: layer}. A plain projection's path is its module path, e.g.
    "model.layers.0.self_attn.q_proj" (PEFT's names under "base_model.model."); a fused one
    becomes a `SplitProjection` whose components are layers of their own, e.g.
    "model.layers.0.self_attn.qkv_proj.q_proj" (saved in PEFT's form: `FusedPart`). Conv1D
    weights are stored transposed, as an `nn.Linear` keeps them (`as_linear`).

    `moved`: the layers of an earlier copy of the model (a pool reloads its base), with their
    adapters and snapshots, to put around this copy's projections instead of new ones. Expert
    projections are `moe_lora.attach_moe_lora`'s.
    """
    layers: dict[str, MultiLoRALinear] = {}

    def layer(path: str, base: nn.Linear, role: str, part: FusedPart | None = None) -> MultiLoRALinear:
        if moved is None:
            layers[path] = MultiLoRALinear(base, routing, role, part)
            return layers[path]
        old = layers[path] = moved[path]
        if (base.in_features, base.out_features) != (old.in_features, old.out_features):
            raise ValueError(f"{path} is {base.in_features} -> {base.out_features} in the reloaded model, "
                             f"not {old.in_features} -> {old.out_features}")
        old.base = base
        return old

    if moved is not None and any(p.kind == "experts" and p.role in ROLES for p in projections):
        raise ValueError("LoRA on MoE experts does not run in a worker pool yet (its base reload)")
    for proj in projections:
        if proj.role not in ROLES or proj.kind == "experts":
            continue  # experts: moe_lora.py's; unknown projections: `projections.refusal` speaks for them
        parent_path, _, name = proj.path.rpartition(".")
        parent = model.get_submodule(parent_path)
        module = getattr(parent, name)
        if proj.kind == "fused":
            fused_out = sum(len(rows) for _, rows in proj.components)
            parts = {component: layer(f"{proj.path}.{component}", as_linear(module, rows), proj.role,
                                      FusedPart(proj.path, i, len(proj.components), rows, fused_out))
                     for i, (component, rows) in enumerate(proj.components)}
            setattr(parent, name, SplitProjection(parts, tuple(rows for _, rows in proj.components)))
        else:
            setattr(parent, name, layer(proj.path, module if proj.kind == "linear" else as_linear(module), proj.role))
    if not layers:
        raise ValueError("found no adaptable projections (attention, MLP or unembedding) in the model")
    return layers
