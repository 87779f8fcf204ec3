"""Where a projection's LoRA adapters live: one slot per adapter in a stack per rank.

Storage (as vLLM's LoRA layers keep it): each wrapped projection holds, per LoRA rank, one
preallocated stack of adapter slots -- A [slots, rank, in], B [slots, out, rank], and their
gradients [slots, ...] -- and every live adapter occupies one slot (the same index in every
layer). An adapter's own tensors (`LoRAWeights.A/B`, what the optimizer, checkpoints and tests
see) are views of its slot while it is live, and plain tensors while it is paged out.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


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

    def weight_span(self, lo: int, hi: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The weight rows (A, B) of slots lo..hi-1 (views): the optimizer checks the stepped
        adapters' weights through them."""
        return self.A[lo:hi], self.B[lo:hi]

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
