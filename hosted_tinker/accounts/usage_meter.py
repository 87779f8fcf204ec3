"""`UsageMeter`: the usage the server counts, per UTC hour, base model, owner, session and kind, added up in
memory until the accounting's next flush.

What is charged for what (the accounting's observer, `accounting.py`, tells it what ran):

- a training request's tokens once it ran in a cycle and did not fail (each part of a split request when
  it ran); one checkpoint for each save that is done;
- a sample's prompt (prefill) and sampled tokens, once, when it ends; one cut short is charged what was
  computed of it until it stopped, and prompt tokens vLLM took from its cache for the job's scoring
  requests are charged as cached;
- storage GB-hours, accrued from the live checkpoints, hour by hour (`accrue_storage`).
"""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass

from ..training.cycle_plan import COMPUTE
from ..requests.kinds import RequestKind
from ..store.tables import Store
from ..store.accounting import UsageKey

TRAINING, PREFILL, SAMPLE, CHECKPOINT, STORAGE = (
    "training", "sampling_prefill", "sampling_sample", "checkpoint", "storage")
SAVES = frozenset({RequestKind.SAVE_WEIGHTS, RequestKind.SAVE_WEIGHTS_FOR_SAMPLER, RequestKind.SAVE_WEIGHTS_EXTERNAL})
HOUR = 3600


def hour_of(t: float) -> int:
    """The UTC hour `t` falls in, as unix seconds of its start."""
    return int(t // HOUR) * HOUR


@dataclass(frozen=True)
class Payer:
    """Whom usage is charged to."""

    owner: str
    session_id: str  # '' for none


class UsageMeter:
    def __init__(self, store: Store):
        self.store = store
        self._lock = threading.Lock()
        self._usage: dict[UsageKey, float] = {}
        self._storage_since = time.time()

    def count_training(self, at: float, base_model: str, payer: Payer, kind: RequestKind, tokens: int,
                       outcome: str) -> None:
        """A training request (or a part of one) that ran in a cycle ending at `at`; `outcome` is done, failed
        or part (more parts to come)."""
        key = UsageKey(hour_of(at), base_model, payer.owner, payer.session_id, TRAINING)
        if kind in COMPUTE and outcome != "failed":
            self._add([(key, tokens)])
        elif kind in SAVES and outcome == "done":
            self._add([(UsageKey(key.bucket_start, base_model, payer.owner, payer.session_id, CHECKPOINT), 1)])

    def count_sample(self, at: float, base_model: str, payer: Payer, prefill: int, cached: int, sampled: int) -> None:
        """A sample that ended at `at`: `prefill` prompt tokens computed, `cached` taken from a prefix cache,
        `sampled` tokens generated."""
        hour = hour_of(at)
        # A job's own prompt is charged as computed (cached=False) on every backend, whatever vLLM's prefix cache
        # held from other requests: a request costs the same wherever it runs. Its prompt-scoring requests reuse
        # the prompt the job itself just prefilled: what vLLM says it took from its cache is charged as cached.
        usage = [(UsageKey(hour, base_model, payer.owner, payer.session_id, PREFILL, False), prefill),
                 (UsageKey(hour, base_model, payer.owner, payer.session_id, SAMPLE), sampled)] if prefill or sampled else []
        if cached:
            usage.append((UsageKey(hour, base_model, payer.owner, payer.session_id, PREFILL, True), cached))
        self._add(usage)

    def accrue_storage(self) -> None:
        """Add the GB-hours the live checkpoints have held since the last accrual, hour by hour."""
        now = time.time()
        with self._lock:
            since, self._storage_since = self._storage_since, now
        if now <= since:
            return
        usage = []
        for held in self.store.checkpoints.live_storage():
            t = since
            while t < now:
                end = min(now, hour_of(t) + HOUR)
                usage.append((UsageKey(hour_of(t), held.base_model, held.owner, held.session_id, STORAGE),
                              held.size_bytes / 1e9 * (end - t) / HOUR))
                t = end
        self._add(usage)

    def take(self) -> dict[UsageKey, float]:
        """What was counted since the last take."""
        with self._lock:
            usage, self._usage = self._usage, {}
        return usage

    def put_back(self, usage: dict[UsageKey, float]) -> None:
        """Usage taken but not written (the write failed): added to what came meanwhile, for the next flush."""
        self._add(list(usage.items()))

    def _add(self, usage: list[tuple[UsageKey, float]]) -> None:
        with self._lock:
            for key, quantity in usage:
                self._usage[key] = self._usage.get(key, 0) + quantity
