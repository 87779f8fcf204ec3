"""The sampling sessions table: what a sampler samples from (a base model, or a run's checkpoint) and
whose it is; a row is written once, when the sampler is created, and never changes."""

from __future__ import annotations

import time

from .records import SamplingSessionRecord, Table


class SamplingSessionTable(Table):
    SCHEMA = """
CREATE TABLE IF NOT EXISTS sampling_sessions (
    sampling_session_id TEXT PRIMARY KEY,
    session_id TEXT NOT NULL,
    owner TEXT NOT NULL,
    base_model TEXT NOT NULL,
    model_path TEXT,                 -- tinker:// path it samples from; NULL = the base model
    checkpoint_dir TEXT,             -- the adapter snapshot on disk; NULL = the base model
    created_at REAL NOT NULL
);
"""

    def create(self, sampling_session_id: str, session_id: str, owner: str, base_model: str,
               model_path: str | None, checkpoint_dir: str | None) -> None:
        """Idempotent: a retried creation with the same id keeps the first record."""
        self.db.execute(
            "INSERT OR IGNORE INTO sampling_sessions(sampling_session_id, session_id, owner, base_model,"
            " model_path, checkpoint_dir, created_at) VALUES (?,?,?,?,?,?,?)",
            (sampling_session_id, session_id, owner, base_model, model_path, checkpoint_dir, time.time()))

    def get(self, sampling_session_id: str) -> SamplingSessionRecord | None:
        return self._record(SamplingSessionRecord, "SELECT * FROM sampling_sessions WHERE sampling_session_id=?",
                            (sampling_session_id,))

    def ids_in_session(self, session_id: str) -> list[str]:
        return [r[0] for r in self.db.all("SELECT sampling_session_id FROM sampling_sessions WHERE session_id=?"
                                          " ORDER BY created_at", (session_id,))]
