"""The checkpoints table: a run's saved weights (training, sampler, external), its folder, size, expiry
and whether it is published. Listings never show an expired checkpoint, even before the sweeper
(checkpoints/catalog.py) has removed it.
"""

from __future__ import annotations

import json
import time

from .records import CheckpointRecord, StoredBytes, Table

# A checkpoint `c` that has not expired; its one argument is now.
LIVE = "(c.expires_at IS NULL OR c.expires_at > ?)"


class CheckpointTable(Table):
    SCHEMA = """
CREATE TABLE IF NOT EXISTS checkpoints (
    model_id TEXT NOT NULL,
    checkpoint_id TEXT NOT NULL,     -- "<kind>/<name>", e.g. "weights/step-10"
    kind TEXT NOT NULL,              -- training | sampler | external
    owner TEXT NOT NULL,
    dir TEXT NOT NULL,
    size_bytes INTEGER NOT NULL,
    created_at REAL NOT NULL,
    expires_at REAL,
    public INTEGER NOT NULL DEFAULT 0,
    user_metadata TEXT NOT NULL DEFAULT '{}',
    PRIMARY KEY (model_id, checkpoint_id)
);
CREATE INDEX IF NOT EXISTS checkpoints_expiry ON checkpoints(expires_at) WHERE expires_at IS NOT NULL;
CREATE INDEX IF NOT EXISTS checkpoints_owner ON checkpoints(owner, created_at);
"""

    def upsert(self, model_id: str, checkpoint_id: str, kind: str, owner: str, dir: str,
               size_bytes: int, expires_at: float | None, user_metadata: dict) -> None:
        self.db.execute(
            "INSERT OR REPLACE INTO checkpoints(model_id, checkpoint_id, kind, owner, dir, size_bytes,"
            " created_at, expires_at, user_metadata) VALUES (?,?,?,?,?,?,?,?,?)",
            (model_id, checkpoint_id, kind, owner, dir, size_bytes, time.time(), expires_at,
             json.dumps(user_metadata)))

    def get(self, model_id: str, checkpoint_id: str) -> CheckpointRecord | None:
        return self._record(CheckpointRecord, "SELECT * FROM checkpoints WHERE model_id=? AND checkpoint_id=?",
                            (model_id, checkpoint_id))

    def set_public(self, model_id: str, checkpoint_id: str, public: bool) -> None:
        self.db.execute("UPDATE checkpoints SET public=? WHERE model_id=? AND checkpoint_id=?",
                        (int(public), model_id, checkpoint_id))

    def set_expiry(self, model_id: str, checkpoint_id: str, expires_at: float | None) -> None:
        self.db.execute("UPDATE checkpoints SET expires_at=? WHERE model_id=? AND checkpoint_id=?",
                        (expires_at, model_id, checkpoint_id))

    def set_files(self, model_id: str, checkpoint_id: str, size_bytes: int, created_at: float) -> None:
        self.db.execute("UPDATE checkpoints SET size_bytes=?, created_at=? WHERE model_id=? AND checkpoint_id=?",
                        (size_bytes, created_at, model_id, checkpoint_id))

    def delete_if(self, model_id: str, checkpoint_id: str, *, expired_before: float | None = None) -> bool:
        """Delete the record (only if it expired before `expired_before`, when given); True if one went."""
        sql = "DELETE FROM checkpoints WHERE model_id=? AND checkpoint_id=?"
        args: tuple = (model_id, checkpoint_id)
        if expired_before is not None:
            sql += " AND expires_at IS NOT NULL AND expires_at <= ?"
            args += (expired_before,)
        return self.db.execute(sql, args).rowcount > 0

    # -- what is live ---------------------------------------------------------------------------
    def run_has_public(self, model_id: str) -> bool:
        """Whether the run holds a live published checkpoint (which makes it visible to other keys)."""
        return self.db.one(f"SELECT 1 FROM checkpoints c WHERE c.model_id = ? AND c.public = 1 AND {LIVE}",
                           (model_id, time.time())) is not None

    def live(self, model_id: str, *, public_only: bool = False) -> list[CheckpointRecord]:
        """A run's unexpired checkpoints, oldest first."""
        return self._records(CheckpointRecord, f"SELECT * FROM checkpoints c WHERE c.model_id = ? AND {LIVE}"
                             f"{' AND c.public = 1' if public_only else ''} ORDER BY c.created_at, c.checkpoint_id",
                             (model_id, time.time()))

    def live_page(self, owner: str, limit: int, offset: int) -> tuple[list[CheckpointRecord], int]:
        """A page of `owner`'s unexpired checkpoints, newest first, and how many there are."""
        now = time.time()
        total = self.db.one(f"SELECT COUNT(*) FROM checkpoints c WHERE c.owner = ? AND {LIVE}", (owner, now),
                            budgeted=True)[0]
        rows = self._records(CheckpointRecord, f"SELECT * FROM checkpoints c WHERE c.owner = ? AND {LIVE}"
                             " ORDER BY c.created_at DESC, c.model_id, c.checkpoint_id LIMIT ? OFFSET ?",
                             (owner, now, limit, offset), budgeted=True)
        return rows, total

    def live_storage(self) -> list[StoredBytes]:
        """Unexpired checkpoints' count and bytes per (owner, base model, session) of their runs."""
        return self._records(
            StoredBytes, f"SELECT c.owner, COALESCE(m.base_model, '') AS base_model, COALESCE(m.session_id, '') AS"
            " session_id, COUNT(*) AS checkpoints, SUM(c.size_bytes) AS size_bytes FROM checkpoints c LEFT JOIN models"
            f" m ON m.model_id = c.model_id WHERE {LIVE} GROUP BY 1, 2, 3", (time.time(),))

    # -- expiry and start-up recovery -----------------------------------------------------------
    def expired(self, now: float) -> list[CheckpointRecord]:
        return self._records(CheckpointRecord, "SELECT * FROM checkpoints WHERE expires_at IS NOT NULL"
                             " AND expires_at <= ?", (now,))

    def all(self) -> list[CheckpointRecord]:
        return self._records(CheckpointRecord, "SELECT * FROM checkpoints")
