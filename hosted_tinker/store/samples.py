"""Recorded samples (sampling/records.py): one row per recorded sample request (its prompt is shared
by its num_samples sequences), one per sequence. A request row goes with its last sequence."""

from __future__ import annotations

import sqlite3

from .records import StoredSample, Table


class SampleTable(Table):
    SCHEMA = """
CREATE TABLE IF NOT EXISTS sample_requests (
    request_id TEXT PRIMARY KEY,
    owner TEXT NOT NULL,
    session_id TEXT NOT NULL,
    sampling_session_id TEXT NOT NULL,
    seq_id INTEGER NOT NULL,
    weights TEXT NOT NULL,           -- tinker:// sampler path, or "base:<model>"
    weights_version REAL,            -- that checkpoint's created_at
    prompt BLOB NOT NULL,            -- int32 tokens
    temperature REAL NOT NULL,
    top_k INTEGER NOT NULL,
    top_p REAL NOT NULL,
    created_at REAL NOT NULL
);
CREATE INDEX IF NOT EXISTS sample_requests_seq ON sample_requests(sampling_session_id, seq_id);
CREATE TABLE IF NOT EXISTS sample_records (
    sequence_id TEXT PRIMARY KEY,
    request_id TEXT NOT NULL,
    sample_index INTEGER NOT NULL,
    tokens BLOB NOT NULL,            -- int32, as returned
    logprobs BLOB NOT NULL,          -- float32, as returned
    last_used_at REAL NOT NULL
);
CREATE INDEX IF NOT EXISTS sample_records_request ON sample_records(request_id);
CREATE INDEX IF NOT EXISTS sample_records_last_used ON sample_records(last_used_at);
"""

    def insert(self, request: dict, sequences: list[tuple[str, int, bytes, bytes]], now: float) -> None:
        """One recorded request and its (sequence_id, index, tokens, logprobs), in one transaction."""
        def insert(c: sqlite3.Connection) -> None:
            c.execute("INSERT INTO sample_requests(request_id, owner, session_id, sampling_session_id, seq_id, weights,"
                      " weights_version, prompt, temperature, top_k, top_p, created_at) VALUES (:request_id, :owner,"
                      " :session_id, :sampling_session_id, :seq_id, :weights, :weights_version, :prompt, :temperature,"
                      " :top_k, :top_p, :created_at)", request)
            c.executemany("INSERT INTO sample_records(sequence_id, request_id, sample_index, tokens, logprobs,"
                          " last_used_at) VALUES (?,?,?,?,?,?)",
                          [(sid, request["request_id"], i, t, lp, now) for sid, i, t, lp in sequences])

        self.db.write(insert)

    def request_exists(self, sampling_session_id: str, seq_id: int) -> bool:
        return self.db.one("SELECT 1 FROM sample_requests WHERE sampling_session_id=? AND seq_id=?",
                           (sampling_session_id, seq_id)) is not None

    def get(self, sequence_ids: list[str]) -> list[StoredSample]:
        """The records of those of `sequence_ids` that have one, each joined with its request."""
        rows: list[StoredSample] = []
        for i in range(0, len(sequence_ids), 500):  # SQLite caps the number of bound parameters
            part = sequence_ids[i:i + 500]
            rows += self._records(
                StoredSample,
                "SELECT r.sequence_id, r.tokens, r.logprobs, r.last_used_at, q.owner, q.session_id, q.prompt,"
                " q.weights, q.weights_version, q.temperature, q.top_k, q.top_p FROM sample_records r"
                f" JOIN sample_requests q ON q.request_id = r.request_id WHERE r.sequence_id IN ({','.join('?' * len(part))})",
                tuple(part))
        return rows

    def touch(self, sequence_ids: list[str], now: float) -> None:
        self.db.executemany("UPDATE sample_records SET last_used_at=? WHERE sequence_id=?",
                            [(now, sid) for sid in sequence_ids])

    def delete_unused_since(self, before: float) -> int:
        """Delete sequences last used at or before `before`, and requests left without any."""
        def delete(c: sqlite3.Connection) -> int:
            n = c.execute("DELETE FROM sample_records WHERE last_used_at <= ?", (before,)).rowcount
            c.execute("DELETE FROM sample_requests WHERE NOT EXISTS"
                      " (SELECT 1 FROM sample_records r WHERE r.request_id = sample_requests.request_id)")
            return n

        return self.db.write(delete)
