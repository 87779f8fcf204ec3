"""A pass's datums over the ranks of a worker pool: which rank runs which datums of a request, and
one request's outcome put back together from its ranks' parts (runtime/distributed.py)."""

from __future__ import annotations

import zlib

from ..requests.kinds import FBOutcome, FBWork
from .losses import merge_metrics


def split_datums(work: FBWork, world: int) -> list[list[int]]:
    """Each rank's datums of one request: contiguous runs of about equal token counts, dealt to
    ranks from an offset given by the model's id (so many small requests of many models spread
    over the ranks). Depends on the request alone."""
    lengths = [len(d.tokens) for d in work.data]
    total = max(1, sum(lengths))
    offset = zlib.crc32(work.model_id.encode()) % world
    shares: list[list[int]] = [[] for _ in range(world)]
    before = 0
    for i, n in enumerate(lengths):
        run = min(world - 1, world * (2 * before + n) // (2 * total))  # the run holding the datum's middle
        shares[(run + offset) % world].append(i)
        before += n
    return shares


def merged_outcome(work: FBWork, parts: list[FBOutcome], split: list[list[int]]) -> FBOutcome:
    """One request's outcome from its ranks' parts: outputs back in datum order, metrics merged."""
    outputs: list = [None] * len(work.data)
    metrics: dict[str, float] = {"loss:sum": 0.0}
    for part, datums in zip(parts, split):
        for j, di in enumerate(datums):
            outputs[di] = part.outputs[j]
        merge_metrics(metrics, part.metrics)
    return FBOutcome(outputs=outputs, metrics=metrics)
