"""`AccountingWriter`: what the usage meter, the audit log and the request timings hold in memory, written in
batches, one transaction each (`AccountingTables.write`), never one per request.

A batch is written after each training cycle (by the cycle's observer, `accounting.py`), every `FLUSH_S` by
a thread of its own (for sampling and the API's audit entries), and once more at stop, after the device
loops have finished their last cycle: a graceful stop loses nothing. A kill -9 loses what was counted since
the last flush: the last cycle's training usage if it came after that cycle's answers, and at most `FLUSH_S`
of sampling usage and audit entries. A batch that fails to be written (a full disk) stays in memory for the
next one.
"""

from __future__ import annotations

import logging
import threading
import time

from .audit_log import AuditLog
from ..periodic import Periodic
from .request_timings import RequestTimings
from ..store.accounting import AccountingTables
from .usage_meter import UsageMeter

log = logging.getLogger(__name__)

FLUSH_S = 1.0  # sampling usage and audit entries wait at most this long in memory
STORAGE_TICK_S = 60.0  # storage GB-hours are accrued this often (and before each report)


class AccountingWriter:
    def __init__(self, tables: AccountingTables, usage: UsageMeter, audit: AuditLog, timings: RequestTimings):
        self.tables = tables
        self.usage = usage
        self.audit = audit
        self.timings = timings
        # Held while a batch is taken, and while records that belong in one batch are added (`one_batch`).
        self._taking = threading.Lock()
        self._flush_lock = threading.Lock()  # one flush at a time: batches are written in order
        self._last_storage = time.monotonic()
        self._flushes = Periodic("accounting-flush", FLUSH_S, self._flush_on_time,
                                 "writing the accounting records failed; they stay in memory for the next try", log)

    @property
    def one_batch(self) -> threading.Lock:
        """Hold it while adding records that are written together or not at all (one cycle's usage, audit
        entries and timings): no batch is taken meanwhile."""
        return self._taking

    def flush(self) -> None:
        """Write what is counted in memory, in one transaction (added to the rows already there)."""
        with self._flush_lock:
            with self._taking:
                usage, audit, timings = self.usage.take(), self.audit.take(), self.timings.take()
            try:
                self.tables.write(usage, audit, timings)
            except Exception:  # kept for the next flush, added to what came meanwhile
                self.usage.put_back(usage)
                self.audit.put_back(audit)
                self.timings.put_back(timings)
                raise

    def start(self) -> None:
        self._last_storage = time.monotonic()
        self._flushes.start()

    def stop(self) -> None:
        """Write everything still in memory. Call after the device loops have stopped."""
        self._flushes.stop()
        self.usage.accrue_storage()
        self.flush()

    def _flush_on_time(self) -> None:
        if time.monotonic() - self._last_storage >= STORAGE_TICK_S:
            self._last_storage = time.monotonic()
            self.usage.accrue_storage()
        self.flush()
