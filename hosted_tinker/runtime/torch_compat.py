"""The private torch entry points the optimizer uses, each behind one wrapper with a public fallback.

`torch._fused_adamw_` and the `torch._foreach_*` ops are what `torch.optim.AdamW(fused=True)`
and `clip_grad_norm_` call inside; they take a whole list of tensors in one dispatch, which is
what lets one cycle step many tenants for about the price of one. They are private, so a torch
upgrade may move them: each wrapper then falls back to the public per-tensor equivalent (same
math, one call per tensor), so the server keeps working, only slower.

Every one of these ops works tensor by tensor (no value crosses from one tensor to another), so
a tensor's result is the same whatever else is in the list: an adapter's step has the same bits
alone or with other tenants' adapters (tests/test_multi_lora.py checks it).
"""

from __future__ import annotations

import torch
from torch.optim.adamw import adamw as _public_adamw

_FUSED_ADAMW = getattr(torch, "_fused_adamw_", None)
_FOREACH_MUL = getattr(torch, "_foreach_mul_", None)
_FOREACH_ADD = getattr(torch, "_foreach_add_", None)
_FOREACH_SUB = getattr(torch, "_foreach_sub_", None)
_FOREACH_ZERO = getattr(torch, "_foreach_zero_", None)
_FOREACH_NORM = getattr(torch, "_foreach_norm", None)
_FLATTEN = getattr(torch._C._nn, "flatten_dense_tensors", None)


def adamw_update_(params: list[torch.Tensor], grads: list[torch.Tensor], exp_avgs: list[torch.Tensor],
                  exp_avg_sqs: list[torch.Tensor], steps: list[torch.Tensor], counters: list[torch.Tensor], *,
                  lr: float, beta1: float, beta2: float, eps: float, weight_decay: float,
                  found_inf: torch.Tensor | None = None) -> None:
    """One AdamW step (decoupled weight decay) of every tensor, in place.

    `steps[i]` is tensor i's step counter; several tensors may share one, so the distinct
    counters (`counters`) are incremented once each, before the update, as torch.optim does.
    `found_inf` (a 0-dim float tensor on the device, 1 or 0): where 1 the step is skipped --
    weights, moments and counters stay as they were -- without the host reading it, as
    torch.optim's fused AdamW does under a GradScaler. Fast path: torch's fused AdamW kernel (what
    `torch.optim.AdamW(fused=True)` runs, CPU and CUDA). Fallback: torch's public single-tensor
    AdamW, one tensor at a time (which reads `found_inf` on the host: a slower path anyway).
    """
    if not params:
        return
    if _FUSED_ADAMW is not None and _FOREACH_ADD is not None and _FOREACH_SUB is not None:
        _FOREACH_ADD(counters, 1)
        _FUSED_ADAMW(params, grads, exp_avgs, exp_avg_sqs, [], steps, lr=lr, beta1=beta1, beta2=beta2,
                     weight_decay=weight_decay, eps=eps, amsgrad=False, maximize=False, found_inf=found_inf)
        if found_inf is not None:
            _FOREACH_SUB(counters, [found_inf] * len(counters))
        return
    if found_inf is not None and bool(found_inf):
        return
    for c in counters:
        c.add_(1)
    for i in range(len(params)):
        # The public function increments the counters it is given: hand it a copy of the count before.
        _public_adamw(params[i:i + 1], grads[i:i + 1], exp_avgs[i:i + 1], exp_avg_sqs[i:i + 1], [],
                      [steps[i] - 1], foreach=False, fused=False, amsgrad=False, beta1=beta1, beta2=beta2,
                      lr=lr, weight_decay=weight_decay, eps=eps, maximize=False)


def scale_by_(tensors: list[torch.Tensor], factors: list[torch.Tensor]) -> None:
    """tensors[i] *= factors[i] (0-dim tensors on the device), in place, in one multi-tensor op
    where torch has it: the factors are never read on the host."""
    if not tensors:
        return
    if _FOREACH_MUL is not None:
        _FOREACH_MUL(tensors, factors)
        return
    for t, f in zip(tensors, factors):
        t.mul_(f)


def zero_(tensors: list[torch.Tensor]) -> None:
    """Zero every tensor in place, in one multi-tensor op where torch has it."""
    if _FOREACH_ZERO is not None:
        _FOREACH_ZERO(tensors)
        return
    for t in tensors:
        t.zero_()


def norms(tensors: list[torch.Tensor]) -> list[torch.Tensor]:
    """The L2 norm of each tensor (0-dim float32 tensors), in one multi-tensor op where torch has
    it. On CUDA each tensor is reduced in fixed 64 Ki-element chunks whose partial sums are added in
    a fixed order, so a tensor's norm does not depend on the others in the list (adamw.py)."""
    if _FOREACH_NORM is not None:
        return list(_FOREACH_NORM(tensors))
    return [torch.linalg.vector_norm(t) for t in tensors]


def flat_copy(tensors: list[torch.Tensor]) -> torch.Tensor:
    """One 1-D copy of all the tensors' values, one after the other (dtypes promote), in one call
    where torch has it (what DDP's bucketing uses): the per-tensor reshapes of `torch.cat` cost
    the optimizer step ~10 ms in Python at 16 MoE tenants (3584 tensors)."""
    if _FLATTEN is not None:
        return _FLATTEN(tensors)
    return torch.cat([t.reshape(-1) for t in tensors])
