"""The training runs (the `models` table): a LoRA run's configuration, owner, session and status.

A run's `last_request_at` is written with the answers of the cycle that ran it (store_futures.py),
in that cycle's one transaction.
"""

from __future__ import annotations

import json
import sqlite3
import time
from collections.abc import Callable

from .checkpoints import LIVE
from .records import ModelRecord, Table


class RunTable(Table):
    SCHEMA = """
CREATE TABLE IF NOT EXISTS models (
    model_id TEXT PRIMARY KEY,
    session_id TEXT NOT NULL,
    owner TEXT NOT NULL,
    base_model TEXT NOT NULL,
    lora_config TEXT NOT NULL,
    optimizer_config TEXT NOT NULL DEFAULT '{"type": "adamw"}',
    user_metadata TEXT NOT NULL DEFAULT '{}',
    created_at REAL NOT NULL,
    last_request_at REAL NOT NULL,
    status TEXT NOT NULL DEFAULT 'active'
);
CREATE INDEX IF NOT EXISTS models_owner ON models(owner, created_at);
-- A session's runs: whether one holds a public checkpoint is asked of every session a search reads.
CREATE INDEX IF NOT EXISTS models_session ON models(session_id);
"""

    def create(self, model_id: str, session_id: str, owner: str, base_model: str,
               lora_config: dict, optimizer_config: dict, user_metadata: dict) -> None:
        self.db.write(self.creation(model_id, session_id, owner, base_model, lora_config, optimizer_config,
                                    user_metadata))

    def creation(self, model_id: str, session_id: str, owner: str, base_model: str, lora_config: dict,
                 optimizer_config: dict, user_metadata: dict) -> Callable[[sqlite3.Connection], None]:
        """The run's row as a write, for a transaction that writes more (its first request's future)."""
        now = time.time()
        row = (model_id, session_id, owner, base_model, json.dumps(lora_config), json.dumps(optimizer_config),
               json.dumps(user_metadata), now, now)

        def insert(c: sqlite3.Connection) -> None:
            c.execute("INSERT INTO models(model_id, session_id, owner, base_model, lora_config, optimizer_config,"
                      " user_metadata, created_at, last_request_at) VALUES (?,?,?,?,?,?,?,?,?)", row)

        return insert

    def get(self, model_id: str) -> ModelRecord | None:
        return self._record(ModelRecord, "SELECT * FROM models WHERE model_id=?", (model_id,))

    def update_lora(self, model_id: str, lora_config: dict) -> None:
        self.db.execute("UPDATE models SET lora_config=? WHERE model_id=?", (json.dumps(lora_config), model_id))

    def set_status(self, model_id: str, status: str) -> None:
        self.db.execute("UPDATE models SET status=? WHERE model_id=?", (status, model_id))

    def count_active(self, owner: str) -> int:
        return self.db.one("SELECT COUNT(*) FROM models WHERE owner=? AND status='active'", (owner,))[0]

    def mark_unloaded(self) -> int:
        """At start-up: no adapter survives a restart, so no model is live."""
        return self.db.execute("UPDATE models SET status='unloaded' WHERE status='active'").rowcount

    def ids_in_session(self, session_id: str) -> list[str]:
        return [r[0] for r in self.db.all("SELECT model_id FROM models WHERE session_id=?", (session_id,))]

    def page(self, owner: str, *, accessible: bool, project_id: str | None, limit: int,
             offset: int) -> tuple[list[ModelRecord], int]:
        """Runs owned by `owner` (plus, if `accessible`, others' runs with a public checkpoint), newest first.
        A project is the owner's own label on a session: `project_id` matches only `owner`'s runs, so
        it can never be used to confirm another owner's (private) project names."""
        where = (f"(m.owner = ? OR (? AND EXISTS (SELECT 1 FROM checkpoints c WHERE c.model_id = m.model_id"
                 f" AND c.public = 1 AND {LIVE})))"
                 " AND (? IS NULL OR m.session_id IN (SELECT session_id FROM sessions WHERE project_id = ?"
                 " AND owner = ?))")
        args = (owner, int(accessible), time.time(), project_id, project_id, owner)
        total = self.db.one(f"SELECT COUNT(*) FROM models m WHERE {where}", args, budgeted=True)[0]
        rows = self._records(ModelRecord, f"SELECT m.* FROM models m WHERE {where}"
                             " ORDER BY m.created_at DESC, m.model_id LIMIT ? OFFSET ?", args + (limit, offset),
                             budgeted=True)
        return rows, total
