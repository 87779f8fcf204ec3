"""The many-adapter AdamW step: every ready tenant's step of a cycle, together, each as if alone.

The adapters' moments live with them (`adapters.AdamWState`); this is the step that reads and
updates them: the gradient norms of all stepping adapters, clipping, one fused AdamW kernel per
distinct set of hyper-parameters, and a non-finite step skipped and put back (`SkippedStep`).
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING

import torch

from .adapters import AdamParams, LoRAAdapter, SkippedStep, zero_grads
from .invariance import row_norms
from .lora_slots import SlotStack
from .torch_compat import adamw_update_, flat_copy, norms, scale_

if TYPE_CHECKING:
    from .invariance import FusionPolicy


# (tensor, its slot stack or None, 0 for A / 1 for B, slot): `LoRAAdapter.grad_tensors`
Entry = tuple[torch.Tensor, SlotStack | None, int, int | None]


def grad_norms(items: list[LoRAAdapter], policy: "FusionPolicy | None") -> list[float]:
    """Each adapter's gradient L2 norm: sqrt of the float64 sum of its tensors' squared norms
    (`tensor_norms` of the gradients), each adapter adding its own in its own order."""
    return _grad_norms([list(adapter.grad_tensors()) for adapter in items], policy)


def _grad_norms(entries: list[list[Entry]], policy: "FusionPolicy | None") -> list[float]:
    return [math.sqrt(math.fsum(v * v for v in mine)) for mine in tensor_norms(entries, policy, grads=True)]


def tensor_norms(entries: list[list[Entry]], policy: "FusionPolicy | None", *, grads: bool) -> list[list[float]]:
    """The L2 norm of each entry's gradient (`grads`) or weights, per adapter, in one host sync.

    A tensor's norm is `row_norms` of its canonical pair; where the policy has proven it for the
    shape, every entry's comes from one reduction over the rows of its layer's slot stack (weights
    or gradient rows) that the adapters span (a few ops per stack, not per tenant and tensor; not
    the whole stack, whose other slots belong to tenants not stepping now: with 16 live tenants,
    one stepping alone summed 16 slots).
    """
    if any(p.is_cuda for mine in entries for p, _, _, _ in mine):
        return _norms_per_tensor(entries, grads)
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
        return [[] for _ in entries]
    keys = list(inputs)
    flat = torch.cat([row_norms(inputs[k]) for k in keys]).tolist()  # the one host sync
    offset, start = {}, 0
    for k in keys:
        offset[k] = start
        start += inputs[k].shape[0]
    return [[flat[offset[k] + row] for k, row in mine] for mine in refs]


def _norms_per_tensor(entries: list[list[Entry]], grads: bool) -> list[list[float]]:
    """On CUDA: every tensor's norm from its own values only (`torch_compat.norms`, one
    multi-tensor op for all stepping tenants), so a tenant's norm never depends on who steps with
    it. A reduction over a slot stack's rows did: on an H200 a tenant's grad_norm differed in its
    last bits between stepping alone and with ten others, though the probe on random data had
    passed (the sums of squares agreed after the square root more often than not)."""
    flat = [p.grad if grads else p for mine in entries for p, _, _, _ in mine]
    values = torch.stack(norms(flat)).tolist() if flat else []  # the one host sync
    out, i = [], 0
    for mine in entries:
        out.append(values[i:i + len(mine)])
        i += len(mine)
    return out


class _StateCopy:
    """An adapter's weights and AdamW state before a step, in one flat copy, to put back a step
    whose result is not finite."""

    def __init__(self, adapter: LoRAAdapter, params: list[torch.Tensor]):
        self.state = adapter.optimizer.state
        self.params = params
        self.fresh = [p for p in params if p not in self.state]  # their state is made by this step
        self.tensors = params + [self.state[p][k] for p in params if p in self.state
                                 for k in ("exp_avg", "exp_avg_sq", "step")]
        self.flat = flat_copy(self.tensors)

    def restore(self) -> None:
        for t, saved in zip(self.tensors, self.flat.split([t.numel() for t in self.tensors])):
            t.copy_(saved.view_as(t))
        for p in self.fresh:
            del self.state[p]


def _finite(entries: list[list[Entry]], policy: "FusionPolicy | None") -> list[bool]:
    """Whether each adapter's weights are finite after its step (and not so large that their norm
    overflows, which makes the next forward non-finite all the same): `tensor_norms` of the
    weights, one host sync for all."""
    return [all(math.isfinite(v) for v in mine) for mine in tensor_norms(entries, policy, grads=False)]


# A weight tensor whose norm stays below this is finite with room to spare: a float32 sum of
# squares overflows near a norm of 1.8e19 (`_finite`).
_SAFE_NORM = 1e18


def _stays_finite(adapter: LoRAAdapter, hp: AdamParams, grad_norm: float, weight_norms: list[float],
                  numel: int) -> bool:
    """Whether this step provably leaves the adapter's weights finite, their norms far from
    overflowing, so it needs no copy to undo it (at 16 MoE tenants the copies were a third of the
    step's memory traffic). In torch's fused AdamW a weight becomes w * (1 - lr * wd) - lr / (1 -
    beta1^t) * m / (sqrt(v) / sqrt(1 - beta2^t) + eps), where the new m lies between the old one
    and the gradient (|g| <= its norm), and the denominator is at least eps when v >= 0 (as every
    v this optimizer made; loaded moments have no bound). With beta1 and beta2 in [0, 1) and eps
    > 0 each weight moves at most lr / (1 - beta1) * max|m| / eps; each weight is at most the
    adapter's weight norm before the step; a tensor of n weights has a norm of at most sqrt(n)
    times the largest."""
    bound = adapter.optimizer.exp_avg_bound
    if bound is None or not (hp.eps > 0 and 0 <= hp.beta1 < 1 and 0 <= hp.beta2 < 1):
        return False
    move = abs(hp.learning_rate) / (1 - hp.beta1) * max(bound, grad_norm) / hp.eps
    largest = math.sqrt(math.fsum(v * v for v in weight_norms)) * (1 + abs(hp.learning_rate * hp.weight_decay)) + move
    return math.isfinite(largest) and largest * math.sqrt(numel) * 1.01 <= _SAFE_NORM


def _exp_avg_bound(bound: float | None, grad_norm: float, hp: AdamParams) -> float | None:
    """The bound on |m| after a step: the new m lies between the old one and the gradient, up to a
    few ulps of rounding (float32 norms may also be a little short: `_SAFE_NORM` leaves 18x).
    With betas outside [0, 1) neither that nor v >= 0 holds any more."""
    if bound is None or not (0 <= hp.beta1 < 1 and 0 <= hp.beta2 < 1):
        return None
    return max(bound, grad_norm) * (1 + 1e-6)


def adamw_step(items: list[tuple[LoRAAdapter, AdamParams]], policy: "FusionPolicy | None" = None
               ) -> list[dict[str, float] | SkippedStep]:
    """One AdamW step (decoupled weight decay) for each (adapter, its hyper-parameters).

    The step of many adapters costs about what one costs: the gradient norms of all of them
    (`grad_norms`), one multi-tensor scale for every clipped gradient, one fused AdamW kernel
    per distinct set of hyper-parameters (torch's own `fused=True` kernel, CPU and CUDA; see
    torch_compat) and one zeroing op per gradient stack. Every tensor's update depends only on
    its own gradient, moments and step, so an adapter gets the same bits whether it steps alone
    or with others.

    Clipping (grad_clip_norm > 0) scales an adapter's gradients by min(1, max_norm / (norm +
    1e-6)), as torch.nn.utils.clip_grad_norm_; the returned `grad_norm` is the norm before
    clipping. Tensors without a gradient are left alone (as torch.optim does).

    A step that is not finite is skipped (`SkippedStep`), for that adapter only: a gradient norm
    that is inf or NaN (huge loss weights or advantages), or weights that the update would make
    non-finite (a huge learning_rate). Either way its gradients are dropped and its weights and
    AdamW state stay as they were, so one tenant's numbers never poison its adapter for good. The
    copy that puts a step back is made only where the step is not proven finite beforehand
    (`_stays_finite`), and checked after it.
    """
    with torch.no_grad():
        entries = [list(adapter.grad_tensors()) for adapter, _ in items]
        norms = _grad_norms(entries, policy)
        per_adapter = [[p for p, _, _, _ in entries[k]] if math.isfinite(norms[k]) else [] for k in range(len(items))]
        stepping = [k for k in range(len(items)) if per_adapter[k]]
        before = tensor_norms([entries[k] for k in stepping], policy, grads=False)
        copies = {k: _StateCopy(items[k][0], per_adapter[k]) for k, mine in zip(stepping, before)
                  if not _stays_finite(*items[k], norms[k], mine, max(p.numel() for p in per_adapter[k]))}
        clipped: list[torch.Tensor] = []
        factors: list[float] = []
        groups: dict[tuple, list[int]] = {}
        for k, ((_, hp), params) in enumerate(zip(items, per_adapter)):
            if not params:
                continue
            if hp.grad_clip_norm > 0:
                coef = min(1.0, hp.grad_clip_norm / (norms[k] + 1e-6))
                if coef < 1.0:
                    clipped += [p.grad for p in params]
                    factors += [coef] * len(params)
            key = (hp.learning_rate, hp.beta1, hp.beta2, hp.eps, hp.weight_decay, params[0].device)
            groups.setdefault(key, []).append(k)
        scale_(clipped, factors)
        for (lr, beta1, beta2, eps, wd, device), members in groups.items():
            ps, gs, m1, m2, steps = [], [], [], [], []
            counters: dict[int, torch.Tensor] = {}  # each step counter once, however many tensors share it
            for k in members:
                adapter = items[k][0]
                new_step = None if all(p in adapter.optimizer.state for p in per_adapter[k]) else \
                    torch.zeros((), dtype=torch.float32, device=device)
                for p in per_adapter[k]:
                    st = adapter.optimizer.state_for(p, new_step)
                    ps.append(p)
                    gs.append(p.grad)
                    m1.append(st["exp_avg"])
                    m2.append(st["exp_avg_sq"])
                    steps.append(st["step"])
                    counters.setdefault(id(st["step"]), st["step"])
            adamw_update_(ps, gs, m1, m2, steps, list(counters.values()), lr=lr, beta1=beta1, beta2=beta2, eps=eps,
                          weight_decay=wd)
        undone = {k for k, finite in zip(copies, _finite([entries[k] for k in copies], policy)) if not finite}
        for k in undone:
            copies[k].restore()
        for k in stepping:
            if k not in undone:
                state = items[k][0].optimizer
                state.exp_avg_bound = _exp_avg_bound(state.exp_avg_bound, norms[k], items[k][1])
        zero_grads([adapter for adapter, _ in items])
        results: list[dict[str, float] | SkippedStep] = []
        for k, (adapter, hp) in enumerate(items):
            if not math.isfinite(norms[k]):
                results.append(SkippedStep(f"the gradient norm is {norms[k]} (not finite), so the step was skipped "
                                           "and the weights are unchanged; look for huge loss weights or advantages "
                                           "in the forward_backward calls since the last step"))
            elif k in undone:
                results.append(SkippedStep(f"learning_rate {hp.learning_rate:g} would make the weights non-finite "
                                           f"(gradient norm {norms[k]:g}), so the step was skipped and the weights "
                                           "are unchanged; lower learning_rate"))
            else:
                adapter.step += 1
                results.append({"grad_norm": norms[k], "learning_rate": hp.learning_rate})
        return results
