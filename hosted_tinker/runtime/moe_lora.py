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

Grouped calls: every GEMM is a `torch._grouped_mm` over groups of rows, one group per (tenant,
expert): a group holds exactly the rows its tenant alone would give that expert, in the same
order, and each group is its own GEMM, so a tenant's bits do not depend on who shares the call
(measured: a group's rows equal the same group run alone). That holds for the base projections
too, which run one call per tenant over that tenant's expert groups: unlike a dense projection's
rows, an expert's rows are not independent of how many other rows share its GEMM (AVX-512, 1
thread: a 1-row group takes another kernel than a longer one, and with 1024 inputs groups of 1-7
rows also give other bits than the same rows in a group of 400), so grouping all tenants' tokens
of an expert together changed a tenant's bits as soon as another tenant sent that expert tokens.
Weight gradients come from the same kernel (2-D x 2-D grouped by rows), added into the slots'
gradient rows by index, like `GroupedLoRA`.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from .lora_plan import LoRARouting
from .lora_slots import AdapterSlots, LoRAWeights, SlotStack
from .multi_lora import EXPERT_TARGETS
from .projections import ROLES, Projection

# Tinker's names of the expert projections (cookbook `MergeProfile.expert_key_remaps`).
GATE, DOWN, UP = EXPERT_TARGETS


# `torch._grouped_mm` wants row strides of whole 16 bytes: LoRA ranks are padded to 4 (fp32).
RANK_MULTIPLE = 4


def grouped_mm(x: torch.Tensor, w: torch.Tensor, offs: torch.Tensor) -> torch.Tensor:
    """Rows offs[g-1]:offs[g] of x [N, in] times w[g] [in, out]; or, with x [in, N] and w [N, out]
    (both 2-D), the per-group products [G, in, out] (weight gradients)."""
    return torch._grouped_mm(x, w, offs=offs)


class FrozenGroupedLinear(torch.autograd.Function):
    """Base expert GEMM `x_g @ w_fwd[e]` of frozen weights, one `_grouped_mm` per tenant over its
    expert groups (`TenantGroups`); its input gradient is `gy_g @ w_bwd[e]` grouped alike (w_bwd
    [E, out, in]: a view of the stored weight, or of a transposed copy, see
    `MultiLoRAExperts.keep_transposed_weight`). torch's own autograd of `_grouped_mm` does not
    run on CPU (torch 2.13)."""

    @staticmethod
    def forward(ctx, x, w_fwd, w_bwd, groups: "TenantGroups"):
        ctx.w_bwd, ctx.groups = w_bwd, groups  # frozen: nothing for autograd to version-check
        return groups.map(x, w_fwd)

    @staticmethod
    def backward(ctx, gy):
        return ctx.groups.map(gy.contiguous(), ctx.w_bwd), None, None, None


class TenantGroups:
    """Rows sorted by (tenant, expert): tenant u's rows are `start:end` of the sorted rows, grouped
    by expert at the (local) offsets `offs` -- one `_grouped_mm` each, so that an expert's GEMM
    sees exactly the rows its tenant alone would give it."""

    def __init__(self, key: torch.Tensor, num_experts: int, tenants: int):
        counts = torch.bincount(key, minlength=tenants * num_experts)
        self.offs = counts.cumsum(0).to(torch.int32)  # of all (tenant, expert) groups: an `ExpertLoRA` call's
        counts = counts.view(tenants, num_experts)
        offs = counts.cumsum(1).to(torch.int32)
        self.parts: list[tuple[int, int, torch.Tensor]] = []  # (start, end, offs) of each tenant with rows
        start = 0
        for u, n in enumerate(counts.sum(1).tolist()):
            if n:
                self.parts.append((start, start + n, offs[u]))
            start += n

    def map(self, x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        """Each tenant's rows of x [N, in] times their experts' w [E, in, out] -> [N, out]."""
        outs = [grouped_mm(x[start:end], w, offs) for start, end, offs in self.parts]
        return outs[0] if len(outs) == 1 else torch.cat(outs)


class ExpertLoRA(torch.autograd.Function):
    """LoRA deltas of rows grouped by (tenant, expert): x [N, in] -> [N, out].

    Group g = u * E + e uses expert e of slot `slots[u]` of the stack. The weight gradients are
    added into the stack's gradient rows of those slots (nothing is returned for them); `anchor`
    makes the backward run where x needs no gradient (as in `GroupedLoRA`)."""

    @staticmethod
    def forward(ctx, x, anchor, stack: SlotStack, slots: torch.Tensor, offs: torch.Tensor, scaling: float):
        A = stack.A.index_select(0, slots).flatten(0, 1)  # [U*E, r, in]
        B = stack.B.index_select(0, slots).flatten(0, 1)  # [U*E, out, r]
        pad = -stack.rank % RANK_MULTIPLE
        if pad:  # zero rank rows: the same deltas, and rows of h whose stride _grouped_mm takes
            A, B = F.pad(A, (0, 0, 0, pad)), F.pad(B, (0, pad))
        xa = x.to(A.dtype)
        h = grouped_mm(xa, A.transpose(1, 2), offs)  # [N, r]
        d = grouped_mm(h, B.transpose(1, 2), offs).mul_(scaling)  # [N, out]; in place: the same bits, one buffer less
        ctx.save_for_backward(xa, A, B, h)
        ctx.stack, ctx.slots, ctx.offs, ctx.scaling, ctx.x_dtype = stack, slots, offs, scaling, x.dtype
        return d.to(x.dtype)

    @staticmethod
    def backward(ctx, gd):
        x, A, B, h = ctx.saved_tensors
        offs, stack = ctx.offs, ctx.stack
        g = gd.to(A.dtype).contiguous() * ctx.scaling
        grad_B = grouped_mm(h.t(), g, offs).transpose(1, 2)  # [G, out, r]
        gh = grouped_mm(g, B, offs)  # [N, r]
        grad_A = grouped_mm(x.t(), gh, offs).transpose(1, 2)  # [G, r, in]
        grad_x = grouped_mm(gh, A, offs).to(ctx.x_dtype) if ctx.needs_input_grad[0] else None
        n, r = ctx.slots.shape[0], stack.rank
        grad_A, grad_B = grad_A[:, :r], grad_B[:, :, :r]
        stack.grad_A.index_add_(0, ctx.slots, grad_A.reshape(n, *stack.grad_A.shape[1:]))
        stack.grad_B.index_add_(0, ctx.slots, grad_B.reshape(n, *stack.grad_B.shape[1:]))
        return grad_x, None, None, None, None, None


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

    def delta(self, x: torch.Tensor, token_of_row: torch.Tensor, expert_of_row: torch.Tensor,
              tokens_per_row: int, tenants: list[str | None], groups: TenantGroups
              ) -> list[tuple[torch.Tensor | None, torch.Tensor]]:
        """(rows, their deltas) of this projection for x [N, in] (rows sorted by the base's
        `groups`, of `tenants`): one `ExpertLoRA` call per rank among the batch's adapters; rows
        None where the call's rows are all of x's, in x's order."""
        segments = self.routing.segments
        if not segments or not self.adapters:
            return []
        same = self._base_grouping(tenants)
        if same is not None:
            rank, scaling, slots = same
            slot_t = torch.tensor(slots, dtype=torch.long, device=x.device)
            return [(None, ExpertLoRA.apply(x, self.routing.grad_anchor(x.device), self.stacks[rank], slot_t,
                                            groups.offs, scaling))]
        out = []
        kinds = {(w.rank, w.scaling) for w in self.adapters.values()}
        for rank, scaling in sorted(kinds):  # one call per rank and scaling, as `LoRACall`
            slots: list[int] = []
            user = torch.full((segments[-1][2] * tokens_per_row,), -1, dtype=torch.long)
            for adapter_id, start, end in segments:
                w = self.adapters.get(adapter_id) if adapter_id is not None else None
                if w is None or (w.rank, w.scaling) != (rank, scaling):
                    continue
                if w.slot not in slots:
                    slots.append(w.slot)
                user[start * tokens_per_row:end * tokens_per_row] = slots.index(w.slot)
            if not slots:
                continue
            E = self.owner.num_experts
            u = user.to(x.device)[token_of_row]
            rows = torch.nonzero(u >= 0).squeeze(1)
            key = u[rows] * E + expert_of_row[rows]
            key, order = torch.sort(key, stable=True)  # by (tenant, expert), each in token order
            rows = rows[order]
            offs = torch.cumsum(torch.bincount(key, minlength=len(slots) * E), 0).to(torch.int32)
            slot_t = torch.tensor(slots, dtype=torch.long, device=x.device)
            d = ExpertLoRA.apply(x.index_select(0, rows), self.routing.grad_anchor(x.device), self.stacks[rank], slot_t, offs,
                                 scaling)
            out.append((rows, d))
        return out

    def _base_grouping(self, tenants: list[str | None]) -> tuple[int, float, list[int]] | None:
        """(rank, scaling, slot of each tenant) where every tenant of the batch has an adapter here,
        all of one rank and scaling: then the LoRA's (tenant, expert) groups are the base GEMMs'
        own, the same rows in the same order, and x needs no gather nor the deltas a scatter."""
        ws = [self.adapters.get(t) if t is not None else None for t in tenants]
        if None in ws or len({(w.rank, w.scaling) for w in ws}) != 1 or len({w.slot for w in ws}) != len(ws):
            return None
        return ws[0].rank, ws[0].scaling, [w.slot for w in ws]


def _with_deltas(y: torch.Tensor, deltas: list[tuple[torch.Tensor, torch.Tensor]]) -> torch.Tensor:
    """y with each (rows, delta) added to its rows; other rows keep their bits (no +0)."""
    for rows, d in deltas:
        y = y + d if rows is None else y.index_add(0, rows, d)
    return y


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

    def _linear(self, x, name: str, groups: TenantGroups, experts):
        y = FrozenGroupedLinear.apply(x, *self._weights(name), groups)
        bias = getattr(self.base, f"{name}_bias", None) if self.base.has_bias else None
        return y if bias is None else y + bias[experts]

    def forward(self, hidden: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor) -> torch.Tensor:
        T, K = top_k_index.shape
        E = self.num_experts
        rows_total = self.routing.segments[-1][2] if self.routing.segments else 0
        per_row = T // rows_total if rows_total and T % rows_total == 0 else 0
        ids = list(dict.fromkeys(adapter_id for adapter_id, _, _ in self.routing.segments))
        tenant, tenants = self._tenant_of_tokens(ids, per_row, hidden.device)
        flat = top_k_index.reshape(-1)
        key = flat if tenant is None else tenant.repeat_interleave(K) * E + flat
        key, order = torch.sort(key, stable=True)  # (token, k) pairs by (tenant, expert), each in token order
        experts = key % E
        token = order // K
        groups = TenantGroups(key, E, tenants)
        p = self.projections

        def deltas(name: str, x: torch.Tensor):
            return p[name].delta(x, token, experts, per_row, ids, groups) if per_row else []

        x = hidden.index_select(0, token)
        gate_up = self._linear(x, "gate_up_proj", groups, experts)
        gate_d, up_d = deltas(GATE, x), deltas(UP, x)
        if len(gate_d) == len(up_d) == 1 and gate_d[0][0] is None is up_d[0][0] and not self.interleaved:
            gate_up = gate_up + torch.cat([gate_d[0][1], up_d[0][1]], 1)  # the same adds, in one
        elif gate_d or up_d:
            half = gate_up.shape[1] // 2
            gate_cols = slice(0, None, 2) if self.interleaved else slice(0, half)
            up_cols = slice(1, None, 2) if self.interleaved else slice(half, None)
            gate = _with_deltas(gate_up[:, gate_cols], gate_d)
            up = _with_deltas(gate_up[:, up_cols], up_d)
            gate_up = (torch.stack([gate, up], 2).flatten(1) if self.interleaved else torch.cat([gate, up], 1))
        h = self.base._apply_gate(gate_up)
        y = _with_deltas(self._linear(h, "down_proj", groups, experts), deltas(DOWN, h))
        y = y * top_k_weights.reshape(-1)[order].unsqueeze(1).to(y.dtype)
        per_pair = torch.empty_like(y).index_copy(0, order, y).view(T, K, -1)
        out = per_pair[:, 0]
        for k in range(1, K):  # elementwise adds: a token's sum never depends on the other tokens
            out = out + per_pair[:, k]
        return out.to(hidden.dtype)

    def _tenant_of_tokens(self, ids: list[str | None], per_row: int, device: torch.device
                          ) -> tuple[torch.Tensor | None, int]:
        """(the tenant index of each token, the number of tenants) of the current batch: a tenant is
        one of `ids`, the routing segments' adapters in order (rows without one are one more);
        (None, 1) where the batch has a single tenant or no row layout."""
        segments = self.routing.segments
        if not per_row or len(ids) < 2:
            return None, 1
        tenant = torch.empty(segments[-1][2] * per_row, dtype=torch.long)
        for adapter_id, start, end in segments:
            tenant[start * per_row:end * per_row] = ids.index(adapter_id)
        return tenant.to(device), len(ids)


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

