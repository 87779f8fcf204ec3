"""`MultiLoRALinear`: one frozen base projection, many tenants' LoRA adapters, one pass.

Why not PEFT's layer: PEFT's mixed-adapter batching (`adapter_names=`) refuses to run in train
mode and loops per adapter anyway, and PEFT keeps one *active* adapter per model. A shared
training server needs every row of a batch to go through its own tenant's adapter, forward and
backward, in one call.

The adapters' storage is runtime/lora_slots.py's, the per-batch plan runtime/lora_plan.py's and
the LoRA kernels runtime/lora_ops.py's; this module is the layer that runs them.

The delta is PEFT's (`lora_B(lora_A(x)) * scaling`), so a checkpoint exported in PEFT's format
reproduces our logprobs in PEFT (to float rounding).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from .lora_ops import GroupedLoRA, lora_delta, lora_forward
from .lora_plan import LoRARouting
from .lora_slots import AdapterSlots, LoRACall, LoRAWeights, SlotStack
from .projections import ROLES, Projection, SplitProjection, as_linear


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



@dataclass(frozen=True)
class FusedPart:
    """A component of a fused projection (`projections.SplitProjection`): PEFT and the cookbook
    see the fused module's components as one LoRA on it (`checkpoints.format.to_peft`)."""

    path: str  # the fused module's path
    index: int  # which component, in Tinker's order (q, k, v; gate, up)
    count: int
    rows: tuple[int, ...]  # where its outputs sit in the fused output
    fused_out: int  # the fused output size



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
        if (call.first is not None and not call.pair and xs.dtype == stack.A.dtype == out_dtype
                and (self.routing.exact or not torch.is_grad_enabled())):
            # fp32 activations, consecutive slots: the stack's kept views, autograd's own nodes (the
            # sampler's grouped calls run without autograd: 3 ops, not lora_forward's 9)
            d = lora_delta(xs, *stack.leaves(call.first, call.n), call.scaling)
        elif not self.routing.exact:  # the sampler's decode steps (see `LoRARouting.batch`): no autograd
            d = lora_forward(xs, *stack.factors(call), call.scaling)[1].to(out_dtype)
        else:  # a canonical pair, slots out of order, or a 16-bit base (bf16 math on a bf16 one)
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
