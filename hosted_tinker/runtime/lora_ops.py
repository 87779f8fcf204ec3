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


def compute_dtype(x_dtype: torch.dtype, factor_dtype: torch.dtype) -> torch.dtype:
    """The dtype a LoRA's GEMMs take: bf16 on a bf16 base (bf16 operands, fp32 accumulation inside
    the GEMM, on the tensor cores), else the factors' (the fp32 master weights)."""
    return torch.bfloat16 if x_dtype == torch.bfloat16 else factor_dtype


def lora_forward(xs: torch.Tensor, A: torch.Tensor, B: torch.Tensor, scaling: float):
    """n adapters' deltas in two batched matmuls: xs [n, M, in], A [n, r, in], B [n, out, r] ->
    (h [n, M, r], deltas [n, M, out]), `X·A` then `·B` (never `B·A`).

    On a bf16 base the operands are bf16 (the fp32 factors rounded to bf16) and the GEMMs
    accumulate in fp32; each row's h and delta are rounded to bf16 as any bf16 activation is, the
    same in any batch. The weight gradients are where rounding would break a promise (a
    micro-batch's gradient rounded to bf16 before it joins the others' made 1 x 8 and 2 x 4
    micro-batches differ by 1.6e-2 in logprobs after an AdamW step, measured on an H200): see
    `weight_grad`. Other bases compute in the factors' fp32."""
    dtype = compute_dtype(xs.dtype, A.dtype)
    h = torch.bmm(xs.to(dtype), A.to(dtype).transpose(1, 2))  # [n, M, r]
    return h, torch.bmm(h, B.to(dtype).transpose(1, 2)) * scaling  # [n, M, out]


def weight_grad(a: torch.Tensor, b: torch.Tensor, datums: int) -> torch.Tensor:
    """Σ over rows of a[i]^T b[i]: a [n, M, p], b [n, M, q] -> [n, p, q] in fp32.

    In fp32 one batched matmul. In bf16 (whose GEMMs give bf16 results) one batched matmul per
    datum -- each entry's M rows are `datums` datums of M / datums rows -- whose bf16 results are
    summed in fp32: a datum's partial gradient has the same bits whichever micro-batch it runs in,
    so splitting a batch into micro-batches changes the gradient only by fp32 rounding (the
    micro-batch's gradient is never rounded to bf16 as a whole)."""
    if a.dtype == torch.float32 or datums < 1:
        return torch.bmm(a.transpose(1, 2), b).float()
    n, M, p = a.shape
    per = torch.bmm(a.reshape(n * datums, M // datums, p).transpose(1, 2), b.reshape(n * datums, M // datums, -1))
    return per.view(n, datums, p, -1).float().sum(1) if datums > 1 else per.float()


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
                  scaling: float, need_x: bool, datums: int = 1):
    """Gradients of `lora_forward` w.r.t. xs (if need_x, in xs's dtype), A and B (fp32), as autograd
    would take them, in `lora_forward`'s dtype (h's); each entry's rows are `datums` datums."""
    dtype = h.dtype
    A, B = A.to(dtype), B.to(dtype)
    g = gd.to(dtype) * scaling
    grad_B = weight_grad(h, g, datums).transpose(1, 2)  # [n, out, r]
    gh = torch.bmm(g, B)  # [n, M, r]
    grad_A = weight_grad(xs.to(dtype), gh, datums).transpose(1, 2)  # [n, r, in]
    grad_x = torch.bmm(gh, A).to(xs.dtype) if need_x else None
    return grad_x, grad_A, grad_B


class GroupedLoRA(torch.autograd.Function):
    """Deltas of `x.shape[0]` tenants (equal row blocks) through their slots of one `SlotStack`.

    forward(x [n, M, in], anchor, stack, call, out_dtype) -> [n, M, out]: `call.slots` has n
    entries, or two (the same slot twice) where one tenant runs as its canonical pair. The weight
    gradients go straight into the stack's gradient rows (nothing is returned for them); `anchor`
    is a leaf that requires grad, so the backward runs even where x needs no gradient. x is saved
    in its own dtype (a 16-bit activation the base keeps anyway). Runs the calls that
    `lora_delta` does not: pairs, slots out of order, and a 16-bit base's.
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
        grad_x, grad_A, grad_B = lora_backward(gd, x, A, B, h, call.scaling, ctx.needs_input_grad[0], call.rows)
        if call.pair:
            grad_x, grad_A, grad_B = (None if grad_x is None else grad_x[:1]), grad_A[:1], grad_B[:1]
        ctx.stack.accumulate(call, grad_A, grad_B)
        return grad_x, None, None, None, None

