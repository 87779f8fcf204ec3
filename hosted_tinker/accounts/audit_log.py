"""`AuditLog`: who did what to which checkpoint or project, kept in memory until the accounting's next flush.

Its entries come from the services (reads, publish, TTL, copies, deletes, project moves) and from the
accounting's cycle observer (`checkpoint_create` for each save that ran). `AccountingWriter` takes them
with the usage and timings and writes them in one transaction (`store_accounting.py` holds the table).
"""

from __future__ import annotations

import threading
import time

from ..store.accounting import AuditEntry

# The audit log's events (`<resource>_<action>`), and the resource each belongs to (`get_audit_log(event_type)`).
AUDIT_EVENTS = {
    "checkpoint_create": "checkpoints", "checkpoint_read": "checkpoints", "checkpoint_publish": "checkpoints",
    "checkpoint_unpublish": "checkpoints", "checkpoint_ttl_set": "checkpoints", "checkpoint_copy": "checkpoints",
    "checkpoint_delete": "checkpoints", "project_session_assign": "projects",
}


class AuditLog:
    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._entries: list[AuditEntry] = []

    def record(self, event: str, actor: str, at: float | None = None, **details) -> None:
        """One entry: `actor` (an owner; '' for the server itself) did `event` (one of AUDIT_EVENTS) at `at`
        (unix seconds; default now); `details` say to what."""
        entry = AuditEntry(time.time() if at is None else at, event, AUDIT_EVENTS[event], actor, details)
        with self._lock:
            self._entries.append(entry)

    def take(self) -> list[AuditEntry]:
        """The entries recorded since the last take, in time order: written so, their ids (the audit log's
        order) follow their times, whichever thread recorded them first."""
        with self._lock:
            entries, self._entries = self._entries, []
        return sorted(entries, key=lambda e: e.at)

    def put_back(self, entries: list[AuditEntry]) -> None:
        """Entries taken but not written (the write failed): kept for the next flush, before newer ones."""
        with self._lock:
            self._entries[:0] = entries
