"""One tenant's LoRA adapter: its config, its weights in every adapted projection, its optimizer.

An adapter's tensors (`LoRAWeights.A/B` per projection) keep their identity for its whole life.
While it is live they are views of its slot in the layers' `SlotStack`s, and their gradients are
views of the slot's gradient rows (where the fused backward accumulates); paged out, they are
tensors of its own in CPU memory, gradients and AdamW moments included.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

import torch

from ..requests.kinds import AdamParams, LoRAConfig  # noqa: F401 (AdamParams: the runtime's importers take it from here)
from .host_copies import device_constant
from .lora_slots import LoRAWeights, SlotStack
from .multi_lora import FusedPart, MultiLoRALinear, attach_adapter, detach_adapter
from .torch_compat import zero_


class LoRAAdapter:
    """A model's trainable state: LoRA factors for each adapted projection plus AdamW state."""

    def __init__(self, adapter_id: str, config: LoRAConfig, layers: dict[str, MultiLoRALinear],
                 device: torch.device):
        self.adapter_id = adapter_id
        self.config = config
        self.device = device
        self.weights: dict[str, LoRAWeights] = {}
        # Deterministic from the seed alone (not from the global RNG or creation order), so two
        # servers give a model the same initial adapter.
        gen = torch.Generator(device="cpu").manual_seed(config.seed)
        for path in sorted(layers):
            layer = layers[path]
            if not config.adapts(path, layer):
                continue
            # PEFT's default init: A ~ kaiming_uniform(a=sqrt(5)) = U(-1/sqrt(in), 1/sqrt(in)),
            # B = 0, so a fresh adapter leaves the model's outputs unchanged.
            # MoE experts (runtime/moe_lora.py) hold one A and B per expert: lead = (experts,).
            bound = 1.0 / math.sqrt(layer.in_features)
            A = (torch.rand(*layer.lora_lead, config.rank, layer.in_features, generator=gen) * 2 - 1) * bound
            B = torch.zeros(*layer.lora_lead, layer.out_features, config.rank)
            self.weights[path] = LoRAWeights(A=A.to(device), B=B.to(device), scaling=config.scaling)
        if not self.weights:
            raise ValueError("the LoRA config adapts no projection of this model")
        # The LoRA paths that are components of a fused projection (saved as one PEFT LoRA on it).
        self.parts: dict[str, FusedPart] = {p: layers[p].part for p in self.weights if layers[p].part is not None}
        # PEFT's init bounds the weights' norm: |A| <= sqrt(experts x rank) per projection, B = 0.
        self.optimizer = AdamWState(weight_norm=math.sqrt(sum(w.A.numel() / w.A.shape[-1] for w in self.weights.values())))
        self.step = 0
        self._layers: dict[str, MultiLoRALinear] | None = None  # set while live (in the layers' slots)

    # -- tensors ---------------------------------------------------------------------------
    def parameters(self) -> list[torch.Tensor]:
        """Trainable tensors in a fixed order (sorted module path, A then B)."""
        return [t for path in sorted(self.weights) for t in (self.weights[path].A, self.weights[path].B)]

    def named_tensors(self) -> dict[str, torch.Tensor]:
        """PEFT-style names relative to the model root: '<path>.lora_A.weight' etc."""
        out = {}
        for path in sorted(self.weights):
            out[f"{path}.lora_A.weight"] = self.weights[path].A
            out[f"{path}.lora_B.weight"] = self.weights[path].B
        return out

    @property
    def attached(self) -> bool:
        return self._layers is not None

    def slots(self) -> tuple[tuple[int, int], ...]:
        """(rank, slot) of every slot the adapter holds while live (one per rank it uses)."""
        return tuple(sorted({(w.rank, w.slot) for w in self.weights.values() if w.slot is not None}))

    def attach(self, layers: dict[str, MultiLoRALinear]) -> None:
        """Take a slot in the layers (on their device) and move the weights and gradients into it."""
        if self._layers is not None:
            return
        attach_adapter(layers, self.adapter_id, self.weights)
        self._layers = layers
        self._move_optimizer(next(iter(self.weights.values())).A.device)

    def detach(self, layers: dict[str, MultiLoRALinear], device: torch.device | None = None) -> None:
        """Leave the slot: weights and gradients become tensors of the adapter's own on `device`."""
        if self._layers is None:
            return
        detach_adapter(layers, self.adapter_id, self.weights, device or self.device)
        self._layers = None
        self._move_optimizer(device or self.device)

    def move_to(self, device: torch.device) -> None:
        """Put weights, gradients and optimizer moments on `device` (paging to/from CPU memory).
        A live adapter on another device than its slots leaves them (the runtime re-attaches it)."""
        if self._layers is not None and device != self.device:
            self.detach(self._layers, device)
        with torch.no_grad():
            for w in self.weights.values():
                for t in (w.A, w.B):
                    if t.device == device:
                        continue
                    grad = t.grad
                    t.grad = None
                    t.data = t.data.to(device)  # .data swap keeps identity: optimizer keys stay valid
                    if grad is not None:
                        t.grad = grad.to(device)
        self._move_optimizer(device)

    def _move_optimizer(self, device: torch.device) -> None:
        moved: dict[int, torch.Tensor] = {}  # a step counter shared by several tensors stays shared
        for state in self.optimizer.state.values():
            for k, v in state.items():  # "step" too: the fused kernel wants it beside its tensor
                if v.device != device:
                    state[k] = moved.setdefault(id(v), v.to(device))
        self.device = device

    def grad_tensors(self):
        """(tensor, its slot stack or None, 0 for A / 1 for B, slot) for every tensor with a
        gradient, in `parameters()` order; while live, the gradient is row `slot` of the stack's
        gradient rows (`grad_A` / `grad_B`)."""
        for path in sorted(self.weights):
            w = self.weights[path]
            if w.A.grad is None:
                continue
            yield w.A, w.stack, 0, w.slot
            yield w.B, w.stack, 1, w.slot

    # -- gradients ---------------------------------------------------------------------------
    def has_gradients(self) -> bool:
        return any(p.grad is not None for p in self.parameters())

    def zero_grad(self) -> None:
        zero_grads([self])


def zero_grads(adapters: list[LoRAAdapter]) -> None:
    """Drop the adapters' gradients: live ones' gradient rows are zeroed with one op per stack
    (not per adapter and tensor), so stepping many tenants costs what stepping one does; where
    their slots are consecutive (tenants created one after another) in one multi-tensor op."""
    by_stack: dict[int, tuple[SlotStack, list[int]]] = {}
    for adapter in adapters:
        for w in adapter.weights.values():
            if w.A.grad is None:
                continue
            if w.stack is not None:
                by_stack.setdefault(id(w.stack), (w.stack, []))[1].append(w.slot)
            w.A.grad = w.B.grad = None
    spans: list[torch.Tensor] = []
    scattered: list[tuple[SlotStack, list[int]]] = []
    for stack, slots in by_stack.values():
        lo, hi = min(slots), max(slots) + 1
        if hi - lo == len(slots):
            spans += stack.grad_span(lo, hi)
        else:
            scattered.append((stack, slots))
    if spans:
        with torch.no_grad():
            zero_(spans)
    _fill_slots(scattered, 0.0)


def _fill_slots(rows: list[tuple[SlotStack, list[int]]], value: float) -> None:
    """Set the gradient rows `slots` of each stack to `value` (index tensors made once per slot
    list: `host_copies.device_constant`)."""
    with torch.no_grad():
        for stack, slots in rows:
            idx = device_constant(tuple(slots), torch.long, stack.device)
            stack.grad_A.index_fill_(0, idx, value)
            stack.grad_B.index_fill_(0, idx, value)


SavedRows = tuple[SlotStack, torch.Tensor, torch.Tensor, torch.Tensor]


def _save_rows(stack: SlotStack, slots: list[int]) -> SavedRows:
    """A copy of the gradient rows `slots` of `stack`, for `_restore_rows`."""
    with torch.no_grad():
        idx = device_constant(tuple(slots), torch.long, stack.device)
        return stack, idx, stack.grad_A.index_select(0, idx), stack.grad_B.index_select(0, idx)


def _restore_rows(saved: list[SavedRows]) -> None:
    with torch.no_grad():
        for stack, idx, grad_A, grad_B in saved:
            stack.grad_A.index_copy_(0, idx, grad_A)
            stack.grad_B.index_copy_(0, idx, grad_B)


def snapshot_gradient_rows(adapters: list[LoRAAdapter]) -> Callable[[], None]:
    """A copy of the live adapters' gradient rows as they are now (whatever `.grad` says: a pass
    adds into the rows before it exposes them); returns the function that puts them back."""
    saved = [_save_rows(stack, sorted(slots)) for stack, slots in _slots_by_stack(adapters).items()]
    return lambda: _restore_rows(saved)


def _slots_by_stack(adapters: list[LoRAAdapter]) -> dict[SlotStack, set[int]]:
    out: dict[SlotStack, set[int]] = {}
    for adapter in adapters:
        for w in adapter.weights.values():
            if w.stack is not None:
                out.setdefault(w.stack, set()).add(w.slot)
    return out


class GradientPass:
    """Makes a forward/backward pass all-or-nothing for the adapters' gradients.

    The backward adds straight into the live adapters' gradient rows. If the pass fails part
    way, `rollback` puts back what the rows held before it (the gradients of earlier,
    acknowledged forward_backward calls), so a later optim_step applies neither a partial
    gradient nor less than was acknowledged. `commit` exposes the new gradients as `.grad`.
    """

    def __init__(self, adapters: list[LoRAAdapter]):
        self.adapters = adapters
        self._saved: list[SavedRows] = []
        self._saved_slots: list[list[int]] = []  # each saved entry's slots, in its rows' order
        self._fresh: list[tuple[SlotStack, list[int]]] = []
        self._placed: dict[int, tuple] = {}  # per adapter: where its first projection sat (it moves as a whole)
        held: dict[int, tuple[SlotStack, list[int], list[int]]] = {}  # stack -> (slots with, without grads)
        for adapter in adapters:
            for w in adapter.weights.values():
                if w.stack is not None:
                    entry = held.setdefault(id(w.stack), (w.stack, [], []))
                    entry[1 if w.A.grad is not None else 2].append(w.slot)
            first = next(iter(adapter.weights.values()))
            self._placed[id(adapter)] = (first.stack, first.slot)
        for stack, with_grad, without in held.values():
            if with_grad:
                self._saved.append(_save_rows(stack, with_grad))
                self._saved_slots.append(with_grad)
            if without:
                self._fresh.append((stack, without))

    def commit(self) -> None:
        for adapter in self.adapters:
            for w in adapter.weights.values():
                if w.grad_views is not None and w.A.grad is None:
                    w.A.grad, w.B.grad = w.grad_views

    def rollback(self) -> None:
        _restore_rows(self._saved)
        _fill_slots(self._fresh, 0.0)

    def restore(self, adapter: LoRAAdapter) -> bool:
        """After the pass was committed: put one of its adapters' gradients back as they were before
        it (a request of the pass failed after it ran: compute_requests.py puts back its model's gradients and
        runs that model's other requests of the pass again). False, restoring nothing, if the adapter
        has left the slots it held in the pass (paged out: a cycle's models all stay live, so this
        is not expected)."""
        first = next(iter(adapter.weights.values()))
        if self._placed.get(id(adapter)) != (first.stack, first.slot) or first.stack is None:
            return False
        rows = {(id(saved[0]), slot): (saved, i) for saved, slots in zip(self._saved, self._saved_slots)
                for i, slot in enumerate(slots)}
        with torch.no_grad():
            for w in adapter.weights.values():
                found = rows.get((id(w.stack), w.slot))
                if found is None:  # no gradient before the pass
                    _drop_grads(w)
                    continue
                (_, _, grad_A, grad_B), i = found
                if w.A.grad is None:
                    w.A.grad, w.B.grad = w.grad_views
                w.A.grad.copy_(grad_A[i])
                w.B.grad.copy_(grad_B[i])
        return True


class GradientSnapshot:
    """One adapter's gradients as they are now, until `restore` puts them back.

    A request that runs in parts (one per clock cycle) takes one before its first part: if a
    later part fails, its earlier parts' gradients go and the acknowledged ones stay. Unlike
    `GradientPass` it holds copies of the adapter's own tensors (in host memory), not slot rows:
    the adapter may be paged out and in again, to another slot, between the parts."""

    def __init__(self, adapter: LoRAAdapter):
        self.adapter = adapter
        self._grads = {path: (w.A.grad.to("cpu", copy=True), w.B.grad.to("cpu", copy=True))
                       for path, w in adapter.weights.items() if w.A.grad is not None}

    def restore(self) -> None:
        if not self._grads:
            zero_grads([self.adapter])
            return
        with torch.no_grad():
            for path, w in self.adapter.weights.items():
                saved = self._grads.get(path)
                if saved is None:
                    _drop_grads(w)
                    continue
                if w.A.grad is None:  # paged out: tensors of its own; live: its slot's rows
                    w.A.grad, w.B.grad = w.grad_views or (torch.empty_like(w.A), torch.empty_like(w.B))
                w.A.grad.copy_(saved[0])
                w.B.grad.copy_(saved[1])


def _drop_grads(w: LoRAWeights) -> None:
    """Drop one projection's gradients (its slot's rows zeroed, while live)."""
    if w.grad_views is not None:
        for rows in w.grad_views:
            rows.zero_()
    w.A.grad = w.B.grad = None


class AdamWState:
    """AdamW moments per tensor, in torch.optim's layout: state[p] = {step, exp_avg, exp_avg_sq}.

    Not a torch.optim.Optimizer: every tenant has its own hyper-parameters at every step, and one
    cycle steps many tenants at once (`adamw.launch_adamw`), which an optimizer object per adapter
    cannot.
    """

    def __init__(self, weight_norm: float | None = None) -> None:
        self.state: dict[torch.Tensor, dict[str, torch.Tensor]] = {}
        # What lets a step prove, on the host and before it runs, that it leaves the weights finite
        # (adamw.provably_finite), so that it needs no copy to undo itself: a bound on
        # max |exp_avg| / sqrt(exp_avg_sq) over the moments (0 for fresh ones; None: unknown), and
        # the weights' L2 norm after the last step (read with its metrics; None: unknown).
        self.moment_ratio: float | None = 0.0
        self.weight_norm = weight_norm

    def clear(self) -> None:
        self.state.clear()
        self.moment_ratio = 0.0  # new moments start at zero
        self.weight_norm = None  # the weights are being replaced (a checkpoint load)

    def load(self, p: torch.Tensor, state: dict[str, torch.Tensor]) -> None:
        """Put in p's state from elsewhere (a checkpoint), and widen the moment bound to its
        moments: max |m| / sqrt(v), none where some v is negative or 0 under a non-zero m."""
        self.state[p] = state
        m, v = state["exp_avg"], state["exp_avg_sq"]
        if self.moment_ratio is None or not m.numel():
            return
        with torch.no_grad():
            ratio = torch.where(m == 0, torch.zeros_like(m), m.abs() / v.clamp(min=0).sqrt())
            bad = bool((v < 0).any()) or not bool(torch.isfinite(ratio).all())
        self.moment_ratio = None if bad else max(self.moment_ratio, float(ratio.max()))

    def state_for(self, p: torch.Tensor, new_step: torch.Tensor | None) -> dict[str, torch.Tensor]:
        """p's state; a new one counts its steps in `new_step`, which the caller shares among the
        tensors that start together (one increment per adapter and step, not one per tensor), and
        leaves None where every tensor has its state already (a tensor op less per step)."""
        st = self.state.get(p)
        if st is None:
            st = self.state[p] = {
                "step": new_step,
                "exp_avg": torch.zeros_like(p, memory_format=torch.preserve_format),
                "exp_avg_sq": torch.zeros_like(p, memory_format=torch.preserve_format),
            }
        return st


@dataclass(frozen=True)
class SkippedStep:
    """An optimizer step that was not applied: the adapter's weights and AdamW state are as before
    it, and `reason` says why (for the user: their inputs or hyper-parameters made it non-finite)."""

    reason: str
