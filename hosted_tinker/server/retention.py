"""The retention sweep: the data dir stays within the bounds the operator set, by age and by size.

Every `--retention-sweep-s` (api/app.py runs it off the event loop):

- results the SDK fetched are dropped from SQLite (`FutureStore.delivered`) after
  `DELIVERED_GRACE_S`; their rows stay, small;
- request history (answered futures, request timings, loss points) older than
  `--request-history-retention-s` goes, and the audit log's entries older than
  `--audit-retention-s`;
- save_weights_and_get_sampling_client's snapshots beyond `--sampler-snapshot-retention-bytes` go,
  oldest first, as a TTL would remove them (the newest of each training run stays whatever its
  size; `--ephemeral-sampler-ttl-s` is their age bound);
- the data dir is measured by kind (data_dir_usage.py), and request history beyond
  `--request-history-retention-bytes` goes, oldest first, down to 90% of the bound.

Nothing a restart or the SDK still needs is removed: a pending future, a result not yet fetched
(its row goes only by age), a checkpoint saved by name (those have their own TTL).
"""

from __future__ import annotations

import logging
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from ..store.data_dir_usage import HISTORY_GROUPS, database_bytes, files_bytes
from ..requests.futures import FutureStore
from ..store.database import SQLiteDB
from ..store.records import CheckpointRecord
from ..store.retention import HISTORY, drop_results, prune_audit, prune_older, prune_share, snapshots

log = logging.getLogger(__name__)

REMEASURE_EVERY = 10  # sweeps between two readings of every database page, unless its file grew
# A fetched result stays in SQLite this long (and in memory for FutureStore.keep_in_memory_s): an SDK
# whose fetch's answer was lost on the way asks again within seconds, across a restart too.
DELIVERED_GRACE_S = 30.0
TRIM_TO = 0.9  # a size bound over is trimmed to this share of itself, not to the byte
TRIM_ROUNDS = 4


@dataclass(frozen=True)
class RetentionSettings:
    history_s: float
    history_bytes: int
    snapshot_bytes: int
    audit_s: float

    @classmethod
    def of(cls, config) -> "RetentionSettings":
        return cls(config.request_history_retention_s, config.request_history_retention_bytes,
                   config.sampler_snapshot_retention_bytes, config.audit_retention_s)


class Retention:
    def __init__(self, db: SQLiteDB, futures: FutureStore, data_dir: Path, settings: RetentionSettings,
                 remove_snapshot: Callable[[CheckpointRecord], bool], clock: Callable[[], float] = time.time):
        self.db = db
        self.futures = futures
        self.data_dir = data_dir
        self.settings = settings
        self.remove_snapshot = remove_snapshot  # deletes it as the TTL sweep would, and audits it; False if gone
        self.clock = clock
        self.usage: dict[str, int] = {}  # kind -> bytes, as last measured
        self.sweeps = 0
        self.removed: Counter[str] = Counter()  # what -> rows, results or snapshots removed
        self._db_measured_at_size = -1
        self._since_db_measured = 0

    def sweep(self) -> None:
        """One pass of everything above (the caller's thread; each statement takes the database's lock briefly)."""
        now = self.clock()
        self.futures.prune()
        self.removed["results"] += drop_results(self.db, self.futures.take_delivered(now - DELIVERED_GRACE_S))
        for table in HISTORY:
            self.removed[table] += prune_older(self.db, table, now - self.settings.history_s)
        self.removed["audit_log"] += prune_audit(self.db, now - self.settings.audit_s)
        self._bound_snapshots()
        self.measure()
        self._bound_history()
        self.sweeps += 1

    def measure(self, force: bool = False) -> dict[str, int]:
        """The data dir's bytes by kind; the database's pages read again only when due (module docstring)."""
        usage = {k: v for k, v in self.usage.items() if k.startswith("database/")}
        size = self.db.path.stat().st_size if self.db.path.exists() else 0
        if force or size != self._db_measured_at_size or self._since_db_measured >= REMEASURE_EVERY:
            usage = database_bytes(self.db.path)
            self._db_measured_at_size, self._since_db_measured = size, 0
        else:
            self._since_db_measured += 1
        self.usage = {**usage, **files_bytes(self.data_dir, self.db.path)}
        return self.usage

    def _bound_history(self) -> None:
        """Over the bound, the oldest share of each table's rows goes, measured again, until it holds: a
        share of the rows frees about that share of the pages, not exactly."""
        bound = self.settings.history_bytes
        for _ in range(TRIM_ROUNDS):
            history = sum(self.usage.get(f"database/{g}", 0) for g in HISTORY_GROUPS)
            if history <= bound:
                return
            removed = {table: prune_share(self.db, table, 1 - TRIM_TO * bound / history) for table in HISTORY}
            log.info("request history held %d bytes, over its bound of %d (--request-history-retention-bytes): "
                     "removed the oldest %s", history, bound, ", ".join(f"{n} of {t}" for t, n in removed.items()))
            self.removed.update(removed)
            self.measure(force=True)
            if not any(removed.values()):
                return  # what is left may not go for size (results not yet fetched)

    def _bound_snapshots(self) -> None:
        """Each run's newest snapshot stays, whatever its size; the others count after them, newest first."""
        newest: dict[str, CheckpointRecord] = {}
        older: list[CheckpointRecord] = []
        for row in snapshots(self.db):  # newest first
            if row.model_id in newest:
                older.append(row)
            else:
                newest[row.model_id] = row
        held = sum(row.size_bytes for row in newest.values())
        for row in older:
            held += row.size_bytes
            if held > self.settings.snapshot_bytes and self.remove_snapshot(row):
                held -= row.size_bytes
                self.removed["snapshots"] += 1
