"""Durable state in one embedded SQLite file: sessions, models, futures, checkpoints, sample records.

The connections (one writer, a reader per thread), WAL journaling and the time budget of the queries
a user shapes are `SQLiteDB`'s (sqlite_db.py), shared with the tables other modules keep
(`store_accounting.py`: usage, audit log, request timings).

Futures are keyed by request id and, for training requests, unique per (model_id, seq_id): a
resubmitted chunk finds its original request id here, which is what makes retries idempotent.
"""

from __future__ import annotations

import json
import sqlite3
import time
from pathlib import Path

from .request_types import Failure
from .sqlite_db import DEFAULT_QUERY_BUDGET_S, SQLiteDB
from .store_search import create_search_indexes, metadata_rows
from .store_records import (CheckpointRecord, FutureRecord, LossPoint, ModelRecord, Record, SamplingSessionRecord,
                            SessionRecord, StoredBytes, StoredSample, from_row)

DB_FILENAME = "hosted_tinker.sqlite3"  # inside --data-dir


def db_path(data_dir: Path) -> Path:
    return Path(data_dir) / DB_FILENAME


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
"""


SAMPLING_SCHEMA = """
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

# Recorded samples (sampling/records.py): one row per recorded sample request (its prompt is shared
# by its num_samples sequences), one per sequence. A request row goes with its last sequence.
SAMPLE_RECORDS_SCHEMA = """
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

# The dashboard's loss curves: `loss:sum` of every forward / forward_backward request, with the
# number of optimizer steps its model had taken when it ran (a step's chunks and accumulated
# micro-batches share that number: their sum is the step's loss).
LOSS_SCHEMA = """
CREATE TABLE IF NOT EXISTS request_losses (
    model_id TEXT NOT NULL,
    seq_id INTEGER NOT NULL,
    step INTEGER NOT NULL,
    forward_only INTEGER NOT NULL,
    loss_sum REAL NOT NULL,
    created_at REAL NOT NULL,
    PRIMARY KEY (model_id, seq_id)
);
"""

REST_INDEXES = """
CREATE INDEX IF NOT EXISTS checkpoints_expiry ON checkpoints(expires_at) WHERE expires_at IS NOT NULL;
CREATE INDEX IF NOT EXISTS checkpoints_owner ON checkpoints(owner, created_at);
CREATE INDEX IF NOT EXISTS models_owner ON models(owner, created_at);
-- A session's runs: whether one holds a public checkpoint is asked of every session a search reads.
CREATE INDEX IF NOT EXISTS models_session ON models(session_id);
CREATE INDEX IF NOT EXISTS sessions_owner ON sessions(owner, created_at);
"""


class Store:
    def __init__(self, path: Path, query_budget_s: float = DEFAULT_QUERY_BUDGET_S):
        # Shared with the tables of other modules (`Store.db`).
        self.db = SQLiteDB(path, query_budget_s)
        self.path = path
        self.db.create(SCHEMA + SAMPLING_SCHEMA + SAMPLE_RECORDS_SCHEMA + LOSS_SCHEMA + REST_INDEXES)
        create_search_indexes(self.db)

    def close(self) -> None:
        self.db.close()

    def _exec(self, sql: str, args: tuple = ()) -> sqlite3.Cursor:
        return self.db.execute(sql, args)

    def _one(self, sql: str, args: tuple = (), *, budgeted: bool = False) -> sqlite3.Row | None:
        return self.db.one(sql, args, budgeted=budgeted)

    def _all(self, sql: str, args: tuple = (), *, budgeted: bool = False) -> list[sqlite3.Row]:
        return self.db.all(sql, args, budgeted=budgeted)

    def _record(self, cls: type[Record], sql: str, args: tuple = ()) -> Record | None:
        row = self._one(sql, args)
        return None if row is None else from_row(cls, row)

    def _records(self, cls: type[Record], sql: str, args: tuple = (), *, budgeted: bool = False) -> list[Record]:
        return [from_row(cls, row) for row in self._all(sql, args, budgeted=budgeted)]

    # -- start-up -------------------------------------------------------------------------------
    def fail_interrupted_futures(self, message: str) -> int:
        """Futures that were pending when the server died fail cleanly (category server)."""
        body = Failure(message, "server").to_wire()
        cur = self._exec(
            "UPDATE futures SET status='failed', result=?, result_is_proto=0, completed_at=? "
            "WHERE status='pending'", (body, time.time()))
        return cur.rowcount

    # -- sessions -------------------------------------------------------------------------------
    def create_session(self, session_id: str, owner: str, tags: list[str], user_metadata: dict,
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

    def get_session(self, session_id: str) -> SessionRecord | None:
        return self._record(SessionRecord, "SELECT * FROM sessions WHERE session_id=?", (session_id,))

    def touch_session(self, session_id: str) -> None:
        self._exec("UPDATE sessions SET last_heartbeat=? WHERE session_id=?", (time.time(), session_id))

    def finish_session(self, session_id: str, status: str) -> None:
        self._exec("UPDATE sessions SET status=? WHERE session_id=?", (status, session_id))

    # -- models ---------------------------------------------------------------------------------
    def create_model(self, model_id: str, session_id: str, owner: str, base_model: str,
                     lora_config: dict, optimizer_config: dict, user_metadata: dict) -> None:
        now = time.time()
        self._exec(
            "INSERT INTO models(model_id, session_id, owner, base_model, lora_config, optimizer_config,"
            " user_metadata, created_at, last_request_at) VALUES (?,?,?,?,?,?,?,?,?)",
            (model_id, session_id, owner, base_model, json.dumps(lora_config), json.dumps(optimizer_config),
             json.dumps(user_metadata), now, now))

    def get_model(self, model_id: str) -> ModelRecord | None:
        return self._record(ModelRecord, "SELECT * FROM models WHERE model_id=?", (model_id,))

    def update_model_lora(self, model_id: str, lora_config: dict) -> None:
        self._exec("UPDATE models SET lora_config=? WHERE model_id=?", (json.dumps(lora_config), model_id))

    def set_model_status(self, model_id: str, status: str) -> None:
        self._exec("UPDATE models SET status=? WHERE model_id=?", (status, model_id))

    def count_active_models(self, owner: str) -> int:
        return self._one("SELECT COUNT(*) FROM models WHERE owner=? AND status='active'", (owner,))[0]

    def mark_models_unloaded(self) -> int:
        """At start-up: no adapter survives a restart, so no model is live."""
        return self._exec("UPDATE models SET status='unloaded' WHERE status='active'").rowcount

    def session_model_ids(self, session_id: str) -> list[str]:
        return [r[0] for r in self._all("SELECT model_id FROM models WHERE session_id=?", (session_id,))]

    # -- futures --------------------------------------------------------------------------------
    def insert_future(self, request_id: str, owner: str, kind: str, model_id: str | None,
                      seq_id: int | None) -> str:
        """Insert a pending future; for a (model_id, seq_id) seen before, return its request id."""
        def insert(c: sqlite3.Connection) -> str:
            if seq_id is not None:
                row = c.execute("SELECT request_id FROM futures WHERE model_id=? AND seq_id=?",
                                (model_id, seq_id)).fetchone()
                if row is not None:
                    return row[0]
            c.execute("INSERT INTO futures(request_id, owner, kind, model_id, seq_id, status, created_at)"
                      " VALUES (?,?,?,?,?, 'pending', ?)", (request_id, owner, kind, model_id, seq_id, time.time()))
            return request_id

        return self.db.write(insert)

    def get_future_id(self, model_id: str, seq_id: int) -> str | None:
        row = self._one("SELECT request_id FROM futures WHERE model_id=? AND seq_id=?", (model_id, seq_id))
        return None if row is None else row[0]

    def complete_future(self, request_id: str, result: bytes, is_proto: bool, failed: bool) -> None:
        self._exec(
            "UPDATE futures SET status=?, result=?, result_is_proto=?, completed_at=? WHERE request_id=?",
            ("failed" if failed else "done", result, int(is_proto), time.time(), request_id))

    def complete_futures(self, results: list[tuple[str, bytes, bool, bool]], touched_models: list[str]) -> None:
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

    def get_future(self, request_id: str) -> FutureRecord | None:
        return self._record(FutureRecord, "SELECT * FROM futures WHERE request_id=?", (request_id,))

    # -- sampling sessions ----------------------------------------------------------------------
    def create_sampling_session(self, sampling_session_id: str, session_id: str, owner: str, base_model: str,
                                model_path: str | None, checkpoint_dir: str | None) -> None:
        """Idempotent: a retried creation with the same id keeps the first record."""
        self._exec(
            "INSERT OR IGNORE INTO sampling_sessions(sampling_session_id, session_id, owner, base_model,"
            " model_path, checkpoint_dir, created_at) VALUES (?,?,?,?,?,?,?)",
            (sampling_session_id, session_id, owner, base_model, model_path, checkpoint_dir, time.time()))

    def get_sampling_session(self, sampling_session_id: str) -> SamplingSessionRecord | None:
        return self._record(SamplingSessionRecord, "SELECT * FROM sampling_sessions WHERE sampling_session_id=?",
                            (sampling_session_id,))

    # -- sample records -------------------------------------------------------------------------
    def insert_sample_records(self, request: dict, sequences: list[tuple[str, int, bytes, bytes]], now: float) -> None:
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

    def sample_request_exists(self, sampling_session_id: str, seq_id: int) -> bool:
        return self._one("SELECT 1 FROM sample_requests WHERE sampling_session_id=? AND seq_id=?",
                         (sampling_session_id, seq_id)) is not None

    def get_sample_records(self, sequence_ids: list[str]) -> list[StoredSample]:
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

    def touch_sample_records(self, sequence_ids: list[str], now: float) -> None:
        self.db.executemany("UPDATE sample_records SET last_used_at=? WHERE sequence_id=?",
                            [(now, sid) for sid in sequence_ids])

    def delete_sample_records_unused_since(self, before: float) -> int:
        """Delete sequences last used at or before `before`, and requests left without any."""
        def delete(c: sqlite3.Connection) -> int:
            n = c.execute("DELETE FROM sample_records WHERE last_used_at <= ?", (before,)).rowcount
            c.execute("DELETE FROM sample_requests WHERE NOT EXISTS"
                      " (SELECT 1 FROM sample_records r WHERE r.request_id = sample_requests.request_id)")
            return n

        return self.db.write(delete)

    # -- checkpoints ----------------------------------------------------------------------------
    def upsert_checkpoint(self, model_id: str, checkpoint_id: str, kind: str, owner: str, dir: str,
                          size_bytes: int, expires_at: float | None, user_metadata: dict) -> None:
        self._exec(
            "INSERT OR REPLACE INTO checkpoints(model_id, checkpoint_id, kind, owner, dir, size_bytes,"
            " created_at, expires_at, user_metadata) VALUES (?,?,?,?,?,?,?,?,?)",
            (model_id, checkpoint_id, kind, owner, dir, size_bytes, time.time(), expires_at,
             json.dumps(user_metadata)))

    def get_checkpoint(self, model_id: str, checkpoint_id: str) -> CheckpointRecord | None:
        return self._record(CheckpointRecord, "SELECT * FROM checkpoints WHERE model_id=? AND checkpoint_id=?",
                            (model_id, checkpoint_id))

    # -- REST: runs and checkpoints -------------------------------------------------------------
    # Listings never show an expired checkpoint, even before the sweeper has removed it.
    _LIVE = "(c.expires_at IS NULL OR c.expires_at > ?)"

    def list_runs(self, owner: str, *, accessible: bool, project_id: str | None, limit: int,
                  offset: int) -> tuple[list[ModelRecord], int]:
        """Runs owned by `owner` (plus, if `accessible`, others' runs with a public checkpoint), newest first.
        A project is the owner's own label on a session: `project_id` matches only `owner`'s runs, so
        it can never be used to confirm another owner's (private) project names."""
        where = (f"(m.owner = ? OR (? AND EXISTS (SELECT 1 FROM checkpoints c WHERE c.model_id = m.model_id"
                 f" AND c.public = 1 AND {self._LIVE})))"
                 " AND (? IS NULL OR m.session_id IN (SELECT session_id FROM sessions WHERE project_id = ?"
                 " AND owner = ?))")
        args = (owner, int(accessible), time.time(), project_id, project_id, owner)
        total = self._one(f"SELECT COUNT(*) FROM models m WHERE {where}", args, budgeted=True)[0]
        rows = self._records(ModelRecord, f"SELECT m.* FROM models m WHERE {where}"
                             " ORDER BY m.created_at DESC, m.model_id LIMIT ? OFFSET ?", args + (limit, offset),
                             budgeted=True)
        return rows, total

    def run_has_public_checkpoint(self, model_id: str) -> bool:
        return self._one(f"SELECT 1 FROM checkpoints c WHERE c.model_id = ? AND c.public = 1 AND {self._LIVE}",
                         (model_id, time.time())) is not None

    def live_checkpoints(self, model_id: str, *, public_only: bool = False) -> list[CheckpointRecord]:
        """A run's unexpired checkpoints, oldest first."""
        return self._records(CheckpointRecord, f"SELECT * FROM checkpoints c WHERE c.model_id = ? AND {self._LIVE}"
                             f"{' AND c.public = 1' if public_only else ''} ORDER BY c.created_at, c.checkpoint_id",
                             (model_id, time.time()))

    def owner_checkpoints(self, owner: str, limit: int, offset: int) -> tuple[list[CheckpointRecord], int]:
        """Every unexpired checkpoint of `owner`, newest first."""
        now = time.time()
        total = self._one(f"SELECT COUNT(*) FROM checkpoints c WHERE c.owner = ? AND {self._LIVE}", (owner, now),
                          budgeted=True)[0]
        rows = self._records(CheckpointRecord, f"SELECT * FROM checkpoints c WHERE c.owner = ? AND {self._LIVE}"
                             " ORDER BY c.created_at DESC, c.model_id, c.checkpoint_id LIMIT ? OFFSET ?",
                             (owner, now, limit, offset), budgeted=True)
        return rows, total

    def set_checkpoint_public(self, model_id: str, checkpoint_id: str, public: bool) -> None:
        self._exec("UPDATE checkpoints SET public=? WHERE model_id=? AND checkpoint_id=?",
                   (int(public), model_id, checkpoint_id))

    def set_checkpoint_expiry(self, model_id: str, checkpoint_id: str, expires_at: float | None) -> None:
        self._exec("UPDATE checkpoints SET expires_at=? WHERE model_id=? AND checkpoint_id=?",
                   (expires_at, model_id, checkpoint_id))

    def set_checkpoint_files(self, model_id: str, checkpoint_id: str, size_bytes: int, created_at: float) -> None:
        self._exec("UPDATE checkpoints SET size_bytes=?, created_at=? WHERE model_id=? AND checkpoint_id=?",
                   (size_bytes, created_at, model_id, checkpoint_id))

    def expired_checkpoints(self, now: float) -> list[CheckpointRecord]:
        return self._records(CheckpointRecord, "SELECT * FROM checkpoints WHERE expires_at IS NOT NULL"
                             " AND expires_at <= ?", (now,))

    def delete_checkpoint_if(self, model_id: str, checkpoint_id: str, *, expired_before: float | None = None) -> bool:
        """Delete the record (only if it expired before `expired_before`, when given); True if one went."""
        sql = "DELETE FROM checkpoints WHERE model_id=? AND checkpoint_id=?"
        args: tuple = (model_id, checkpoint_id)
        if expired_before is not None:
            sql += " AND expires_at IS NOT NULL AND expires_at <= ?"
            args += (expired_before,)
        return self._exec(sql, args).rowcount > 0

    def all_checkpoints(self) -> list[CheckpointRecord]:
        return self._records(CheckpointRecord, "SELECT * FROM checkpoints")

    def live_checkpoint_storage(self) -> list[StoredBytes]:
        """Unexpired checkpoints' count and bytes per (owner, base model, session) of their runs."""
        return self._records(
            StoredBytes, f"SELECT c.owner, COALESCE(m.base_model, '') AS base_model, COALESCE(m.session_id, '') AS"
            " session_id, COUNT(*) AS checkpoints, SUM(c.size_bytes) AS size_bytes FROM checkpoints c LEFT JOIN models"
            f" m ON m.model_id = c.model_id WHERE {self._LIVE} GROUP BY 1, 2, 3", (time.time(),))

    def list_sessions(self, owner: str, limit: int, offset: int) -> tuple[list[str], int]:
        total = self._one("SELECT COUNT(*) FROM sessions WHERE owner=?", (owner,), budgeted=True)[0]
        rows = self._all("SELECT session_id FROM sessions WHERE owner=? ORDER BY created_at DESC, session_id"
                         " LIMIT ? OFFSET ?", (owner, limit, offset), budgeted=True)
        return [r[0] for r in rows], total

    def set_session_project(self, session_id: str, project_id: str | None) -> None:
        self._exec("UPDATE sessions SET project_id=? WHERE session_id=?", (project_id, session_id))

    def session_sampler_ids(self, session_id: str) -> list[str]:
        return [r[0] for r in self._all("SELECT sampling_session_id FROM sampling_sessions WHERE session_id=?"
                                        " ORDER BY created_at", (session_id,))]

    # -- loss curves (dashboard) ----------------------------------------------------------------
    def record_losses(self, rows: list[tuple[str, int, int, bool, float]]) -> None:
        """(model_id, seq_id, step, forward_only, loss_sum) per finished request; a retry replaces its row."""
        now = time.time()
        if not rows:
            return
        self.db.executemany(  # one write on the writer (one commit), however many tenants the cycle ran
            "INSERT OR REPLACE INTO request_losses(model_id, seq_id, step, forward_only, loss_sum, created_at)"
            " VALUES (?,?,?,?,?,?)", [(m, q, s, int(f), loss, now) for m, q, s, f, loss in rows])

    def loss_curve(self, model_id: str) -> list[LossPoint]:
        """Per optimizer step: the summed `loss:sum` of its training requests (and of its forward-only ones)."""
        return self._records(
            LossPoint, "SELECT step, SUM(CASE WHEN forward_only = 0 THEN loss_sum END) AS train_loss_sum,"
            " SUM(CASE WHEN forward_only = 1 THEN loss_sum END) AS eval_loss_sum, COUNT(*) AS requests"
            " FROM request_losses WHERE model_id = ? GROUP BY step ORDER BY step", (model_id,))
