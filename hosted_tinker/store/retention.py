"""What the data dir keeps of its history, in SQL: results dropped once delivered, rows by age and size.

Request history is three tables, each a row per request: `futures` (store_futures.py: the answer the SDK
long-polls, kept so that a result outlives a crash and a resubmitted seq_id finds its request),
`request_timings` (store_accounting.py: what session traces are built from) and `request_losses`
(store_losses.py: the dashboard's loss curves). A future's result is the bulky part (a forward_backward's
per-token logprobs and losses); once the SDK has fetched it (`FutureStore.delivered`) the row keeps
only its small columns, so a late retry is answered with a clear failure rather than a 404, and the
(model_id, seq_id) still dedupes. A result never fetched is kept until its row goes by age.

Rows go oldest first, in short batches by rowid (insertion order, so about time order: a row whose
result was dropped is written again then, a minute or so after its answer) that take the
database's lock one statement at a time: a prune never holds every other request behind one scan,
and needs no index on time. The size bound removes only what no one can still ask for: rows whose
result was dropped, timings and losses; a result still held goes only by age.
"""

from __future__ import annotations

import math
import re

from .database import SQLiteDB
from .records import CheckpointRecord, from_row

BATCH = 2000  # rows per DELETE: each statement holds the database's lock briefly
# A table of request history -> (its time column, which rows may go at all, which may go for the size bound).
HISTORY = {
    "futures": ("completed_at", "status != 'pending'", "status != 'pending' AND result IS NULL"),
    "request_timings": ("arrived_at", "1", "1"),
    "request_losses": ("created_at", "1", "1"),
}
# save_weights_and_get_sampling_client's snapshots (services/training.py names them); a name a user
# may not give (api/training.py), so a checkpoint saved by name is never one of them.
SNAPSHOT_NAME = re.compile(r"ephemeral-\d+")


def drop_results(db: SQLiteDB, request_ids: list[str]) -> int:
    """Forget the results of these answered futures: each row is written again without its result.

    Again, not updated in place: SQLite leaves a row that shrinks on its page, and a result of a few
    KiB fills a page on its own, so an update would free no page. A row written again goes at the
    table's end, small among small ones, and the pages of the old rows go to the free list, which
    new rows reuse."""
    columns = "request_id, owner, kind, model_id, seq_id, status, result_is_proto, created_at, completed_at"
    dropped = 0
    for i in range(0, len(request_ids), 500):  # SQLite caps the number of bound parameters
        part = tuple(request_ids[i:i + 500])
        where = f"status != 'pending' AND result IS NOT NULL AND request_id IN ({','.join('?' * len(part))})"
        with db.transaction() as c:
            rows = c.execute(f"SELECT {columns} FROM futures WHERE {where}", part).fetchall()
            c.execute(f"DELETE FROM futures WHERE {where}", part)
            c.executemany(f"INSERT INTO futures({columns}) VALUES ({','.join('?' * 9)})", [tuple(r) for r in rows])
        dropped += len(rows)
    return dropped


def prune_older(db: SQLiteDB, table: str, before: float) -> int:
    """Delete the rows of a `HISTORY` table older than `before`, oldest first, in batches."""
    column, may_go, _ = HISTORY[table]
    return _delete_in_batches(db, table, f"{may_go} AND {column} < ?", (before,))


def prune_share(db: SQLiteDB, table: str, share: float) -> int:
    """Delete the oldest `share` (0..1) of a `HISTORY` table's rows that the size bound may remove."""
    _, _, may_go = HISTORY[table]
    wanted = math.ceil(share * db.one(f"SELECT COUNT(*) FROM {table} WHERE {may_go}")[0])
    removed = 0
    while removed < wanted:
        n = db.execute(f"DELETE FROM {table} WHERE rowid IN (SELECT rowid FROM {table} WHERE {may_go}"
                       " ORDER BY rowid LIMIT ?)", (min(BATCH, wanted - removed),)).rowcount
        if n == 0:
            break
        removed += n
    return removed


def prune_audit(db: SQLiteDB, before: float) -> int:
    """Delete audit log entries older than `before` (`--audit-retention-s`)."""
    return _delete_in_batches(db, "audit_log", "at < ?", (before,), order="at")


def snapshots(db: SQLiteDB) -> list[CheckpointRecord]:
    """Every sampler snapshot of save_weights_and_get_sampling_client, newest first."""
    rows = db.all("SELECT * FROM checkpoints WHERE kind = 'sampler' AND checkpoint_id LIKE 'sampler_weights/ephemeral-%'"
                  " ORDER BY created_at DESC, model_id, checkpoint_id")
    return [from_row(CheckpointRecord, r) for r in rows
            if SNAPSHOT_NAME.fullmatch(r["checkpoint_id"].partition("/")[2])]


def _delete_in_batches(db: SQLiteDB, table: str, where: str, args: tuple, order: str = "rowid") -> int:
    """Delete the rows matching `where`, looking only at the oldest rows (by `order`) each time: stops
    at the first batch with none to delete, so a prune costs what it removes, not the table's size."""
    removed = 0
    while True:
        n = db.execute(f"DELETE FROM {table} WHERE rowid IN (SELECT rowid FROM {table} ORDER BY {order} LIMIT ?)"
                       f" AND {where}", (BATCH, *args)).rowcount
        removed += n
        if n == 0:
            return removed
