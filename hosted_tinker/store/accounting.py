"""The accounting tables: hourly usage, the audit log and per-request timings (session traces).

What the server counts as it runs is kept in memory and written here in batches (`AccountingWriter`,
accounting_writer.py): one transaction per training cycle and per flush interval, never one per request.
Usage rows add up: a batch's quantities are added to the row of their (hour, model, owner, session,
kind), so a row is exact however many batches it took.
"""

from __future__ import annotations

import json
from dataclasses import dataclass

from .database import SQLiteDB

SCHEMA = """
CREATE TABLE IF NOT EXISTS usage_hourly (
    bucket_start INTEGER NOT NULL,   -- unix seconds of the UTC hour
    base_model TEXT NOT NULL,        -- '' when unknown
    owner TEXT NOT NULL,
    session_id TEXT NOT NULL,        -- '' for none
    kind TEXT NOT NULL,              -- training | sampling_prefill | sampling_sample | checkpoint | storage
    cached INTEGER NOT NULL DEFAULT 0,  -- sampling_prefill: served from a prefix cache
    quantity REAL NOT NULL,          -- tokens, checkpoints, or GB-hours
    PRIMARY KEY (bucket_start, base_model, owner, session_id, kind, cached)
);
CREATE TABLE IF NOT EXISTS audit_log (
    id INTEGER PRIMARY KEY AUTOINCREMENT,
    at REAL NOT NULL,
    event TEXT NOT NULL,             -- <resource>_<action>, e.g. checkpoint_read
    resource TEXT NOT NULL,          -- checkpoints | projects
    actor TEXT NOT NULL,             -- the owner who did it ('' for the server itself)
    details TEXT NOT NULL            -- JSON object
);
CREATE INDEX IF NOT EXISTS audit_log_at ON audit_log(at);
-- The audit report's filters: each index holds the rowid, so a filtered page is read in id order.
CREATE INDEX IF NOT EXISTS audit_log_actor ON audit_log(actor);
CREATE INDEX IF NOT EXISTS audit_log_event ON audit_log(event);
CREATE TABLE IF NOT EXISTS request_timings (
    id INTEGER PRIMARY KEY AUTOINCREMENT,
    session_id TEXT NOT NULL,
    base_model TEXT NOT NULL,
    request_id TEXT NOT NULL,
    kind TEXT NOT NULL,              -- forward_backward, optim_step, ..., sample
    target TEXT NOT NULL,            -- the training model or sampling session it was for
    arrived_at REAL NOT NULL,        -- unix seconds
    started_at REAL,                 -- its clock cycle's start (training) / its first token (sampling)
    ended_at REAL,                   -- its clock cycle's end / its last token
    answered_at REAL,                -- its result stored (None: a part of a request with more parts to come)
    cycle INTEGER,                   -- training: its model's clock cycle, counted from the server's start
    co_tenants INTEGER,              -- training: the other adapters in that cycle (counted, not named)
    tokens INTEGER NOT NULL,
    outcome TEXT NOT NULL            -- done | failed | part
);
CREATE INDEX IF NOT EXISTS request_timings_session ON request_timings(session_id, id);
CREATE INDEX IF NOT EXISTS request_timings_arrived ON request_timings(arrived_at);
"""


@dataclass(frozen=True)
class UsageKey:
    """What one quantity of usage is attributed to."""

    bucket_start: int  # the UTC hour, unix seconds
    base_model: str
    owner: str
    session_id: str  # '' for none
    kind: str
    cached: bool = False


@dataclass(frozen=True)
class AuditEntry:
    at: float
    event: str
    resource: str
    actor: str
    details: dict


@dataclass(frozen=True)
class RequestTiming:
    session_id: str
    base_model: str
    request_id: str
    kind: str
    target: str
    arrived_at: float
    started_at: float | None
    ended_at: float | None
    answered_at: float | None
    cycle: int | None
    co_tenants: int | None
    tokens: int
    outcome: str


@dataclass(frozen=True)
class UsageRow:
    key: UsageKey
    quantity: float


_TIMING_COLUMNS = ("session_id", "base_model", "request_id", "kind", "target", "arrived_at", "started_at",
                   "ended_at", "answered_at", "cycle", "co_tenants", "tokens", "outcome")


class AccountingTables:
    def __init__(self, db: SQLiteDB):
        self.db = db
        db.create(SCHEMA)

    def write(self, usage: dict[UsageKey, float], audit: list[AuditEntry], timings: list[RequestTiming]) -> None:
        """One batch, in one transaction: usage added to its rows, audit entries and timings appended."""
        if not (usage or audit or timings):
            return
        with self.db.transaction() as c:
            c.executemany(
                "INSERT INTO usage_hourly(bucket_start, base_model, owner, session_id, kind, cached, quantity)"
                " VALUES (?,?,?,?,?,?,?) ON CONFLICT(bucket_start, base_model, owner, session_id, kind, cached)"
                " DO UPDATE SET quantity = quantity + excluded.quantity",
                [(k.bucket_start, k.base_model, k.owner, k.session_id, k.kind, int(k.cached), q)
                 for k, q in usage.items()])
            c.executemany("INSERT INTO audit_log(at, event, resource, actor, details) VALUES (?,?,?,?,?)",
                          [(e.at, e.event, e.resource, e.actor, json.dumps(e.details)) for e in audit])
            c.executemany(f"INSERT INTO request_timings({', '.join(_TIMING_COLUMNS)}) VALUES"
                          f" ({','.join('?' * len(_TIMING_COLUMNS))})",
                          [tuple(getattr(t, c) for c in _TIMING_COLUMNS) for t in timings])

    def usage(self, start: int, end: int) -> list[UsageRow]:
        """Usage rows of the hours in [start, end)."""
        rows = self.db.all("SELECT * FROM usage_hourly WHERE bucket_start >= ? AND bucket_start < ?", (start, end))
        return [UsageRow(UsageKey(r["bucket_start"], r["base_model"], r["owner"], r["session_id"], r["kind"],
                                  bool(r["cached"])), r["quantity"]) for r in rows]

    def audit(self, start: float, end: float, *, after: int = 0, resource: str | None = None,
              event: str | None = None, actor: str | None = None, limit: int) -> list[tuple[int, AuditEntry]]:
        """Audit entries timed in [start, end) with an id above `after`, of one resource, event and actor (None:
        any), each with its id, in id order: the order they were written. Ids only grow, so an entry written
        after a page was read, whatever its time, has a larger id than any that page gave: paging on from the
        page's last id (`after`) reaches it, and reaches nothing twice. At most `limit`."""
        if not after:  # the first page starts at the window's first entry, not at the table's
            (first,) = self.db.one("SELECT MIN(id) FROM audit_log WHERE at >= ? AND at < ?", (start, end))
            if first is None:
                return []
            after = first - 1
        # Read in rowid order, or through a filter's index, which holds the rowid: a page costs its own rows. The
        # unary + keeps SQLite off the time index, which would sort the whole window for every page.
        where, args = ["id > ?", "+at >= ?", "+at < ?"], [after, start, end]
        for column, value in (("resource", resource), ("event", event), ("actor", actor)):
            if value is not None:
                where.append(f"{column} = ?")
                args.append(value)
        rows = self.db.all(f"SELECT * FROM audit_log WHERE {' AND '.join(where)} ORDER BY id LIMIT ?", (*args, limit))
        return [(r["id"], AuditEntry(r["at"], r["event"], r["resource"], r["actor"], json.loads(r["details"])))
                for r in rows]

    def timings(self, session_id: str, limit: int) -> list[RequestTiming]:
        """A session's latest `limit` request timings, oldest first."""
        rows = self.db.all(f"SELECT {', '.join(_TIMING_COLUMNS)} FROM request_timings WHERE session_id = ?"
                           " ORDER BY id DESC LIMIT ?", (session_id, limit))
        return [RequestTiming(**dict(r)) for r in reversed(rows)]

    def timings_version(self, session_id: str) -> tuple[int, int]:
        """(rows, last row id) of a session's timings: a trace built from them is up to date while it holds."""
        row = self.db.one("SELECT COUNT(*), COALESCE(MAX(id), 0) FROM request_timings WHERE session_id = ?",
                          (session_id,))
        return row[0], row[1]

    def sampling_overlaps(self, base_model: str, start: float, end: float) -> list[tuple[float, float]]:
        """(started_at, ended_at) of every sample request on `base_model` that ran within [start, end]."""
        rows = self.db.all("SELECT started_at, ended_at FROM request_timings WHERE base_model = ? AND kind = 'sample'"
                           " AND started_at IS NOT NULL AND started_at <= ? AND ended_at >= ?",
                           (base_model, end, start))
        return [(r[0], r[1]) for r in rows]
