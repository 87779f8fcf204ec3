"""`FusionPolicy`: which kernel calls several tenants may share on this machine, proven by probes.

The runtime promises every tenant the bits it would get alone, whoever it is co-batched with.
A shared kernel call keeps that promise only if its result for one tenant's rows does not
depend on the other rows in the call, and that is a property of the kernels, not of the math.
Measured on one Intel Xeon (AVX-512, torch 2.13 CPU, MKL):

- `x @ W.T`: row i has the same bits for any row count M in 70 of 70 LoRA-model shapes with the
  default kernels, but in only 37 of 70 under `ATEN_CPU_CAPABILITY=avx2
  ONEDNN_MAX_CPU_ISA=AVX2 MKL_ENABLE_INSTRUCTIONS=AVX2` (MKL picks its kernel by M, even
  single-threaded: 32 rows alone differ from the same rows inside 64).
- `torch.bmm`: entry 0 of a one-entry batch differs from the same entry in a batch of 2+ in
  14-18 of 72 LoRA shapes (default and AVX2 kernels); batches of 2, 3, 4, 8, 16 agree.
- elementwise ops: sigmoid/silu give other bits in the vectorized body than in the scalar tail
  of ATen's loops (753 of 20000 values), and thread chunks split at ceil(numel / threads), so
  where a tenant's values fall depends on the others' row count.

So the canonical computation is what a tenant computes alone, and a fused call is used only
where a probe on this machine, this model, dtype and thread count has shown that it gives the
canonical bits; otherwise the runtime makes the canonical per-tenant calls (exact by
construction, slower). Each decision is proven lazily per shape and cached:

- `mix_tenants(width, rows)`: may a micro-batch of `rows` rows x `width` tokens hold several
  tenants? Probed on the real model (forward, backward and a no-grad forward): blocks of 1-3
  rows at the start, middle and end of such a batch must equal the same rows run alone
  (logprobs and input gradients, bit for bit). The runtime runs this once at start-up for the
  shortest bucket and a full micro-batch; if it fails there, mixing is off for the whole run.
  Covered: the base model's projections, attention, norms, activations and the log-softmax.
- `group_lora(tokens, in, out, rank, n, dtype, datums)`: may n tenants' LoRA deltas share one batched
  matmul (`lora_ops.lora_delta` / `GroupedLoRA`)? Probed on the kernel itself with random data:
  entries 0 and n-1 of an n-entry batch must equal their canonical two-entry batch (output and
  all gradients), with the incoming gradient row-major and transposed.
- `stacked_norms(rows, inner, dtype)`: may the optimizer take every tenant's gradient (and
  weight) norms from one reduction per slot stack? Probed the same way (`row_norms`).

Loss blocks are never merged across tenants (`exp` runs in the same vector/scalar loops as
sigmoid and gains little from merging), and the optimizer works tensor by tensor.
"""

from __future__ import annotations

import logging
from typing import Callable

import torch

from .lora_ops import lora_backward, lora_forward

log = logging.getLogger(__name__)

_INT_VIEW = {torch.float32: torch.int32, torch.bfloat16: torch.int16, torch.float16: torch.int16,
             torch.float64: torch.int64}


def same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Bitwise equality (torch.equal calls -0.0 and 0.0 equal, and NaN unequal to itself)."""
    if a.shape != b.shape or a.dtype != b.dtype:
        return False
    view = _INT_VIEW.get(a.dtype)
    if view is None:
        return torch.equal(a, b)
    return torch.equal(a.contiguous().view(view), b.contiguous().view(view))


def probe_blocks(rows: int) -> list[tuple[int, int]]:
    """(offset, rows) of the blocks a mixing probe plants in a batch of `rows` rows: 1 row at the
    start, 2 in the middle, 3 at the end (or 1, when 3 do not fit), never overlapping."""
    out: list[tuple[int, int]] = []
    for o, r in ((0, 1), ((rows - 2) // 2, 2), (rows - 3, 3), (rows - 1, 1)):
        if 0 <= o and r < rows and o + r <= rows and all(o + r <= a or a + n <= o for a, n in out):
            out.append((o, r))
    return out


class RowIndependenceProbe:
    """Do blocks of rows get the same bits inside a batch as in a batch of their own?

    `sample(width, rows, seed)` makes probe inputs (tensors with rows on dim 0) and `run(*inputs)`
    returns outputs with rows on dim 0. The blocks' contents depend only on (width, block size),
    so each block is run alone once per width (and thread count): a new batch shape costs one
    run of the whole batch.
    """

    def __init__(self, sample: Callable[[int, int, int], tuple[torch.Tensor, ...]],
                 run: Callable[..., tuple[torch.Tensor, ...]]):
        self._sample = sample
        self._run = run
        self._alone: dict[tuple[int, int, int], tuple[torch.Tensor, ...]] = {}

    def __call__(self, width: int, rows: int) -> bool:
        blocks = probe_blocks(rows)
        contents = {r: self._sample(width, r, r) for _, r in blocks}
        whole = self._sample(width, rows, 1000 + rows)
        for o, r in blocks:
            for t, c in zip(whole, contents[r]):
                t[o:o + r] = c
        outputs = self._run(*whole)
        for o, r in blocks:
            key = (width, r, torch.get_num_threads())
            if key not in self._alone:
                self._alone[key] = self._run(*contents[r])
            if not all(same_bits(w[o:o + r], a) for w, a in zip(outputs, self._alone[key])):
                return False
        return True


def grouped_lora_matches_pairs(tokens: int, in_features: int, out_features: int, rank: int, n: int,
                               dtype: torch.dtype, device: torch.device, datums: int = 1) -> bool:
    """Do entries 0 and n-1 of an n-entry `lora_forward`/`lora_backward` get the bits of their
    canonical two-entry batch (the entry and a copy of itself)? Random data, real shapes; each
    entry's tokens are `datums` datums (a bf16 weight gradient is taken per datum)."""
    gen = torch.Generator(device="cpu").manual_seed(1234 + n)

    def rand(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=gen).to(device=device, dtype=dtype)

    # The n entries as a view into a larger buffer, as a group's rows sit inside a micro-batch;
    # activations in the model's dtype, the factors fp32 (the master weights the kernel computes in).
    xs = rand(n + 1, tokens, in_features)[1:]
    A, B = rand(n, rank, in_features).float(), rand(n, out_features, rank).float()
    h, d = lora_forward(xs, A, B, 2.0)
    # The gradient arrives in the layout autograd hands over: row-major, or (one row per tenant
    # under a consumer that transposes its input, e.g. attention's heads) transposed. The
    # canonical pair (`GroupedLoRA` concatenates the entry with itself) is row-major either way.
    gd_rows = rand(n, tokens, out_features)
    gd_cols = rand(n, out_features, tokens)
    for gd, pair_gd in ((gd_rows, lambda pair: gd_rows[pair]),
                        (gd_cols.transpose(1, 2), lambda pair: gd_cols[pair].transpose(1, 2).contiguous())):
        gx, gA, gB = lora_backward(gd, xs, A, B, h, 2.0, True, datums)
        for e in {0, n - 1}:
            pair = [e, e]
            xs2 = xs[pair]
            h2, d2 = lora_forward(xs2, A[pair], B[pair], 2.0)
            gx2, gA2, gB2 = lora_backward(pair_gd(pair), xs2, A[pair], B[pair], h2, 2.0, True, datums)
            if not all(same_bits(a[e], b[0]) for a, b in ((d, d2), (gx, gx2), (gA, gA2), (gB, gB2))):
                return False
    return True


def row_norms(t: torch.Tensor) -> torch.Tensor:
    """L2 norm of each row of t [n, ...] -> [n] (float32 on the tensor's device): one reduction op
    (a product and a sum were two, per stack and step).

    Canonical for one tensor: a batch of two, the tensor and a copy (a one-row reduction may
    split its row across threads, see `stacked_norms`)."""
    return torch.linalg.vector_norm(t, dim=tuple(range(1, t.dim())))


def row_norms_match_pairs(rows: int, inner: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> bool:
    """Do rows 0 and rows-1 of `row_norms` over `rows` rows get their canonical pair's bits?"""
    gen = torch.Generator(device="cpu").manual_seed(4321 + rows)
    t = torch.randn(rows + 1, *inner, generator=gen).to(device=device, dtype=dtype)[1:]
    whole = row_norms(t)
    return all(same_bits(whole[e], row_norms(t[[e, e]])[0]) for e in {0, rows - 1})


class FusionPolicy:
    """The fusions proven on this machine, decided lazily per shape (and per CPU thread count).

    `mixing_probe(width, rows) -> bool` runs the model (the runtime supplies it; None = never
    mix); `grouping_probe` checks the grouped LoRA kernel.
    """

    def __init__(self, device: torch.device, *, mixing_probe: Callable[[int, int], bool] | None,
                 grouping_probe: Callable[..., bool] = grouped_lora_matches_pairs,
                 norms_probe: Callable[..., bool] = row_norms_match_pairs):
        self.device = device
        self._mixing_probe = mixing_probe
        self._grouping_probe = grouping_probe
        self._norms_probe = norms_probe
        self._mix: dict[tuple, bool] = {}
        self._group: dict[tuple, bool] = {}
        self._norms: dict[tuple, bool] = {}
        self.mixing_refused: str | None = None if mixing_probe is not None else "no model probe"
        # How the frozen projections' input gradients are taken (TrainingRuntime.check_fusion).
        self.input_grads = "autograd"
        self._refusals_logged: set[tuple] = set()

    def _first_refusal(self, shape: tuple) -> bool:
        """Whether this is the first refusal for a layer's shape: each is logged once, at INFO (a
        routine choice of kernels, nothing to act on; `describe` counts them all), not once per
        batch shape (hundreds in minutes)."""
        if shape in self._refusals_logged:
            return False
        self._refusals_logged.add(shape)
        return True

    def _threads(self) -> int:
        # CPU kernels split work by thread count (see the module docstring); a GPU's do not.
        return torch.get_num_threads() if self.device.type == "cpu" else 0

    def check_at_startup(self, width: int, rows: int) -> bool:
        """Probe mixing once for a representative micro-batch; if it fails, never mix."""
        ok = self.mix_tenants(width, rows)
        if not ok:
            self.mixing_refused = (f"a {rows} x {width} micro-batch gave rows other bits than the same rows "
                                   "alone at start-up")
        log.info("fusion policy on %s: %s", self.device, self.describe())
        return ok

    def mix_tenants(self, width: int, rows: int) -> bool:
        if self.mixing_refused is not None:
            return False
        key = (width, rows, self._threads())
        ok = self._mix.get(key)
        if ok is None:
            ok = self._mix[key] = bool(self._mixing_probe(width, rows))
            if not ok:
                log.info("tenants will not share %d x %d micro-batches on this machine (%d threads): "
                         "rows change bits with the batch; each tenant runs its own", rows, width, key[2])
        return ok

    def group_lora(self, tokens: int, in_features: int, out_features: int, rank: int, n: int,
                   dtype: torch.dtype, datums: int = 1) -> bool:
        key = (tokens, in_features, out_features, rank, n, dtype, datums, self._threads())
        ok = self._group.get(key)
        if ok is None:
            with torch.no_grad():
                ok = self._group[key] = bool(self._grouping_probe(tokens, in_features, out_features, rank, n,
                                                                  dtype, self.device, datums))
            if not ok and self._first_refusal(("group", in_features, out_features, rank, dtype)):
                log.info("LoRA deltas of rank %d, %dx%d (%s) will not share a batched matmul at some batch "
                         "shapes on this machine (first: %d tenants, %d tokens): entries change bits with the batch; "
                         "each tenant's delta is its own call there", rank, in_features, out_features,
                         str(dtype).removeprefix("torch."), n, tokens)
        return ok

    def stacked_norms(self, rows: int, inner: tuple[int, ...], dtype: torch.dtype) -> bool:
        """May the gradient norms of many tenants' slots come from one reduction over a slot stack
        [rows, *inner]? (ATen reduces a single row with several threads when the output has one
        element, and a row per thread otherwise, so one tensor alone is summed in another order.)"""
        key = (rows, inner, dtype, self._threads())
        ok = self._norms.get(key)
        if ok is None:
            with torch.no_grad():
                ok = self._norms[key] = bool(self._norms_probe(rows, inner, dtype, self.device))
            if not ok and self._first_refusal(("norms", inner, dtype)):
                log.info("gradient norms of [%s] slot stacks are summed per tenant on this machine (first: %d rows)",
                         "x".join(map(str, inner)), rows)
        return ok

    def describe(self) -> dict:
        """What was proven and refused so far (for logs, /metrics and health reports)."""
        return {
            "device": str(self.device),
            "cpu_capability": torch.backends.cpu.get_cpu_capability() if self.device.type == "cpu" else None,
            "threads": self._threads(),
            "mix_tenants": self.mixing_refused is None,
            "mix_tenants_refused_because": self.mixing_refused,
            "frozen_input_grads": self.input_grads,
            "mix_shapes_proven": sum(self._mix.values()),
            "mix_shapes_refused": len(self._mix) - sum(self._mix.values()),
            "grouped_lora_shapes_proven": sum(self._group.values()),
            "grouped_lora_shapes_refused": len(self._group) - sum(self._group.values()),
            "stacked_norm_shapes_proven": sum(self._norms.values()),
            "stacked_norm_shapes_refused": len(self._norms) - sum(self._norms.values()),
        }
