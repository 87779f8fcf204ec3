"""The sessions table: a client's session, its heartbeat, labels and end; created once per idempotency key.

A session's text-valued metadata is also written to `session_metadata` (store_search.py), in the
same transaction, for the search's lookups.
"""

from __future__ import annotations

import json
import sqlite3
import time

from .records import SessionRecord, Table
from .search import metadata_rows


class SessionTable(Table):
    SCHEMA = """
CREATE TABLE IF NOT EXISTS sessions (
    session_id TEXT PRIMARY KEY,
    owner TEXT NOT NULL,
    created_at REAL NOT NULL,
    last_heartbeat REAL NOT NULL,
    tags TEXT NOT NULL DEFAULT '[]',
    user_metadata TEXT NOT NULL DEFAULT '{}',
    display_name TEXT,
    project_id TEXT,
    status TEXT NOT NULL DEFAULT 'active'
);
-- The SDK retries create_session with the same X-Idempotency-Key: one session per (owner, key).
CREATE TABLE IF NOT EXISTS session_idempotency_keys (
    owner TEXT NOT NULL,
    key TEXT NOT NULL,
    session_id TEXT NOT NULL,
    PRIMARY KEY (owner, key)
);
CREATE INDEX IF NOT EXISTS sessions_owner ON sessions(owner, created_at);
"""

    def create(self, session_id: str, owner: str, tags: list[str], user_metadata: dict,
               display_name: str | None, project_id: str | None, idempotency_key: str | None = None) -> str:
        """Create a session; return its id. A key already used by this owner returns the session
        created under it instead: the check and the insert are one transaction, so concurrent
        retries of one create all get the same session."""
        now = time.time()

        def create(c: sqlite3.Connection) -> str:
            row = None if idempotency_key is None else c.execute(
                "SELECT session_id FROM session_idempotency_keys WHERE owner=? AND key=?",
                (owner, idempotency_key)).fetchone()
            if row is not None:
                return row[0]
            c.execute("INSERT INTO sessions(session_id, owner, created_at, last_heartbeat, tags, user_metadata,"
                      " display_name, project_id) VALUES (?,?,?,?,?,?,?,?)",
                      (session_id, owner, now, now, json.dumps(tags), json.dumps(user_metadata), display_name,
                       project_id))
            c.executemany("INSERT INTO session_metadata(session_id, key, value) VALUES (?,?,?)",
                          metadata_rows(session_id, user_metadata))
            if idempotency_key is not None:
                c.execute("INSERT INTO session_idempotency_keys(owner, key, session_id) VALUES (?,?,?)",
                          (owner, idempotency_key, session_id))
            return session_id

        return self.db.write(create)

    def get(self, session_id: str) -> SessionRecord | None:
        return self._record(SessionRecord, "SELECT * FROM sessions WHERE session_id=?", (session_id,))

    def touch(self, session_id: str) -> None:
        self.db.execute("UPDATE sessions SET last_heartbeat=? WHERE session_id=?", (time.time(), session_id))

    def finish(self, session_id: str, status: str) -> None:
        self.db.execute("UPDATE sessions SET status=? WHERE session_id=?", (status, session_id))

    def set_project(self, session_id: str, project_id: str | None) -> None:
        self.db.execute("UPDATE sessions SET project_id=? WHERE session_id=?", (project_id, session_id))

    def page(self, owner: str, limit: int, offset: int) -> tuple[list[str], int]:
        """A page of `owner`'s session ids, newest first, and how many there are."""
        total = self.db.one("SELECT COUNT(*) FROM sessions WHERE owner=?", (owner,), budgeted=True)[0]
        rows = self.db.all("SELECT session_id FROM sessions WHERE owner=? ORDER BY created_at DESC, session_id"
                           " LIMIT ? OFFSET ?", (owner, limit, offset), budgeted=True)
        return [r[0] for r in rows], total
