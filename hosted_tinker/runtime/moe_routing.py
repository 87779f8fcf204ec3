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

CUDA's grouped kernel takes bf16 only; for any other dtype torch's `_grouped_mm` copies the offsets
to the host and loops one `mm` per group. So off bf16 on a device (`pads_groups`: an fp32 body on a
GPU) each tenant's groups are padded to a bound the host knows -- the tenant's tokens, since a
token's top-k experts are distinct -- and run as one `bmm` (`PaddedGroups`): nothing read back,
capturable, each tenant's shapes its own (its own bits), at E / top-k times the expert GEMMs'
FLOPs. On the CPU, where the loop waits for nothing, fp32 keeps it.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


def grouped_mm(x: torch.Tensor, w: torch.Tensor, offs: torch.Tensor) -> torch.Tensor:
    """Rows offs[g-1]:offs[g] of x [N, in] times w[g] [in, out]; or, with x [in, N] and w [N, out]
    (both 2-D), the per-group products [G, in, out] (weight gradients). On CUDA (sm90/sm100) with
    bf16 operands one CUTLASS grouped kernel reads `offs` on the device; any other dtype runs
    torch's fallback, which copies `offs` to the host and loops one `mm` per group."""
    return torch._grouped_mm(x, w, offs=offs)


def pads_groups(x: torch.Tensor) -> bool:
    """Whether x's grouped GEMMs run as a bmm per tenant over padded groups (`PaddedGroups`): off
    bf16 on a device. There CUDA's grouped kernel does not run (bf16 only), and torch's fallback
    waits for the offsets and cannot be captured. On the CPU that loop waits for nothing (the
    offsets are host memory) and computes no padding rows: on the 8-expert, top-2 body of
    benchmarks/bodies.py (2 x 64 tokens a tenant, 1 thread) a padded fp32 cycle took 1.9x as long
    as the loop's at one tenant and 2.6x at 16."""
    return x.dtype != torch.bfloat16 and x.device.type != "cpu"


@dataclass(frozen=True)
class PaddedGroups:
    """G consecutive groups of rows (ends `offs`, on the device), each of at most `cap` rows, laid
    out as a [G, cap] batch: group g's rows first in entry g, in their order, then padding rows.
    A grouped GEMM runs on it as one `bmm` -- one kernel, no count read to the host, capturable --
    at G * cap rows' FLOPs instead of N's (an expert's group of a tenant holds at most the tenant's
    tokens: E / top-k times the FLOPs). `source` [G * cap]: each batch row's row (a padding row
    copies row 0; `padding` says which they are); `slot` [N]: each row's batch row."""

    source: torch.Tensor
    padding: torch.Tensor  # [G * cap, 1] bool
    slot: torch.Tensor
    groups: int
    cap: int

    @classmethod
    def of(cls, offs: torch.Tensor, rows: int, cap: int) -> "PaddedGroups":
        ends = offs.long()
        begins = torch.cat([ends.new_zeros(1), ends[:-1]])
        lengths = ends - begins
        torch._assert_async((lengths <= cap).all())  # on the device: a longer group never goes unseen
        at = torch.arange(cap, device=offs.device)
        padding = at >= lengths[:, None]  # [G, cap]
        source = (begins[:, None] + at).masked_fill_(padding, 0).flatten()
        row = torch.arange(rows, device=offs.device)
        group = torch.searchsorted(ends, row, right=True)
        return cls(source, padding.view(-1, 1), group * cap + row - begins[group], offs.shape[0], cap)

    def _pad(self, x: torch.Tensor, zeros: bool) -> torch.Tensor:
        """x [N, d] -> [G, cap, d]; the padding rows zero only where they are summed (a gather:
        CPU's index_copy_ into zeros took 4x as long)."""
        out = x.index_select(0, self.source)
        return (out.masked_fill_(self.padding, 0) if zeros else out).view(self.groups, self.cap, -1)

    def mm(self, x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        """`grouped_mm(x, w, offs)` for x [N, in], w [G, in, out]: one bmm (a row of a GEMM reads no
        other row, so what the padding rows hold is never seen)."""
        y = torch.bmm(self._pad(x, zeros=False), w)
        return y.view(-1, y.shape[-1]).index_select(0, self.slot)

    def weight_mm(self, a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
        """Σ over each group's rows of a^T b: a [N, p], b [N, q] -> [G, p, q], one bmm (the padding
        rows are zero in both: they add exact zeros, and no 0 * inf)."""
        return torch.bmm(self._pad(a, zeros=True).transpose(1, 2), self._pad(b, zeros=True))


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
        self.top_k = top_k
        self.layout = layout
        self.starts = layout.starts
        self._local: dict[tuple, torch.Tensor | PaddedGroups] = {}  # offsets and padded groups of tenant spans
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

    def padded(self, u: int) -> PaddedGroups:
        """Tenant u's expert groups as a `PaddedGroups`: a token's top-k experts are distinct, so an
        expert's group holds at most the tenant's tokens."""
        got = self._local.get(("padded", u))
        if got is None:
            pairs = self.starts[u + 1] - self.starts[u]
            got = self._local[("padded", u)] = PaddedGroups.of(self.offsets(u, u + 1), pairs, pairs // self.top_k)
        return got

    def _tenants(self, first: int, end: int):
        """(u, its first and end pair counted from tenant `first`'s first pair) of tenants first..end-1."""
        return [(u, self.starts[u] - self.starts[first], self.starts[u + 1] - self.starts[first])
                for u in range(first, end)]

    def grouped(self, x: torch.Tensor, w: torch.Tensor, first: int, end: int) -> torch.Tensor:
        """x [pairs of tenants first..end-1, in] times w[g] [in, out] per (tenant, expert) group g
        (w: [(end - first) * E, in, out]): one grouped GEMM, or where `pads_groups` one bmm per
        tenant over its `padded` groups -- shapes of the tenant's own, and so its own bits."""
        if not pads_groups(x):
            return grouped_mm(x, w, self.offsets(first, end))
        E = self.num_experts
        outs = [self.padded(u).mm(x[a:b], w[(u - first) * E:(u - first + 1) * E])
                for u, a, b in self._tenants(first, end) if b > a]
        return outs[0] if len(outs) == 1 else torch.cat(outs)

    def weight_grad(self, a: torch.Tensor, b: torch.Tensor, first: int, end: int) -> torch.Tensor:
        """Σ over each (tenant, expert) group's pairs of a^T b: a [N, p], b [N, q] -> [(end - first)
        * E, p, q], as `grouped` runs them (bf16's, per datum: moe_lora.expert_weight_grad)."""
        if not pads_groups(a):
            return grouped_mm(a.t(), b, self.offsets(first, end))
        return torch.cat([self.padded(u).weight_mm(a[i:j], b[i:j]) if j > i
                          else a.new_zeros(self.num_experts, a.shape[1], b.shape[1])
                          for u, i, j in self._tenants(first, end)])

    def map(self, x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        """Each tenant's pairs of x [pairs, in] times their experts' w [E, in, out] -> [pairs, out]:
        one grouped GEMM (or bmm) per tenant with pairs."""
        outs = [self.grouped(x[self.starts[u]:self.starts[u + 1]], w, u, u + 1)
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
