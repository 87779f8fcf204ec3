"""LoRA on mixture-of-experts experts, the way Tinker gives it: per-expert A/B, routed with the tokens.

transformers >= 5 keeps a MoE layer's experts as fused 3-D parameters in one module (the classes
decorated by `use_experts_implementation`: Qwen3-MoE, Mixtral, GPT-OSS, DeepSeek, ...):
`gate_up_proj` [E, 2I, H] and `down_proj` [E, H, I] (GPT-OSS: transposed, gate/up interleaved,
with biases). `MultiLoRAExperts` replaces such a module and computes the same thing plus, for each
routed (token, expert) pair, the delta of the token's tenant's LoRA for that expert, on the expert's
gate (w1), up (w3) and down (w2) projections -- weighted by the router like the expert's output.

Tinker's checkpoint layout (what `tinker_cookbook.weights` reads): one LoRA per projection and
layer under `<experts path>.w1|w2|w3`, with 3-D factors A [E, rank, in] and B [E, out, rank].
Each projection is an `ExpertProjection` in the runtime's layer map, so adapters, slots,
optimizer, checkpoints and sampler snapshots treat it like any other projection; its slot stack
holds [slots, E, rank, in] / [slots, E, out, rank].

Routing and grouped GEMMs (runtime/moe_routing.py): the (token, expert) pairs are sorted by
(tenant, expert) on the device, and the frozen experts run one grouped GEMM per tenant. Each
tenant's expert LoRA is two thin grouped GEMMs over its (tenant, expert) groups -- `X·A`, then
`·B`, never building `B·A` -- and one call covers every run of consecutive tenants of one rank
and scaling (`ExpertLoRA`): its groups are the base GEMMs' own, the same rows in the same order.
On a bf16 base they run in bf16 with fp32 accumulation (the only dtype CUDA's grouped kernel
takes: an fp32 `_grouped_mm` is a host loop of one `mm` per group there, and cannot be captured);
their weight gradients are taken per (tenant, expert, datum) group and the datums' bf16 results
summed in fp32 into the fp32 gradient rows of the slots (`expert_weight_grad`: a micro-batch's
gradient rounded to bf16 as a whole made a split batch's logprobs differ by 2.9e-3 after a step).
On an fp32 base they run in fp32: on a GPU as a bmm per tenant over its expert groups padded to
its tokens (`moe_routing.PaddedGroups`: no count read back, capturable, but E / top-k times the
FLOPs and no tensor cores -- MoE trains at the GPU's pace only in bf16, which the start-up
summary says: `describe_expert_gemms`), on the CPU as torch's loop of one `mm` per group, which
waits for nothing there and computes no padding. A tenant's bits still do not depend on who shares
its batch: its groups, their rows and their order are its own (tests/test_moe_lora.py,
tests/test_lora_precision.py).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from .lora_plan import LoRARouting
from .lora_slots import AdapterSlots, LoRAWeights, SlotStack
from .moe_routing import ExpertRoutes, FrozenGroupedLinear, PairLayout, grouped_mm, pair_layout
from .multi_lora import EXPERT_TARGETS
from .projections import ROLES, Projection

# Tinker's names of the expert projections (cookbook `MergeProfile.expert_key_remaps`).
GATE, DOWN, UP = EXPERT_TARGETS


def lora_dtype(x_dtype: torch.dtype) -> torch.dtype:
    """The dtype the expert LoRA's GEMMs take: bf16 on a bf16 base (CUDA's grouped kernel; fp32
    accumulation inside), else the fp32 of the master weights."""
    return torch.bfloat16 if x_dtype == torch.bfloat16 else torch.float32


def padded_factors(stack: SlotStack, slots: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """A [U*E, r', in] and B [U*E, out, r'] of `slots` (tenant-major, as the groups), in `dtype`,
    the rank padded with zero rows to r' so that every row of x·A spans whole 16 bytes
    (`_grouped_mm`'s stride rule): the same deltas."""
    A = stack.A.index_select(0, slots).flatten(0, 1).to(dtype)
    B = stack.B.index_select(0, slots).flatten(0, 1).to(dtype)
    pad = -stack.rank % (16 // A.element_size())
    if pad:
        A, B = F.pad(A, (0, 0, 0, pad)), F.pad(B, (0, pad))
    return A, B


@dataclass(frozen=True)
class ExpertRun:
    """Consecutive tenants `first`..`end`-1 (indices of the batch's tenants) with an adapter of one
    rank and scaling on a projection: one `ExpertLoRA` call, through `slots`."""

    first: int
    end: int
    rank: int
    scaling: float
    slots: torch.Tensor
    first_slot: int | None  # the slots are first_slot, first_slot + 1, ...: their rows are a slice


def expert_weight_grad(a: torch.Tensor, b: torch.Tensor, routes: ExpertRoutes, run: "ExpertRun") -> torch.Tensor:
    """Σ over each (tenant, expert) group's pairs of a^T b: a [N, p], b [N, q] -> [n*E, p, q] fp32.
    In bf16 per (tenant, expert, datum) group, the bf16 results summed in fp32 (as
    `lora_ops.weight_grad`: a datum's partial gradient is the same in any micro-batch)."""
    if a.dtype != torch.bfloat16:
        return routes.weight_grad(a, b, run.first, run.end)
    datums = routes.layout.datums
    per = grouped_mm(a.t(), b, routes.datum_offsets(run.first, run.end))  # [n*E*datums, p, q]
    return per.view(-1, datums, *per.shape[1:]).float().sum(1) if datums > 1 else per.float()


class ExpertLoRA(torch.autograd.Function):
    """LoRA deltas of pairs grouped by (tenant, expert): x [N, in] -> [N, out], two grouped GEMMs.

    Group u * E + e of the run uses expert e of slot `run.slots[u]` of the stack. The weight
    gradients are added into the stack's fp32 gradient rows of those slots (nothing is returned
    for them); `anchor` makes the backward run where x needs no gradient (as in `GroupedLoRA`)."""

    @staticmethod
    def forward(ctx, x, anchor, stack: SlotStack, run: "ExpertRun", routes: ExpertRoutes):
        A, B = padded_factors(stack, run.slots, lora_dtype(x.dtype))
        xa = x.to(A.dtype)
        h = routes.grouped(xa, A.transpose(1, 2), run.first, run.end)  # [N, r']
        d = routes.grouped(h, B.transpose(1, 2), run.first, run.end).mul_(run.scaling)  # [N, out]; in place: the same bits, one buffer less
        ctx.save_for_backward(xa, A, B, h)
        ctx.stack, ctx.run, ctx.routes, ctx.x_dtype = stack, run, routes, x.dtype
        return d.to(x.dtype)

    @staticmethod
    def backward(ctx, gd):
        x, A, B, h = ctx.saved_tensors
        stack, run, routes = ctx.stack, ctx.run, ctx.routes
        g = gd.to(A.dtype).contiguous() * run.scaling
        grad_B = expert_weight_grad(h, g, routes, run).transpose(1, 2)  # [G, out, r']
        gh = routes.grouped(g, B, run.first, run.end)  # [N, r']
        grad_A = expert_weight_grad(x, gh, routes, run).transpose(1, 2)  # [G, r', in]
        grad_x = routes.grouped(gh, A, run.first, run.end).to(ctx.x_dtype) if ctx.needs_input_grad[0] else None
        n, r = run.slots.shape[0], stack.rank
        grad_A, grad_B = grad_A[:, :r], grad_B[:, :, :r]
        grad_A, grad_B = grad_A.reshape(n, *stack.grad_A.shape[1:]), grad_B.reshape(n, *stack.grad_B.shape[1:])
        if run.first_slot is not None:  # in place on the rows (distinct slots: one add per element either way)
            stack.grad_A[run.first_slot:run.first_slot + n].add_(grad_A)
            stack.grad_B[run.first_slot:run.first_slot + n].add_(grad_B)
        else:
            stack.grad_A.index_add_(0, run.slots, grad_A)
            stack.grad_B.index_add_(0, run.slots, grad_B)
        return grad_x, None, None, None, None


class ExpertProjection(AdapterSlots):
    """One expert projection (w1, w2 or w3) of one MoE layer, as the runtime's layer map sees it:
    the adapters that adapt it and their slot stacks ([slots, E, rank, ...])."""

    def __init__(self, owner: "MultiLoRAExperts", name: str, in_features: int, out_features: int):
        self.owner = owner
        self.name = name
        self.role = "mlp"  # train_mlp covers the experts
        self.part = None  # not a component of a fused projection
        self.routing = owner.routing
        self.in_features = in_features
        self.out_features = out_features
        self.lora_lead = (owner.num_experts,)  # LoRA factors are [E, rank, in] / [E, out, rank]
        self.adapters: dict[str, LoRAWeights] = {}
        self.stacks: dict[int, SlotStack] = {}
        self.members = self.routing.member_set((), None)

    @property
    def slot_device(self) -> torch.device:
        return self.owner.device

    def keep_transposed_weight(self, keep: bool) -> int:
        # The module keeps one copy of both base weights; the gate projection answers for it.
        return self.owner.keep_transposed_weight(keep) if self.name == GATE else 0

    def delta(self, x: torch.Tensor, routes: ExpertRoutes, tenants: list[str | None]
              ) -> list[tuple[tuple[int, int] | None, torch.Tensor]]:
        """(pair span, its deltas) of this projection for x [pairs, in] (sorted by `routes`, whose
        tenants are `tenants`): one `ExpertLoRA` call per run of consecutive tenants of one rank
        and scaling (`ExpertRun`); span None where the run covers every pair."""
        if not self.routing.segments or not self.adapters:
            return []
        out = []
        for run in self.routing.per_layout(("expert runs", self.members), lambda: self._runs(tenants, x.device)):
            start, end = routes.starts[run.first], routes.starts[run.end]
            if start == end:
                continue
            whole = start == 0 and end == routes.pairs
            d = ExpertLoRA.apply(x if whole else x[start:end], self.routing.grad_anchor(x.device),
                                 self.stacks[run.rank], run, routes)
            out.append((None if whole else (start, end), d))
        return out

    def _runs(self, tenants: list[str | None], device: torch.device) -> list[ExpertRun]:
        """The batch's tenants with an adapter here, in runs of consecutive ones of one rank and
        scaling (one slot each: a tenant is one adapter)."""
        runs: list[ExpertRun] = []
        first, kind, slots = 0, None, []
        for u, tenant in enumerate([*tenants, None]):
            w = self.adapters.get(tenant) if tenant is not None else None
            now = None if w is None else (w.rank, w.scaling)
            if now != kind or (w is not None and w.slot in slots):
                if kind is not None:
                    consecutive = slots == list(range(slots[0], slots[0] + len(slots)))
                    runs.append(ExpertRun(first, u, kind[0], kind[1], self.routing.slot_tensor(slots, device),
                                          slots[0] if consecutive else None))
                first, kind, slots = u, now, []
            if w is not None:
                slots.append(w.slot)
        return runs


def _with_deltas(y: torch.Tensor, deltas: list[tuple[tuple[int, int] | None, torch.Tensor]]) -> torch.Tensor:
    """y with each (pair span, delta) added to its pairs; other pairs keep their bits (no +0)."""
    if not deltas:
        return y
    if len(deltas) == 1 and deltas[0][0] is None:
        return y + deltas[0][1]
    pieces, at = [], 0
    for span, d in sorted(deltas, key=lambda sd: sd[0][0]):
        start, end = span
        pieces += [y[at:start], y[start:end] + d]
        at = end
    pieces.append(y[at:])
    return torch.cat([p for p in pieces if p.shape[0]])


class MultiLoRAExperts(nn.Module):
    """A frozen transformers experts module (3-D gate_up/down weights) plus every tenant's per-expert
    LoRA on its gate, up and down projections. Called as the module it replaces:
    (hidden [T, H], top_k_index [T, K], top_k_weights [T, K]) -> [T, H]."""

    def __init__(self, base: nn.Module, routing: LoRARouting):
        super().__init__()
        self.base = base
        self.routing = routing
        self.num_experts = base.num_experts
        self.transposed = bool(base.is_transposed)  # weights stored [E, in, out] (GPT-OSS)
        self.interleaved = not base.is_concatenated  # gate/up columns g0, u0, g1, u1, ...
        E, a, b = base.gate_up_proj.shape
        hidden, inter2 = (a, b) if self.transposed else (b, a)
        self.projections = {GATE: ExpertProjection(self, GATE, hidden, inter2 // 2),
                            UP: ExpertProjection(self, UP, hidden, inter2 // 2),
                            DOWN: ExpertProjection(self, DOWN, inter2 // 2, hidden)}
        self._copies: dict[str, torch.Tensor] | None = None  # see keep_transposed_weight

    @property
    def device(self) -> torch.device:
        """Where the base's experts are now: a sharded pool loads the model on the CPU and moves
        it after the LoRA is attached, so this is read when slots are made, not at build time."""
        return self.base.gate_up_proj.device

    def keep_transposed_weight(self, keep: bool) -> int:
        """Take the input gradients of the base GEMMs from contiguous copies of the weights in the
        forward's layout (as `MultiLoRALinear.keep_transposed_weight`); returns their bytes."""
        self._copies = None
        if keep and not self.transposed:  # stored [E, in, out] (GPT-OSS): the backward reads it so already
            with torch.no_grad():
                self._copies = {n: getattr(self.base, n).transpose(1, 2).contiguous()
                                for n in ("gate_up_proj", "down_proj")}
        return 0 if self._copies is None else sum(t.numel() * t.element_size() for t in self._copies.values())

    def _weights(self, name: str) -> tuple[torch.Tensor, torch.Tensor]:
        """(forward [E, in, out], backward [E, out, in]) views of base weight `name`: the backward
        reads the transpose of a contiguous [E, in, out] tensor where there is one."""
        w = getattr(self.base, name)
        fwd = w if self.transposed else w.transpose(1, 2)
        source = fwd if self._copies is None else self._copies[name]
        return fwd, source.transpose(1, 2)

    def _linear(self, x, name: str, routes: ExpertRoutes):
        y = FrozenGroupedLinear.apply(x, *self._weights(name), routes)
        bias = getattr(self.base, f"{name}_bias", None) if self.base.has_bias else None
        return y if bias is None else y + bias[routes.experts_of_pairs]

    def forward(self, hidden: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor) -> torch.Tensor:
        T, K = top_k_index.shape
        tenants, layout = self._layout(T, K, hidden.device)
        routes = ExpertRoutes(top_k_index, layout, self.num_experts)
        p = self.projections

        def deltas(name: str, x: torch.Tensor):
            return p[name].delta(x, routes, tenants) if tenants else []

        x = hidden.index_select(0, routes.token)
        gate_up = self._with_gate_up_deltas(self._linear(x, "gate_up_proj", routes), deltas(GATE, x), deltas(UP, x))
        h = self.base._apply_gate(gate_up)
        y = _with_deltas(self._linear(h, "down_proj", routes), deltas(DOWN, h))
        y = y * top_k_weights.reshape(-1)[routes.order].unsqueeze(1).to(y.dtype)
        per_pair = torch.empty_like(y).index_copy(0, routes.order, y).view(T, K, -1)
        out = per_pair[:, 0]
        for k in range(1, K):  # elementwise adds: a token's sum never depends on the other tokens
            out = out + per_pair[:, k]
        return out.to(hidden.dtype)

    def _with_gate_up_deltas(self, gate_up: torch.Tensor, gate_d, up_d) -> torch.Tensor:
        """The fused gate/up output with the gate's and the up projection's LoRA deltas added."""
        if len(gate_d) == len(up_d) == 1 and gate_d[0][0] is None is up_d[0][0] and not self.interleaved:
            return gate_up + torch.cat([gate_d[0][1], up_d[0][1]], 1)  # the same adds, in one
        if not gate_d and not up_d:
            return gate_up
        half = gate_up.shape[1] // 2
        gate_cols = slice(0, None, 2) if self.interleaved else slice(0, half)
        up_cols = slice(1, None, 2) if self.interleaved else slice(half, None)
        gate = _with_deltas(gate_up[:, gate_cols], gate_d)
        up = _with_deltas(gate_up[:, up_cols], up_d)
        return torch.stack([gate, up], 2).flatten(1) if self.interleaved else torch.cat([gate, up], 1)

    def _layout(self, tokens: int, top_k: int, device: torch.device) -> tuple[list[str | None], PairLayout]:
        """(the batch's tenants -- the routing segments' adapters in order, rows without one one
        more; [] without a row layout -- and its `PairLayout`), kept per row layout."""
        segments = self.routing.segments
        rows = segments[-1][2] if segments else 0
        per_row = tokens // rows if rows and tokens % rows == 0 else 0
        if not per_row:
            return [], pair_layout(None, None, tokens, top_k, self.num_experts, device)
        tenants = list(dict.fromkeys(adapter_id for adapter_id, _, _ in segments))

        def make() -> PairLayout:
            of_token, datum = [0] * tokens, [0] * tokens
            seen = [0] * len(tenants)  # each tenant's rows so far: its datums, in order
            for adapter_id, start, end in segments:
                u = tenants.index(adapter_id)
                for row in range(start, end):
                    of_token[row * per_row:(row + 1) * per_row] = [u] * per_row
                    datum[row * per_row:(row + 1) * per_row] = [seen[u]] * per_row
                    seen[u] += 1
            return pair_layout(of_token if len(tenants) > 1 else None, datum, tokens, top_k, self.num_experts, device)
        return tenants, self.routing.per_layout(("moe pairs", tokens, top_k, self.num_experts), make)


def describe_expert_gemms(layers: dict) -> str | None:
    """The start-up summary's word on how the LoRA-adapted MoE experts' GEMMs run here (None
    without any): their dtype decides it (`moe_routing.pads_groups`), and off bf16 on a GPU it
    says what that costs."""
    owner = next((layer.owner for layer in layers.values() if isinstance(layer, ExpertProjection)), None)
    if owner is None:
        return None
    weight = owner.base.gate_up_proj
    dtype = str(weight.dtype).removeprefix("torch.")
    if weight.dtype == torch.bfloat16:
        return "MoE experts bfloat16, grouped GEMMs (on CUDA one kernel per tenant, no count read back)"
    if weight.device.type == "cpu":
        return f"MoE experts {dtype}, one GEMM per (tenant, expert) group"
    return (f"MoE experts {dtype}: a batched GEMM per tenant over its expert groups padded to its tokens "
            f"({owner.num_experts} / top-k times the FLOPs, no tensor cores), no count read back; "
            f"MoE trains at the GPU's pace only in bfloat16 (--dtype bfloat16)")


def attach_moe_lora(model: nn.Module, routing: LoRARouting, projections: list[Projection]
                    ) -> dict[str, ExpertProjection]:
    """Replace each experts module `discover` gave a role (those it can adapt) by a
    `MultiLoRAExperts` (in place). Returns {"<experts path>.w1|w2|w3": projection}."""
    out: dict[str, ExpertProjection] = {}
    for proj in projections:
        if proj.kind != "experts" or proj.role not in ROLES:
            continue
        parent_path, _, name = proj.path.rpartition(".")
        wrapped = MultiLoRAExperts(model.get_submodule(proj.path), routing)
        setattr(model.get_submodule(parent_path), name, wrapped)
        out.update({f"{proj.path}.{n}": p for n, p in wrapped.projections.items()})
    return out

