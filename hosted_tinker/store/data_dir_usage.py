"""How many bytes the data dir holds, by kind: the database by table group, checkpoints, snapshots, ...

What `/metrics` (`hosted_tinker_data_dir_bytes`) and the dashboard show, and what the retention
sweep (retention.py) bounds. The database's groups come from SQLite's `dbstat` table (the bytes of
each table's and index's pages), read on a connection of its own, read-only: WAL lets it read
beside the server's writes without taking their lock. It reads every page, so the sweep measures
the database again only when its file grew or every `REMEASURE_EVERY` sweeps.
"""

from __future__ import annotations

import os
import sqlite3
from pathlib import Path

from .retention import SNAPSHOT_NAME

# A table -> the group its bytes (and its indexes') count in; any other table: "catalog".
TABLE_GROUPS = {
    "futures": "requests", "request_timings": "timings", "request_losses": "losses",
    "sample_requests": "sample_records", "sample_records": "sample_records",
    "audit_log": "audit", "usage_hourly": "usage",
}
HISTORY_GROUPS = ("requests", "timings", "losses")  # the request history (store_retention.HISTORY)
# Files and folders of the data dir -> their kind (checkpoints/ is split into checkpoints and snapshots).
FILE_KINDS = {"telemetry.jsonl": "telemetry", "telemetry.jsonl.1": "telemetry", "traces": "traces",
              "models": "models"}


def database_bytes(path: Path) -> dict[str, int]:
    """Bytes of the database file by group ("database/<group>"), its free pages and its WAL."""
    out: dict[str, int] = {}
    if not path.exists():
        return out
    con = sqlite3.connect(f"file:{path}?mode=ro", uri=True)
    try:
        owner = dict(con.execute("SELECT name, tbl_name FROM sqlite_master WHERE type IN ('table', 'index')"))
        try:
            pages = con.execute("SELECT name, SUM(pgsize) FROM dbstat GROUP BY name").fetchall()
        except sqlite3.OperationalError:  # an SQLite built without dbstat: the file as one
            pages = [("", con.execute("SELECT page_count * page_size FROM pragma_page_count(), pragma_page_size()")
                      .fetchone()[0])]
        for name, size in pages:
            group = "database/" + TABLE_GROUPS.get(owner.get(name, name), "catalog") if name else "database/all"
            out[group] = out.get(group, 0) + int(size or 0)
        free = con.execute("SELECT freelist_count * page_size FROM pragma_freelist_count(), pragma_page_size()")
        out["database/free"] = int(free.fetchone()[0])
    finally:
        con.close()
    wal = path.with_name(path.name + "-wal")
    out["database/wal"] = wal.stat().st_size if wal.exists() else 0
    return out


def files_bytes(data_dir: Path, db_file: Path) -> dict[str, int]:
    """Bytes of everything but the database, by kind; whatever has no kind of its own is "other"."""
    out = {"checkpoints": 0, "snapshots": 0, "telemetry": 0, "traces": 0, "models": 0, "other": 0}
    database = {db_file.name, db_file.name + "-wal", db_file.name + "-shm"}
    for entry in _entries(data_dir):
        if entry.name in database:
            continue
        if entry.name == "checkpoints" and entry.is_dir(follow_symlinks=False):
            for kind, size in _checkpoint_bytes(Path(entry.path)):
                out[kind] += size
        else:
            out[FILE_KINDS.get(entry.name, "other")] += _tree_bytes(entry)
    return out


def _checkpoint_bytes(root: Path):
    """(kind, bytes) of each checkpoint folder under checkpoints/<run>/<kind>/<name>."""
    for run in _entries(root):
        for kind in _entries(Path(run.path)):
            for folder in _entries(Path(kind.path)):
                snapshot = kind.name == "sampler_weights" and SNAPSHOT_NAME.fullmatch(folder.name)
                yield ("snapshots" if snapshot else "checkpoints"), _tree_bytes(folder)


def _entries(path: Path) -> list[os.DirEntry]:
    try:
        with os.scandir(path) as it:
            return list(it)
    except OSError:  # gone meanwhile (a checkpoint deleted while we walk), or not a folder
        return []


def _tree_bytes(entry: os.DirEntry) -> int:
    try:
        if not entry.is_dir(follow_symlinks=False):
            return entry.stat(follow_symlinks=False).st_size
    except OSError:
        return 0
    return sum(_tree_bytes(e) for e in _entries(Path(entry.path)))
