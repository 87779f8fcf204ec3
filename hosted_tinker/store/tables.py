"""Durable state in one embedded SQLite file: the core tables, one small class per group of them.

`Store` opens the database, creates every group's schema and holds the groups, each in a
`store_<group>.py` of its own: `sessions`, `runs` (the `models` table), `futures`, `checkpoints`,
`sampling_sessions`, `samples` (recorded samples) and `losses` (the dashboard's loss curves).
The connections (one writer, a reader per thread), WAL journaling and the time budget of the queries
a user shapes are `SQLiteDB`'s (sqlite_db.py), shared with the tables other modules keep
(`store_accounting.py`: usage, audit log, request timings) through `Store.db`.
"""

from __future__ import annotations

from pathlib import Path

from .database import DEFAULT_QUERY_BUDGET_S, SQLiteDB
from .checkpoints import CheckpointTable
from .futures import FutureTable
from .losses import LossTable
from .runs import RunTable
from .samples import SampleTable
from .sampling_sessions import SamplingSessionTable
from .search import create_search_indexes
from .sessions import SessionTable

DB_FILENAME = "hosted_tinker.sqlite3"  # inside --data-dir


def db_path(data_dir: Path) -> Path:
    return Path(data_dir) / DB_FILENAME


class Store:
    def __init__(self, path: Path, query_budget_s: float = DEFAULT_QUERY_BUDGET_S):
        self.db = SQLiteDB(path, query_budget_s)
        self.path = path
        self.sessions = SessionTable(self.db)
        self.runs = RunTable(self.db)
        self.futures = FutureTable(self.db)
        self.checkpoints = CheckpointTable(self.db)
        self.sampling_sessions = SamplingSessionTable(self.db)
        self.samples = SampleTable(self.db)
        self.losses = LossTable(self.db)
        self.db.create("".join(table.SCHEMA for table in (self.sessions, self.runs, self.futures, self.checkpoints,
                                                           self.sampling_sessions, self.samples, self.losses)))
        create_search_indexes(self.db)

    def close(self) -> None:
        self.db.close()
