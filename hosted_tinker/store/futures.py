"""The futures table: a request id's status and result, as the SDK long-polls it (futures.py).

Futures are keyed by request id and, for training requests, unique per (model_id, seq_id): a
resubmitted chunk finds its original request id here, which is what makes retries idempotent.
"""

from __future__ import annotations

import sqlite3
import time
from collections.abc import Callable

from ..errors import Failure
from .records import FutureRecord, Table


class FutureTable(Table):
    SCHEMA = """
CREATE TABLE IF NOT EXISTS futures (
    request_id TEXT PRIMARY KEY,
    owner TEXT NOT NULL,
    kind TEXT NOT NULL,
    model_id TEXT,
    seq_id INTEGER,
    status TEXT NOT NULL,            -- pending | done | failed
    result BLOB,                     -- JSON text or protobuf bytes
    result_is_proto INTEGER NOT NULL DEFAULT 0,
    created_at REAL NOT NULL,
    completed_at REAL
);
CREATE UNIQUE INDEX IF NOT EXISTS futures_model_seq ON futures(model_id, seq_id) WHERE seq_id IS NOT NULL;
"""

    def fail_interrupted(self, message: str) -> int:
        """At start-up: futures that were pending when the server died fail cleanly (category server)."""
        body = Failure(message, "server").to_wire()
        cur = self.db.execute(
            "UPDATE futures SET status='failed', result=?, result_is_proto=0, completed_at=? "
            "WHERE status='pending'", (body, time.time()))
        return cur.rowcount

    def insert(self, request_id: str, owner: str, kind: str, model_id: str | None, seq_id: int | None,
               with_write: Callable[[sqlite3.Connection], None] | None = None) -> str:
        """Insert a pending future; for a (model_id, seq_id) seen before, return its request id.
        `with_write` (a new future only) is written in the same transaction: both stand or neither."""
        def insert(c: sqlite3.Connection) -> str:
            if seq_id is not None:
                row = c.execute("SELECT request_id FROM futures WHERE model_id=? AND seq_id=?",
                                (model_id, seq_id)).fetchone()
                if row is not None:
                    return row[0]
            if with_write is not None:
                with_write(c)
            c.execute("INSERT INTO futures(request_id, owner, kind, model_id, seq_id, status, created_at)"
                      " VALUES (?,?,?,?,?, 'pending', ?)", (request_id, owner, kind, model_id, seq_id, time.time()))
            return request_id

        return self.db.write(insert)

    def request_id_of(self, model_id: str, seq_id: int) -> str | None:
        """The request id of a (model_id, seq_id) already submitted, if any."""
        row = self.db.one("SELECT request_id FROM futures WHERE model_id=? AND seq_id=?", (model_id, seq_id))
        return None if row is None else row[0]

    def complete(self, request_id: str, result: bytes, is_proto: bool, failed: bool) -> None:
        self.db.execute(
            "UPDATE futures SET status=?, result=?, result_is_proto=?, completed_at=? WHERE request_id=?",
            ("failed" if failed else "done", result, int(is_proto), time.time(), request_id))

    def complete_batch(self, results: list[tuple[str, bytes, bool, bool]], touched_models: list[str]) -> None:
        """A cycle's answers, (request_id, result, is_proto, failed) each, and the last_request_at of
        the training runs it ran, in one transaction: one commit per cycle, not one per request."""
        if not results and not touched_models:
            return
        now = time.time()
        with self.db.transaction() as connection:
            connection.executemany(
                "UPDATE futures SET status=?, result=?, result_is_proto=?, completed_at=? WHERE request_id=?",
                [("failed" if failed else "done", result, int(is_proto), now, request_id)
                 for request_id, result, is_proto, failed in results])
            connection.executemany("UPDATE models SET last_request_at=? WHERE model_id=?",
                                   [(now, model_id) for model_id in touched_models])

    def get(self, request_id: str) -> FutureRecord | None:
        return self._record(FutureRecord, "SELECT * FROM futures WHERE request_id=?", (request_id,))
