"""The many-adapter AdamW step: every ready tenant's step of a cycle, together, each as if alone,
launched without a host sync and read once.

The adapters' moments live with them (`adapters.AdamWState`); this is the step that reads and
updates them: the gradient norms of all stepping adapters, clipping, the finite check and a
fused AdamW kernel per adapter, all queued on the device (`launch_adamw`) with no value read
back, so that on CUDA the step can be captured like the forward/backward. The decisions a step
takes are device-side masks, not host branches: an adapter whose gradient norm is not finite
passes `found_inf` to its fused kernel (which then leaves weights and moments alone) and has its
step counter put back; clipping multiplies by min(1, max_norm / (norm + 1e-6)) computed on the
device. What the host learns -- each adapter's gradient norm, whether its step was applied, its
weights' norm after it -- comes back in one small tensor, read after the cycle's one wait
(`PendingSteps.results`).

A step the update would make non-finite (a huge learning rate) is put back from a copy made
before it (`_StateCopy`), where the host cannot prove beforehand that the step leaves the
weights finite (`provably_finite`): from the weights' norm after the adapter's last step (read
with that step's metrics) and a bound on |exp_avg| / sqrt(exp_avg_sq) that the host carries
from step to step (`next_moment_ratio`), neither of which needs this step's values. An ordinary
step makes no copy.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from .adapters import AdamParams, LoRAAdapter, SkippedStep, zero_grads
from .host_copies import device_constant, to_host
from .invariance import row_norms
from .lora_slots import SlotStack
from .torch_compat import adamw_update_, flat_copy, norms, scale_by_

if TYPE_CHECKING:
    from .invariance import FusionPolicy


# (tensor, its slot stack or None, 0 for A / 1 for B, slot): `LoRAAdapter.grad_tensors`
Entry = tuple[torch.Tensor, SlotStack | None, int, int | None]


@dataclass(frozen=True)
class TensorNorms:
    """The L2 norm of each entry's gradient (or weights), on the device: `flat` [n] float32, and
    per adapter the positions of its entries' norms in it."""

    flat: torch.Tensor | None
    positions: list[list[int]]

    def per_adapter(self) -> torch.Tensor:
        """Each adapter's norm, float64 [k] on the device: the norm of its tensors' norms, each
        adapter reduced on its own (a multi-tensor norm over per-adapter vectors), so an
        adapter's value never depends on who steps with it. 0 for an adapter without tensors."""
        sizes = [len(p) for p in self.positions]
        if self.flat is None or not any(sizes):
            return torch.zeros(len(sizes), dtype=torch.float64)
        index = device_constant(tuple(i for p in self.positions for i in p), torch.long, self.flat.device)
        picked = self.flat.index_select(0, index).double().split(sizes)
        return torch.stack(norms(list(picked)))


def tensor_norms(entries: list[list[Entry]], policy: "FusionPolicy | None", *, grads: bool) -> TensorNorms:
    """The L2 norm of each entry's gradient (`grads`) or weights, per adapter, on the device.

    A tensor's norm is `row_norms` of its canonical pair; where the policy has proven it for the
    shape, every entry's comes from one reduction over the rows of its layer's slot stack (weights
    or gradient rows) that the adapters span (a few ops per stack, not per tenant and tensor; not
    the whole stack, whose other slots belong to tenants not stepping now: with 16 live tenants,
    one stepping alone summed 16 slots). On CUDA each tensor from its own values only
    (`torch_compat.norms`, one multi-tensor op): a reduction over a slot stack's rows gave a
    tenant's norm other last bits alone and beside ten others on an H200, though the probe on
    random data had passed.
    """
    if any(p.is_cuda for mine in entries for p, _, _, _ in mine):
        flat = [p.grad if grads else p for mine in entries for p, _, _, _ in mine]
        positions, at = [], 0
        for mine in entries:
            positions.append(list(range(at, at + len(mine))))
            at += len(mine)
        return TensorNorms(torch.stack(norms(flat)) if flat else None, positions)
    spans: dict[int, tuple[SlotStack, int, int]] = {}  # id(stack) -> (stack, first row, end row)
    for mine in entries:
        for _, stack, _, slot in mine:
            if stack is not None:
                _, lo, hi = spans.get(id(stack), (stack, slot, slot + 1))
                spans[id(stack)] = (stack, min(lo, slot), max(hi, slot + 1))
    # id -> tensor whose rows' norms are computed below; (id(stack), 0 | 1) for a stack's rows of A / B.
    inputs: dict[object, torch.Tensor] = {}
    first_row: dict[int, int] = {}
    for key, (stack, lo, hi) in spans.items():
        for which, rows in enumerate(stack.grad_span(lo, hi) if grads else stack.weight_span(lo, hi)):
            if policy is not None and policy.stacked_norms(hi - lo, tuple(rows.shape[1:]), rows.dtype):
                inputs[(key, which)] = rows
                first_row[key] = lo
    refs: list[list[tuple[object, int]]] = []  # per adapter: (input key, row)
    for mine in entries:
        refs.append([])
        for p, stack, which, slot in mine:
            if (id(stack), which) in inputs:
                refs[-1].append(((id(stack), which), slot - first_row[id(stack)]))
            else:
                t = p.grad if grads else p
                inputs[id(p)] = torch.stack([t, t])
                refs[-1].append((id(p), 0))
    if not inputs:
        return TensorNorms(None, [[] for _ in entries])
    offset, start = {}, 0
    for k, rows in inputs.items():
        offset[k] = start
        start += rows.shape[0]
    flat = torch.cat([row_norms(rows) for rows in inputs.values()])
    return TensorNorms(flat, [[offset[k] + row for k, row in mine] for mine in refs])


def grad_norms(items: list[LoRAAdapter], policy: "FusionPolicy | None") -> list[float]:
    """Each adapter's gradient L2 norm, read to the host (for tests and tools; a step reads its
    norms with its other metrics)."""
    norms_ = tensor_norms([list(adapter.grad_tensors()) for adapter in items], policy, grads=True).per_adapter()
    return to_host(norms_, False).tolist()


# A weight tensor whose norm stays below this is finite with room to spare: a float32 sum of
# squares overflows near a norm of 1.8e19.
_SAFE_NORM = 1e18


def next_moment_ratio(ratio: float | None, hp: AdamParams) -> float | None:
    """A bound on max |exp_avg| / sqrt(exp_avg_sq) after a step with `hp`, from the bound before
    it (None: none known). With m' = b1 m + (1 - b1) g and v' = b2 v + (1 - b2) g^2, Cauchy-Schwarz
    gives |m'| <= sqrt(b1^2 Q^2 / b2 + (1 - b1)^2 / (1 - b2)) sqrt(v') whatever the gradient
    (fresh moments: Q = 0). Widened a little for float32 rounding."""
    b1, b2 = hp.beta1, hp.beta2
    if ratio is None or not (0 <= b1 < 1 and 0 <= b2 < 1):
        return None
    if b2 == 0:
        return (1 - b1) * (1 + 1e-6) if b1 * ratio == 0 else None
    return math.sqrt(b1 * b1 * ratio * ratio / b2 + (1 - b1) ** 2 / (1 - b2)) * (1 + 1e-6)


def provably_finite(adapter: LoRAAdapter, hp: AdamParams, numel: int) -> bool:
    """Whether this step leaves the adapter's weights finite, their norms far from overflowing,
    whatever its gradient (a finite one: an infinite one skips the step anyway), so it needs no
    copy to undo it. In torch's fused AdamW a weight becomes w (1 - lr wd) - lr / (1 - b1^t) m' /
    (sqrt(v') / sqrt(1 - b2^t) + eps), so with |m'| <= Q' sqrt(v') (`next_moment_ratio`) each
    weight moves at most |lr| Q' / (1 - b1) (+ |lr| for v' underflowing to 0 while m' does not,
    which eps >= 1e-16 keeps below it); a tensor's norm is at most the adapter's weight norm
    after its last step (`AdamWState.weight_norm`), and a tensor of n weights moves by at most
    sqrt(n) times the largest move."""
    state = adapter.optimizer
    ratio = next_moment_ratio(state.moment_ratio, hp)
    if ratio is None or state.weight_norm is None or not hp.eps >= 1e-16:
        return False
    move = abs(hp.learning_rate) * (ratio / (1 - hp.beta1) + 1)
    largest = state.weight_norm * (1 + abs(hp.learning_rate * hp.weight_decay)) + move * math.sqrt(numel)
    return math.isfinite(largest) and largest * 1.01 <= _SAFE_NORM


class _StateCopy:
    """An adapter's weights and AdamW state before a step, in one flat copy, to put back a step
    whose result is not finite (on the device: `restore_unless`)."""

    def __init__(self, adapter: LoRAAdapter, params: list[torch.Tensor]):
        self.tensors = params + [st[k] for p in params if (st := adapter.optimizer.state.get(p)) is not None
                                 for k in ("exp_avg", "exp_avg_sq", "step")]
        self.flat = flat_copy(self.tensors)

    def restore_unless(self, ok: torch.Tensor) -> None:
        """Put every tensor back where `ok` (a 0-dim device bool) is false; no host branch."""
        for t, saved in zip(self.tensors, self.flat.split([t.numel() for t in self.tensors])):
            t.copy_(torch.where(ok, t, saved.view_as(t)))


@dataclass
class PendingSteps:
    """A launched optimizer step: its metrics arrive in host memory by the runtime's next wait."""

    items: list[tuple[LoRAAdapter, AdamParams]]
    stepping: list[int]  # the items with gradients
    metrics: torch.Tensor | None  # [stepping, 4] float64, host: grad norm, grad finite, applied, weight norm
    fresh: dict[int, list[torch.Tensor]]  # per stepping item: tensors whose state this step made

    def results(self) -> list[dict[str, float] | SkippedStep]:
        """The step's results from its host copy of the metrics (call after the device wait).

        A step that is not finite is skipped (`SkippedStep`), for that adapter only: a gradient norm
        that is inf or NaN (huge loss weights or advantages), or weights that the update would make
        non-finite (a huge learning_rate). Either way its gradients are dropped and its weights and
        AdamW state stay as they were, so one tenant's numbers never poison its adapter for good."""
        rows = dict(zip(self.stepping, self.metrics.numpy().tolist())) if self.metrics is not None else {}
        out: list[dict[str, float] | SkippedStep] = []
        for k, (adapter, hp) in enumerate(self.items):
            norm, grad_ok, applied, weight_norm = rows.get(k, (0.0, 1.0, 1.0, None))
            if applied:
                adapter.step += 1
                state = adapter.optimizer
                if k in rows:
                    state.moment_ratio = next_moment_ratio(state.moment_ratio, hp)
                    state.weight_norm = weight_norm
                out.append({"grad_norm": norm, "learning_rate": hp.learning_rate})
                continue
            for p in self.fresh.get(k, ()):
                del adapter.optimizer.state[p]  # made by this step: as before it
            if not grad_ok:
                out.append(SkippedStep(f"the gradient norm is {norm} (not finite), so the step was skipped "
                                       "and the weights are unchanged; look for huge loss weights or advantages "
                                       "in the forward_backward calls since the last step"))
            else:
                out.append(SkippedStep(f"learning_rate {hp.learning_rate:g} would make the weights non-finite "
                                       f"(gradient norm {norm:g}), so the step was skipped and the weights "
                                       "are unchanged; lower learning_rate"))
        return out


def launch_adamw(items: list[tuple[LoRAAdapter, AdamParams]], policy: "FusionPolicy | None" = None) -> PendingSteps:
    """Queue one AdamW step (decoupled weight decay) for each (adapter, its hyper-parameters),
    with no host sync; `PendingSteps.results()` after the device wait gives each adapter's result.

    The gradient norms of all stepping adapters (`tensor_norms`), a multi-tensor scale of the
    clipped adapters' gradients, one fused AdamW kernel per adapter (torch's own `fused=True`
    kernel, CPU and CUDA; see torch_compat) with its `found_inf`, the weights' norms after the
    step, and one zeroing op per gradient stack. Every tensor's update depends only on its own
    gradient, moments and step, so an adapter gets the same bits whether it steps alone or with
    others. Clipping (grad_clip_norm > 0) scales an adapter's gradients by min(1, max_norm /
    (norm + 1e-6)), as torch.nn.utils.clip_grad_norm_; the reported `grad_norm` is the norm before
    clipping. Tensors without a gradient are left alone (as torch.optim does); an adapter with
    none has a step of norm 0."""
    with torch.no_grad():
        entries = [list(adapter.grad_tensors()) for adapter, _ in items]
        stepping = [k for k in range(len(items)) if entries[k]]
        if not stepping:
            zero_grads([adapter for adapter, _ in items])
            return PendingSteps(items, [], None, {})
        mine = [entries[k] for k in stepping]
        gnorm = tensor_norms(mine, policy, grads=True).per_adapter()
        grad_ok = torch.isfinite(gnorm)
        found_inf = (~grad_ok).float()
        _clip(items, stepping, mine, gnorm)
        copies = {k: _StateCopy(items[k][0], [p for p, _, _, _ in entries[k]]) for k in stepping
                  if not provably_finite(*items[k], max(p.numel() for p, _, _, _ in entries[k]))}
        fresh = {}
        for i, k in enumerate(stepping):
            fresh[k] = _step_one(*items[k], [p for p, _, _, _ in entries[k]], found_inf[i])
        wnorm = tensor_norms(mine, policy, grads=False).per_adapter()
        applied = grad_ok.clone() if copies else grad_ok
        for i, k in enumerate(stepping):
            if k in copies:  # a step not proven finite: applied only where its weights came out finite
                applied[i] = grad_ok[i] & torch.isfinite(wnorm[i])
                copies[k].restore_unless(applied[i])
        zero_grads([adapter for adapter, _ in items])
        metrics = torch.stack([gnorm, grad_ok.double(), applied.double(), wnorm], 1)
        return PendingSteps(items, stepping, to_host(metrics, False), fresh)


def _clip(items, stepping: list[int], entries: list[list[Entry]], gnorm: torch.Tensor) -> None:
    """Scale the gradients of the adapters that clip by min(1, max_norm / (norm + 1e-6)), each
    factor computed on the device in float64 and applied in float32, as torch's clip_grad_norm_."""
    clipping = [i for i, k in enumerate(stepping) if items[k][1].grad_clip_norm > 0]
    if not clipping:
        return
    bounds = device_constant(tuple(items[stepping[i]][1].grad_clip_norm for i in clipping), torch.float64,
                              gnorm.device)
    rows = device_constant(tuple(clipping), torch.long, gnorm.device)
    factors = (bounds / (gnorm.index_select(0, rows) + 1e-6)).clamp(max=1.0).float().unbind()
    grads, per_tensor = [], []
    for factor, i in zip(factors, clipping):
        for p, _, _, _ in entries[i]:
            grads.append(p.grad)
            per_tensor.append(factor)
    scale_by_(grads, per_tensor)


def _step_one(adapter: LoRAAdapter, hp: AdamParams, params: list[torch.Tensor], found_inf: torch.Tensor
              ) -> list[torch.Tensor]:
    """One adapter's fused AdamW kernel, skipped on the device where `found_inf` is 1; returns the
    tensors whose state it made (dropped again if the step turns out skipped)."""
    new_step = None if all(p in adapter.optimizer.state for p in params) else \
        torch.zeros((), dtype=torch.float32, device=params[0].device)
    fresh = [p for p in params if p not in adapter.optimizer.state]
    states = [adapter.optimizer.state_for(p, new_step) for p in params]
    counters = list({id(st["step"]): st["step"] for st in states}.values())
    adamw_update_(params, [p.grad for p in params], [st["exp_avg"] for st in states],
                  [st["exp_avg_sq"] for st in states], [st["step"] for st in states], counters,
                  lr=hp.learning_rate, beta1=hp.beta1, beta2=hp.beta2, eps=hp.eps, weight_decay=hp.weight_decay,
                  found_inf=found_inf)
    return fresh
