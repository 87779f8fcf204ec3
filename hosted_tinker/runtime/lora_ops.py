"""The LoRA kernels: n tenants' deltas in two batched matmuls, forward and backward.

Run by the layers (runtime/multi_lora.py) and by the fusion probe (runtime/invariance.py), which
checks on this machine which batches of them keep every tenant's bits.

Exactness: a tenant's bits may not depend on who shares a call with it. Measured on CPU (torch
2.13, MKL): a `bmm` gives entry 0 different bits when it holds 1 entry than when it holds 2 or
more (14-18 of 72 LoRA shapes), while batches of 2, 3, 4, 8 and 16 entries all agree. So the
canonical computation of one tenant's delta is a batch of two -- the tenant and a copy of
itself -- and a batch of n tenants (n = 1 included) runs only where `FusionPolicy.group_lora`
has checked, for that shape on this machine, that it gives every entry its canonical bits;
otherwise each tenant runs its own canonical pair.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from .lora_slots import LoRACall, SlotStack


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

