"""What the store's tables (store.py) hand out: one frozen record per kind of row, read by attribute.

A record is built from its row inside the store (`Table`), so a column's name is spelled in one place
and a reader's typo is an AttributeError at once, not a KeyError on one path. JSON columns stay the
text they are stored as (`user_metadata`, `lora_config`, ...): each reader decodes what it uses.
SQLite's 0/1 flags become bools.
"""

from __future__ import annotations

import sqlite3
from dataclasses import dataclass
from typing import TypeVar

from .database import SQLiteDB

Record = TypeVar("Record")


def from_row(cls: type[Record], row: sqlite3.Row) -> Record:
    """The record of `row`: its columns, by name, are the record's fields."""
    return cls(**dict(row))


class Table:
    """One group of the store's tables (a `store_<group>.py`): its `SCHEMA`, created by `Store`, and
    its queries, run on the database every group shares."""

    SCHEMA = ""

    def __init__(self, db: SQLiteDB):
        self.db = db

    def _record(self, cls: type[Record], sql: str, args: tuple = ()) -> Record | None:
        row = self.db.one(sql, args)
        return None if row is None else from_row(cls, row)

    def _records(self, cls: type[Record], sql: str, args: tuple = (), *, budgeted: bool = False) -> list[Record]:
        return [from_row(cls, row) for row in self.db.all(sql, args, budgeted=budgeted)]


@dataclass(frozen=True)
class SessionRecord:
    session_id: str
    owner: str
    created_at: float
    last_heartbeat: float
    tags: str  # JSON list
    user_metadata: str  # JSON object
    display_name: str | None
    project_id: str | None
    status: str  # active | ...


@dataclass(frozen=True)
class ModelRecord:
    """A training run (a LoRA model) and its configuration."""

    model_id: str
    session_id: str
    owner: str
    base_model: str
    lora_config: str  # JSON object
    optimizer_config: str  # JSON object
    user_metadata: str  # JSON object
    created_at: float
    last_request_at: float
    status: str  # active | unloaded | ...


@dataclass(frozen=True)
class CheckpointRecord:
    model_id: str
    checkpoint_id: str  # "<kind>/<name>", e.g. "weights/step-10"
    kind: str  # training | sampler | external
    owner: str
    dir: str
    size_bytes: int
    created_at: float
    expires_at: float | None
    public: bool
    user_metadata: str  # JSON object

    def __post_init__(self):
        object.__setattr__(self, "public", bool(self.public))


@dataclass(frozen=True)
class SamplingSessionRecord:
    sampling_session_id: str
    session_id: str
    owner: str
    base_model: str
    model_path: str | None  # tinker:// path it samples from; None = the base model
    checkpoint_dir: str | None  # the adapter snapshot on disk; None = the base model
    created_at: float


@dataclass(frozen=True)
class FutureRecord:
    request_id: str
    owner: str
    kind: str
    model_id: str | None
    seq_id: int | None
    status: str  # pending | done | failed
    result: bytes | None  # JSON text or protobuf bytes
    result_is_proto: bool
    created_at: float
    completed_at: float | None

    def __post_init__(self):
        object.__setattr__(self, "result_is_proto", bool(self.result_is_proto))


@dataclass(frozen=True)
class StoredSample:
    """One recorded sequence joined with its request (sampling/records.py makes arrays of it)."""

    sequence_id: str
    tokens: bytes  # int32
    logprobs: bytes  # float32
    last_used_at: float
    owner: str
    session_id: str
    prompt: bytes  # int32
    weights: str  # tinker:// sampler path, or "base:<model>"
    weights_version: float | None
    temperature: float
    top_k: int
    top_p: float


@dataclass(frozen=True)
class LossPoint:
    """One optimizer step of a run's loss curve (the dashboard's)."""

    step: int
    train_loss_sum: float | None
    eval_loss_sum: float | None
    requests: int


@dataclass(frozen=True)
class StoredBytes:
    """Live checkpoints of one owner's runs of one base model in one session: how many, how many bytes."""

    owner: str
    base_model: str  # '' for a run the store has no record of
    session_id: str  # '' for none (imported runs)
    checkpoints: int
    size_bytes: int
