"""`SQLiteDB`: the server's one SQLite connection (WAL) under one lock, shared by every table module.

WAL journaling with synchronous=NORMAL: a commit survives kill -9 of the server (the WAL is in the
OS page cache and is replayed at the next open), at the price of one fsync per checkpoint of the WAL
rather than per commit. Every statement goes through this connection under its lock: the API's
threads, the device loops and the accounting flusher all write, and SQLite serialises writers
anyway. `store.py` keeps the core tables; other modules keep theirs (`store_accounting.py`), each
creating its own schema here.
"""

from __future__ import annotations

import shutil
import sqlite3
import threading
from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from pathlib import Path


class StoreUnavailable(RuntimeError):
    """The database cannot be opened or written at start-up; the message says where and why."""


def _free_space(path: Path) -> str:
    try:
        return f"{shutil.disk_usage(path).free / 2**20:,.0f} MiB free there"
    except OSError as e:
        return f"free space unknown: {e}"


class SQLiteDB:
    def __init__(self, path: Path):
        path.parent.mkdir(parents=True, exist_ok=True)
        self.path = path
        self.lock = threading.Lock()
        with self._opening():
            self.connection = sqlite3.connect(str(path), check_same_thread=False, isolation_level=None)
            self.connection.row_factory = sqlite3.Row
            self.connection.execute("PRAGMA journal_mode=WAL")
            self.connection.execute("PRAGMA synchronous=NORMAL")
            self.connection.execute("PRAGMA busy_timeout=30000")

    @contextmanager
    def _opening(self) -> Iterator[None]:
        try:
            yield
        except sqlite3.Error as e:
            # SQLite reports a full disk in WAL mode as a bare "disk I/O error" (its -shm file cannot
            # grow): name the file and the free space, the two things an operator checks next.
            raise StoreUnavailable(f"cannot open the database {self.path}: {e} ({_free_space(self.path.parent)}; "
                                   "a full disk or a file-size limit gives this error)") from e

    def create(self, schema: str) -> None:
        """Create tables and indexes (`CREATE ... IF NOT EXISTS`), at start-up."""
        with self._opening(), self.lock:
            self.connection.executescript(schema)

    def close(self) -> None:
        with self.lock:
            self.connection.close()

    def execute(self, sql: str, args: tuple | dict = ()) -> sqlite3.Cursor:
        with self.lock:
            return self.connection.execute(sql, args)

    def one(self, sql: str, args: tuple | dict = ()) -> sqlite3.Row | None:
        with self.lock:
            return self.connection.execute(sql, args).fetchone()

    def all(self, sql: str, args: tuple | dict = ()) -> list[sqlite3.Row]:
        with self.lock:
            return self.connection.execute(sql, args).fetchall()

    @contextmanager
    def transaction(self) -> Iterator[sqlite3.Connection]:
        """The connection, inside one transaction (committed at the end of the block, rolled back if it raises)."""
        with self.lock:
            self.connection.execute("BEGIN")
            try:
                yield self.connection
            except BaseException:
                self.connection.execute("ROLLBACK")
                raise
            self.connection.execute("COMMIT")

    def executemany(self, sql: str, rows: Iterable[tuple]) -> None:
        with self.lock:
            self.connection.executemany(sql, rows)
