"""`SQLiteDB`: the server's SQLite file (WAL): one connection writes, every reading thread has its own.

WAL journaling with synchronous=NORMAL: a commit survives kill -9 of the server (the WAL is in the
OS page cache and is replayed at the next open), at the price of one fsync per checkpoint of the WAL
rather than per commit. `store.py` keeps the core tables (a `store_<group>.py` per group of them); other
modules keep theirs (`store_accounting.py`), each creating its own schema here.

Reads never wait for anything but themselves. In WAL mode a reader sees the last commit made before
its statement began while the writer goes on, and readers do not block one another; a Python
connection is used by one thread at a time, so each thread reads on a connection of its own (opened
on its first read). One key's search or listing thus holds up no other key's, nor the device loops'
and the accounting's writes. A write returns once it is committed, so any read that starts after it,
on any thread, sees it.

Writes go through the one writer connection, batched (group commit): a writer queues its write; if
no other writer is committing, it commits every write queued by then in one transaction (each in a
savepoint of its own, so that one that fails is undone alone) and wakes their writers; else it waits
until a batch holds its write, or until it may commit the next one itself. A thread thus commits at
most one batch besides its own write's wait: the device loops never become everyone's writer.
`transaction()` is a block of statements on the writer connection, committed on its own.

A query a user shapes (a search, a listing's page) is read with `budgeted=True`: SQLite checks its
time every `BUDGET_CHECK_STEPS` steps (a progress handler) and stops it past `query_budget_s`
(the `max_query_s` setting); the caller gets `QueryTooSlow`, which names the setting.
"""

from __future__ import annotations

import shutil
import sqlite3
import threading
import time
from collections import deque
from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar

from .. import faults
from ..errors import QueryTooSlow

T = TypeVar("T")
# Wall time: on a busy host a query's steps wait for a CPU too (a 40 ms search took 2 s at a load of 25 on 2 cores).
DEFAULT_QUERY_BUDGET_S = 5.0
BUDGET_CHECK_STEPS = 1000  # SQLite virtual-machine steps between two looks at the clock (tens of microseconds)
MAX_BATCH = 1024  # writes committed together at most: a writer that takes the connection does this much at most


class StoreUnavailable(RuntimeError):
    """The database cannot be opened or written at start-up; the message says where and why."""


def _free_space(path: Path) -> str:
    try:
        return f"{shutil.disk_usage(path).free / 2**20:,.0f} MiB free there"
    except OSError as e:
        return f"free space unknown: {e}"


@dataclass
class _Write:
    """One queued write: what it runs on the writer connection, and once `done`, its result or error."""

    run: Callable[[sqlite3.Connection], Any]
    result: Any = None
    error: BaseException | None = None
    done: bool = False


class _Budget:
    """A budgeted query's progress handler: true (stop the statement) once its time is spent."""

    def __init__(self, seconds: float):
        self.deadline = time.monotonic() + seconds
        self.spent = False

    def __call__(self) -> bool:
        faults.gate("db.user_query")  # tests hold a query here, its statement running (its read open)
        self.spent = time.monotonic() > self.deadline
        return self.spent


class SQLiteDB:
    def __init__(self, path: Path, query_budget_s: float = DEFAULT_QUERY_BUDGET_S):
        path.parent.mkdir(parents=True, exist_ok=True)
        self.path = path
        self.query_budget_s = query_budget_s
        self.lock = threading.Lock()  # the writer connection's
        self._state = threading.Condition()  # over the queue and who commits it: a batch's writers wake when it is done
        self._queued: deque[_Write] = deque()
        self._leading = False  # a writer is committing a batch
        self._local = threading.local()  # this thread's reading connection
        self._readers: dict[threading.Thread, sqlite3.Connection] = {}
        self._readers_lock = threading.Lock()
        self._closed = False
        self.commits = 0  # transactions the writer committed (a batch of writes is one)
        with self._opening():
            self.connection = self._connect()
            self.connection.execute("PRAGMA journal_mode=WAL")

    def _connect(self) -> sqlite3.Connection:
        connection = sqlite3.connect(str(self.path), check_same_thread=False, isolation_level=None)
        connection.row_factory = sqlite3.Row
        connection.execute("PRAGMA synchronous=NORMAL")
        connection.execute("PRAGMA busy_timeout=30000")
        return connection

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

    def migrate(self, run: Callable[[sqlite3.Connection], T]) -> T:
        """A start-up write (a new table and what fills it), as `write`; a failure is `StoreUnavailable`."""
        with self._opening():
            return self.write(run)

    def close(self) -> None:
        with self.lock, self._readers_lock:
            self._closed = True
            self.connection.close()
            for connection in self._readers.values():
                connection.close()
            self._readers.clear()

    # -- reads ----------------------------------------------------------------------------------
    def one(self, sql: str, args: tuple | dict = (), *, budgeted: bool = False) -> sqlite3.Row | None:
        """The first row, read on this thread's connection; `budgeted`: a query a user shapes, stopped
        past the time budget with `QueryTooSlow`."""
        return self._read(sql, args, budgeted, sqlite3.Cursor.fetchone)

    def all(self, sql: str, args: tuple | dict = (), *, budgeted: bool = False) -> list[sqlite3.Row]:
        """Every row, read on this thread's connection (`budgeted`: as `one`)."""
        return self._read(sql, args, budgeted, sqlite3.Cursor.fetchall)

    def _read(self, sql: str, args: tuple | dict, budgeted: bool, fetch: Callable[[sqlite3.Cursor], T]) -> T:
        connection = self._reader()
        budget = _Budget(self.query_budget_s) if budgeted else None
        if budget is not None:
            connection.set_progress_handler(budget, BUDGET_CHECK_STEPS)
        try:
            cursor = connection.execute(sql, args)
            try:  # closed at once: a statement left open would hold its read (and the WAL) until collected
                return fetch(cursor)
            finally:
                cursor.close()
        except sqlite3.OperationalError:
            if budget is not None and budget.spent:
                raise QueryTooSlow(f"this query ran past the server's time budget for one query (max_query_s = "
                                   f"{self.query_budget_s:g} s) and was stopped: narrow it (fewer or more selective "
                                   "filters, a smaller page)") from None
            raise
        finally:
            if budget is not None:
                connection.set_progress_handler(None, 0)

    def _reader(self) -> sqlite3.Connection:
        connection = getattr(self._local, "connection", None)
        if connection is not None:
            return connection
        with self._readers_lock:
            if self._closed:
                raise sqlite3.ProgrammingError(f"the database {self.path} is closed")
            for thread in [t for t in self._readers if not t.is_alive()]:  # a reading thread that has ended
                self._readers.pop(thread).close()
            connection = self._connect()
            connection.execute("PRAGMA query_only=ON")  # reads only: every write goes through the writer
            self._readers[threading.current_thread()] = connection
        self._local.connection = connection
        return connection

    # -- writes ---------------------------------------------------------------------------------
    def write(self, run: Callable[[sqlite3.Connection], T]) -> T:
        """`run(connection)` on the writer connection, inside a transaction, committed (perhaps with
        other threads' writes) before this returns its result. If it raises, what it did is undone and
        its exception raised here; the others' writes stand. `run` may be called on another thread."""
        write = _Write(run)
        with self._state:
            self._queued.append(write)
        while not write.done:
            with self._state:
                while self._leading and not write.done:  # another writer is committing a batch
                    self._state.wait()
                if write.done:  # it was in that batch
                    break
                self._leading = True  # this thread commits the next batch, its own write in it
                batch = self._take_queued()
            try:
                with self.lock:
                    self._commit(batch)
            finally:
                with self._state:
                    self._leading = False
                    self._state.notify_all()
        if write.error is not None:
            raise write.error
        return write.result

    def execute(self, sql: str, args: tuple | dict = ()) -> sqlite3.Cursor:
        """One write statement, committed; its cursor's `rowcount` says how many rows it changed."""
        return self.write(lambda c: c.execute(sql, args))

    def executemany(self, sql: str, rows: Iterable[tuple]) -> sqlite3.Cursor:
        return self.write(lambda c: c.executemany(sql, rows))

    @contextmanager
    def transaction(self) -> Iterator[sqlite3.Connection]:
        """The writer connection, inside one transaction (committed at the end of the block, rolled
        back if it raises). The block holds the writer: keep it to writes."""
        with self.lock:
            self.connection.execute("BEGIN IMMEDIATE")
            try:
                yield self.connection
            except BaseException:
                self.connection.execute("ROLLBACK")
                raise
            self.connection.execute("COMMIT")
            self.commits += 1

    def pending_writes(self) -> int:
        """Writes queued for the writer connection, not yet taken into a transaction."""
        with self._state:
            return len(self._queued)

    def _take_queued(self) -> list[_Write]:
        batch = []
        while self._queued and len(batch) < MAX_BATCH:
            batch.append(self._queued.popleft())
        return batch

    def _commit(self, batch: list[_Write]) -> None:
        """Run `batch` in one transaction, each write in a savepoint when there are several; commit."""
        c = self.connection
        try:
            c.execute("BEGIN IMMEDIATE")
            for write in batch:
                if len(batch) == 1:
                    write.result = write.run(c)  # alone: its failure rolls the transaction back
                    continue
                c.execute("SAVEPOINT one_write")
                try:
                    write.result = write.run(c)
                except Exception as e:
                    c.execute("ROLLBACK TO one_write")
                    write.error = e
                c.execute("RELEASE one_write")
            c.execute("COMMIT")
            self.commits += 1
        except BaseException as e:  # the transaction failed (the disk, a lone write's error): none of it stands
            if c.in_transaction:
                c.execute("ROLLBACK")
            for write in batch:
                if write.error is None:
                    write.result, write.error = None, e
        finally:
            for write in batch:
                write.done = True
