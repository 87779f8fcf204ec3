"""The packing plan: which rows of a fused pass go to which micro-batch, padded how, in what order.

One function (`pack`) decides it for the in-process runtime and for every rank of a worker pool,
from the requests' shapes alone (model, datum lengths, forward-only, kind) -- no model, no
tensors -- so it is tested on its own (tests/test_packing.py).

The rules, and why each keeps a tenant's bits independent of who shares the cycle:

- **Width buckets.** Every row is right-padded to `bucket_width(its own length)`; a row's padding
  never depends on the other rows.
- **Pieces.** A model's rows of one bucket are cut, in request order, into pieces of at most
  `max_rows(budget, width)` rows: the micro-batches it would run alone. Pieces depend on that model's
  own rows only, so it runs the same row blocks, accumulating its gradients in the same order,
  alone or co-batched.
- **Sharing.** Pieces of several models share a micro-batch only where `may_mix(width, rows)`
  says the base model keeps each row's bits in a batch of that shape (the `FusionPolicy`'s
  probe on CPU; batch-invariant kernels on CUDA); otherwise each piece runs on its own.
- **Kinds.** Requests of different `kind`s never share a micro-batch: the runtime runs a
  micro-batch of one kind as a CUDA graph and of another eagerly (losses whose metrics are
  computed on the host), and a tenant must not change path because of a neighbour.
- **Order.** Inside a micro-batch, pieces are sorted by `order_key(model_id)` (the adapter's
  shape), then size and model id, so that adapters of one shape sit side by side and the LoRA
  layers batch them into one call. The order of pieces changes no model's results: shared
  micro-batches only exist where rows are independent.

Gradient micro-batches come first, then forward-only ones (a pool's ranks report between the
two phases).
"""

from __future__ import annotations

from collections.abc import Callable, Hashable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any, NamedTuple


def bucket_width(n: int) -> int:
    """Padded width for a sequence of n tokens: 16, 24, 32, 48, 64, 96, ... (at most 1.5x n)."""
    width = 16
    while width < n:
        width = width * 3 // 2 if (width & (width - 1)) == 0 else width * 4 // 3
    return width


def max_rows(budget: int, width: int) -> int:
    """The most rows a micro-batch of this width holds under a budget of `budget` tokens: what
    packing cuts pieces by, and what the start-up fusion probe checks (kernel_choices.py)."""
    return max(1, budget // width)


@dataclass(frozen=True)
class RequestShape:
    """What packing needs to know of one forward / forward_backward request."""

    model_id: str
    lengths: tuple[int, ...]  # tokens of each datum, in request order
    forward_only: bool = False
    kind: Hashable = 0  # requests of different kinds never share a micro-batch


Row = tuple[int, int]  # (request index, datum index)


class RowRange(NamedTuple):
    """Rows start..end-1 of a micro-batch that share `key`: a model id (one adapter's rows) or a
    request index (one loss's rows)."""
    key: Any
    start: int
    end: int


def segments_of(row_keys: list) -> list[RowRange]:
    """Runs of equal consecutive keys: rows -> adapter, rows -> request."""
    segs: list[RowRange] = []
    for r, key in enumerate(row_keys):
        if segs and segs[-1].key == key:
            segs[-1] = segs[-1]._replace(end=r + 1)
        else:
            segs.append(RowRange(key, r, r + 1))
    return segs


@dataclass(frozen=True)
class MicroBatch:
    """One fused forward (and backward, if `grad`) over `rows`, each padded to `width` tokens."""

    grad: bool
    width: int
    rows: tuple[Row, ...]
    lengths: tuple[int, ...]  # real tokens of each row
    segments: tuple[RowRange, ...]  # keyed by model id: one adapter each
    runs: tuple[RowRange, ...]  # keyed by request index: one loss each
    kind: Hashable = 0

    @property
    def tokens(self) -> int:
        return sum(self.lengths)

    @property
    def padded_tokens(self) -> int:
        return len(self.rows) * self.width

    @property
    def shared(self) -> bool:
        return len(self.segments) > 1


@dataclass
class PackingPlan:
    micro_batches: list[MicroBatch] = field(default_factory=list)

    def phase(self, grad: bool) -> list[MicroBatch]:
        return [mb for mb in self.micro_batches if mb.grad == grad]

    def counts(self) -> tuple[int, int]:
        """(gradient micro-batches, forward-only micro-batches)."""
        return len(self.phase(True)), len(self.phase(False))


@dataclass(frozen=True)
class Candidate:
    """A micro-batch before the sharing question: per-model pieces of one bucket and kind."""

    grad: bool
    width: int
    kind: Hashable
    pieces: tuple[tuple[Row, ...], ...]

    @property
    def rows(self) -> int:
        return sum(len(p) for p in self.pieces)


def candidates(requests: Sequence[RequestShape], budget: int) -> Iterator[Candidate]:
    """Per phase, bucket and kind: each model's rows cut into pieces, packed greedily by model id."""
    for grad in (True, False):
        buckets: dict[tuple, dict[str, list[Row]]] = {}
        for ri, req in enumerate(requests):
            if req.forward_only == grad:
                continue
            for di, n in enumerate(req.lengths):
                key = (bucket_width(n), _sortable(req.kind))
                buckets.setdefault(key, {}).setdefault(req.model_id, []).append((ri, di))
        for (width, kind) in sorted(buckets):
            cap = max_rows(budget, width)
            batch: list[tuple[Row, ...]] = []
            size = 0
            for model_id in sorted(buckets[(width, kind)]):
                group = buckets[(width, kind)][model_id]
                for i in range(0, len(group), cap):
                    piece = tuple(group[i:i + cap])
                    if batch and size + len(piece) > cap:
                        yield Candidate(grad, width, kind[1], tuple(batch))
                        batch, size = [], 0
                    batch.append(piece)
                    size += len(piece)
            if batch:
                yield Candidate(grad, width, kind[1], tuple(batch))


def _sortable(kind: Hashable) -> tuple[str, Hashable]:
    return (repr(kind), kind)  # kinds of any type, in a stable order


def shared_shapes(requests: Sequence[RequestShape], budget: int) -> set[tuple[int, int]]:
    """(width, rows) of every candidate micro-batch that holds several models: the shapes `pack`
    will ask `may_mix` about (a pool's rank 0 decides them for every rank)."""
    return {(c.width, c.rows) for c in candidates(requests, budget) if len(c.pieces) > 1}


def pack(requests: Sequence[RequestShape], budget: int, *, may_mix: Callable[[int, int], bool],
         order_key: Callable[[str], tuple] = lambda model_id: ()) -> PackingPlan:
    """The micro-batches of one fused pass over `requests` (see the module docstring)."""
    plan = PackingPlan()
    for cand in candidates(requests, budget):
        if len(cand.pieces) > 1 and not may_mix(cand.width, cand.rows):
            groups = [[piece] for piece in cand.pieces]
        else:
            def key(piece):
                mid = requests[piece[0][0]].model_id
                return (order_key(mid), len(piece), mid)
            groups = [sorted(cand.pieces, key=key)]
        for group in groups:
            rows = tuple(row for piece in group for row in piece)
            plan.micro_batches.append(MicroBatch(
                grad=cand.grad, width=cand.width, rows=rows,
                lengths=tuple(requests[ri].lengths[di] for ri, di in rows),
                segments=tuple(segments_of([requests[ri].model_id for ri, _ in rows])),
                runs=tuple(segments_of([ri for ri, _ in rows])),
                kind=cand.kind))
    return plan
