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
_FOREACH_ZERO = getattr(torch, "_foreach_zero_", None)
_FOREACH_NORM = getattr(torch, "_foreach_norm", None)
_FLATTEN = getattr(torch._C._nn, "flatten_dense_tensors", None)


def adamw_update_(params: list[torch.Tensor], grads: list[torch.Tensor], exp_avgs: list[torch.Tensor],
                  exp_avg_sqs: list[torch.Tensor], steps: list[torch.Tensor], counters: list[torch.Tensor], *,
                  lr: float, beta1: float, beta2: float, eps: float, weight_decay: float) -> None:
    """One AdamW step (decoupled weight decay) of every tensor, in place.

    `steps[i]` is tensor i's step counter; several tensors may share one, so the distinct
    counters (`counters`) are incremented once each, before the update, as torch.optim does.
    Fast path: torch's fused AdamW kernel (what `torch.optim.AdamW(fused=True)` runs, CPU and
    CUDA). Fallback: torch's public single-tensor AdamW, one tensor at a time.
    """
    if not params:
        return
    if _FUSED_ADAMW is not None and _FOREACH_ADD is not None:
        _FOREACH_ADD(counters, 1)
        _FUSED_ADAMW(params, grads, exp_avgs, exp_avg_sqs, [], steps, lr=lr, beta1=beta1, beta2=beta2,
                     weight_decay=weight_decay, eps=eps, amsgrad=False, maximize=False)
        return
    for c in counters:
        c.add_(1)
    for i in range(len(params)):
        # The public function increments the counters it is given: hand it a copy of the count before.
        _public_adamw(params[i:i + 1], grads[i:i + 1], exp_avgs[i:i + 1], exp_avg_sqs[i:i + 1], [],
                      [steps[i] - 1], foreach=False, fused=False, amsgrad=False, beta1=beta1, beta2=beta2,
                      lr=lr, weight_decay=weight_decay, eps=eps, maximize=False)


def scale_(tensors: list[torch.Tensor], factors: list[float]) -> None:
    """tensors[i] *= factors[i], in place, in one multi-tensor op where torch has it."""
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
