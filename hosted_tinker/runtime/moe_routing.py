"""A MoE layer's routing, planned on the device, and its frozen experts' grouped GEMMs.

Every (token, k) pair of a batch goes to expert `top_k_index[token, k]`. The pairs are sorted by
(tenant, expert) -- the key `tenant * E + expert`, a stable sort, so each group keeps its tokens'
order -- and the end of every (tenant, expert) group in the sorted order comes from
`searchsorted` of the sorted keys: the group offsets that `torch._grouped_mm` takes stay on the
device, and no count is ever read to the host (a CUDA graph can hold the whole MoE step). What
the host does know it takes from the batch's layout, not from the data: which rows are whose
(the routing segments), hence how many pairs each tenant has and where its pairs start in the
sorted order (`PairLayout.starts`). No pair is dropped: every group is as long as its tokens.

The frozen experts' GEMMs run one `_grouped_mm` per tenant over that tenant's expert groups
(`ExpertRoutes.map`): a group's rows are exactly the rows its tenant alone would give that
expert, in the same order, so a tenant's bits do not depend on who shares the batch. (Grouping
all tenants' tokens of an expert together changed a tenant's bits on CPU: an expert's rows are
not independent of how many other rows share its GEMM -- AVX-512, 1 thread: a 1-row group takes
another kernel than a longer one, and with 1024 inputs groups of 1-7 rows also give other bits
than the same rows in a group of 400 -- and on CUDA the grouped kernel picks its tile shape by
the mean group size.) The call count grows with the tenants, not with the experts or the tokens.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


def grouped_mm(x: torch.Tensor, w: torch.Tensor, offs: torch.Tensor) -> torch.Tensor:
    """Rows offs[g-1]:offs[g] of x [N, in] times w[g] [in, out]; or, with x [in, N] and w [N, out]
    (both 2-D), the per-group products [G, in, out] (weight gradients). On CUDA (sm90/sm100) with
    bf16 operands one CUTLASS grouped kernel reads `offs` on the device; any other dtype runs
    torch's fallback, a host loop of one `mm` per group that reads each offset."""
    return torch._grouped_mm(x, w, offs=offs)


@dataclass(frozen=True)
class PairLayout:
    """What the host knows of a batch's (token, expert) pairs, from its row layout alone (kept per
    layout: `LoRARouting.per_layout`): each pair's tenant (None: one tenant), each token's datum
    among its tenant's (None: no row layout) and the most datums a tenant has, the searchsorted
    values that give the groups' ends, and where each tenant's pairs start in the sorted order
    (U + 1 entries, the last the pair count)."""

    tenant_of_pair: torch.Tensor | None  # [T*K] long, on the device
    datum_of_token: torch.Tensor | None  # [T] long, on the device
    datums: int
    group_ends: torch.Tensor  # 1..U*E, long, on the device
    datum_group_ends: torch.Tensor | None  # 1..U*E*datums
    starts: tuple[int, ...]

    @property
    def tenants(self) -> int:
        return len(self.starts) - 1


def pair_layout(tenant_of_token: list[int] | None, datum_of_token: list[int] | None, tokens: int, top_k: int,
                experts: int, device: torch.device) -> PairLayout:
    """The `PairLayout` of `tokens` tokens (each routed to `top_k` experts) whose tenants are
    `tenant_of_token` (indices 0..U-1; None: all one tenant) and whose datums among their tenant's
    are `datum_of_token` (None: not known)."""
    tenants = max(tenant_of_token) + 1 if tenant_of_token is not None else 1
    counts = [0] * tenants
    for u in tenant_of_token or ():
        counts[u] += 1
    starts = [0]
    for n in (counts if tenant_of_token is not None else [tokens]):
        starts.append(starts[-1] + n * top_k)
    of_pair = None
    if tenant_of_token is not None:
        of_pair = torch.tensor(tenant_of_token, dtype=torch.long).repeat_interleave(top_k).to(device)
    datums = max(datum_of_token) + 1 if datum_of_token else 1
    return PairLayout(of_pair, None if datum_of_token is None else torch.tensor(datum_of_token, device=device),
                      datums, torch.arange(1, tenants * experts + 1, device=device),
                      torch.arange(1, tenants * experts * datums + 1, device=device) if datum_of_token else None,
                      tuple(starts))


class ExpertRoutes:
    """One MoE layer's pairs of the current batch, sorted by (tenant, expert) on the device:
    `order` (the sorted pairs' indices into the flat [T*K] pairs), `token` (each sorted pair's
    token), `experts_of_pairs` (its expert) and `offs` (int32 ends of the U*E groups)."""

    def __init__(self, top_k_index: torch.Tensor, layout: PairLayout, experts: int):
        top_k = top_k_index.shape[1]
        flat = top_k_index.reshape(-1)
        key = flat if layout.tenant_of_pair is None else layout.tenant_of_pair * experts + flat
        self.key, self.order = torch.sort(key, stable=True)
        self.token = self.order // top_k
        self.experts_of_pairs = self.key % experts if layout.tenant_of_pair is not None else self.key
        self.offs = torch.searchsorted(self.key, layout.group_ends, out_int32=True)
        self.num_experts = experts
        self.layout = layout
        self.starts = layout.starts
        self._local: dict[tuple, torch.Tensor] = {}
        self._datum_offs: torch.Tensor | None = None

    @property
    def pairs(self) -> int:
        return self.starts[-1]

    def offsets(self, first: int, end: int) -> torch.Tensor:
        """The group ends of tenants first..end-1, counted from the first one's first pair."""
        return self._from_first(self.offs, self.num_experts, first, end)

    def datum_offsets(self, first: int, end: int) -> torch.Tensor:
        """The ends of the (tenant, expert, datum) groups of tenants first..end-1, counted from the
        first one's first pair: the (tenant, expert) groups, each cut where its datums change (its
        pairs are in token order, so datum by datum)."""
        if self._datum_offs is None:
            fine = self.key * self.layout.datums + self.layout.datum_of_token[self.token]
            self._datum_offs = torch.searchsorted(fine, self.layout.datum_group_ends, out_int32=True)
        return self._from_first(self._datum_offs, self.num_experts * self.layout.datums, first, end)

    def _from_first(self, offs: torch.Tensor, per_tenant: int, first: int, end: int) -> torch.Tensor:
        got = self._local.get((per_tenant, first, end))
        if got is None:
            got = offs[first * per_tenant:end * per_tenant]
            if self.starts[first]:
                got = got - self.starts[first]
            self._local[(per_tenant, first, end)] = got
        return got

    def map(self, x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        """Each tenant's pairs of x [pairs, in] times their experts' w [E, in, out] -> [pairs, out]:
        one grouped GEMM per tenant with pairs."""
        outs = [grouped_mm(x[self.starts[u]:self.starts[u + 1]], w, self.offsets(u, u + 1))
                for u in range(len(self.starts) - 1) if self.starts[u + 1] > self.starts[u]]
        return outs[0] if len(outs) == 1 else torch.cat(outs)


class FrozenGroupedLinear(torch.autograd.Function):
    """Frozen expert GEMM `x_g @ w_fwd[e]` per (tenant, expert) group (`ExpertRoutes.map`); its
    input gradient is `gy_g @ w_bwd[e]`, grouped alike (w_bwd [E, out, in]: a view of the stored
    weight, or of a transposed copy, see `MultiLoRAExperts.keep_transposed_weight`). torch's own
    autograd of `_grouped_mm` does not run on CPU (torch 2.13)."""

    @staticmethod
    def forward(ctx, x, w_fwd, w_bwd, routes: ExpertRoutes):
        ctx.w_bwd, ctx.routes = w_bwd, routes  # frozen: nothing for autograd to version-check
        return routes.map(x, w_fwd)

    @staticmethod
    def backward(ctx, gy):
        return ctx.routes.map(gy.contiguous(), ctx.w_bwd), None, None, None
