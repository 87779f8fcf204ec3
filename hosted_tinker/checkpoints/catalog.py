"""`CheckpointCatalog`: a checkpoint's record and its folder, created, found and deleted together.

The SQLite record is what *lists* a checkpoint; its folder `<root>/<run>/<kind>/<name>` is its
content. Every change to either goes through this class under its one lock (the worker's saves,
imports, REST deletes, the expiry sweeper), in an order that `recovery.recover` can always
repair after a kill -9: a new folder is renamed into place before its record is written, and a
record is deleted before its folder.
"""

from __future__ import annotations

import logging
import os
import shutil
import threading
import time
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import BinaryIO, Callable

from .. import faults
from ..periodic import Periodic
from ..store.tables import Store
from ..store.records import CheckpointRecord
from .encryption import ENCRYPTED_FILES
from .format import CHECKPOINT_FILES, CheckpointError
from .paths import TinkerPath

log = logging.getLogger(__name__)

EXPIRY_SWEEP_S = 2.0  # how often expired checkpoints are removed (files and records)


class CheckpointExists(CheckpointError):
    """A save or import under a live checkpoint's name, without overwrite."""


def is_expired(row: CheckpointRecord | None, now: float | None = None) -> bool:
    return row is not None and row.expires_at is not None and row.expires_at <= (now or time.time())


def version_of(row: CheckpointRecord) -> str:
    """Which version of a checkpoint a record describes: its write time, exactly (an overwrite, or
    a delete and a new save under the same name, gives another)."""
    return repr(float(row.created_at))


def dir_size(path: Path) -> int:
    return sum(f.stat().st_size for f in path.iterdir() if f.is_file())


@dataclass
class OpenFile:
    name: str
    handle: BinaryIO
    size: int
    mtime: float


class CheckpointCatalog:
    def __init__(self, store: Store, root: Path):
        self.store = store
        self.root = root
        # Held while a checkpoint's record and folder change together (never while waiting on
        # I/O that is not that change).
        self.lock = threading.RLock()

    def folder(self, path: TinkerPath) -> Path:
        return self.root / path.run / path.kind / path.name

    def record(self, path: TinkerPath) -> CheckpointRecord | None:
        """The live record of `path`: None if there is none or it has expired."""
        row = self.store.checkpoints.get(path.run, path.checkpoint_id)
        return None if row is None or is_expired(row) else row

    # -- changes ------------------------------------------------------------------------------------
    def save(self, path: TinkerPath, owner: str, write: Callable[[Path], None], *, overwrite: bool,
             ttl_seconds: float | None = None, user_metadata: dict | None = None) -> int:
        """`write(folder)` writes the checkpoint's folder atomically (replacing what is there);
        then its record is written. Returns the folder's size in bytes."""
        folder = self.folder(path)
        with self.lock:
            if not overwrite and self.record(path) is not None:
                raise CheckpointExists(f"checkpoint {path} already exists")
            # No live record: whatever is on disk under that name is unlisted and may be replaced.
            write(folder)
            faults.crash_point("checkpoint.before_record")
            size = dir_size(folder)
            expires = time.time() + ttl_seconds if ttl_seconds else None
            self.store.checkpoints.upsert(path.run, path.checkpoint_id, path.checkpoint_type, owner, str(folder),
                                          size, expires, user_metadata or {})
        return size

    def delete(self, row: CheckpointRecord, *, expired_before: float | None = None) -> bool:
        """Remove a checkpoint's record, then its files. False if the record was already gone (or,
        with `expired_before`, no longer expired: a new save replaced it)."""
        path = TinkerPath.of_record(row.model_id, row.checkpoint_id)
        with self.lock:
            if not self.store.checkpoints.delete_if(path.run, path.checkpoint_id, expired_before=expired_before):
                return False
            faults.crash_point("checkpoint.after_record_deleted")
            folder = self.folder(path)
            trash = folder.parent / f".trash-{folder.name}-{uuid.uuid4().hex[:8]}"
            if not folder.exists():
                return True
            os.rename(folder, trash)  # atomic: gone from its name at once
        faults.crash_point("checkpoint.in_trash")
        shutil.rmtree(trash, ignore_errors=True)
        return True

    def sweep_expired(self, now: float | None = None,
                      on_removed: Callable[[CheckpointRecord], None] = lambda row: None) -> int:
        """Delete every checkpoint whose TTL has passed: its record and its files (`on_removed` hears of each)."""
        now = now or time.time()
        removed = 0
        for row in self.store.checkpoints.expired(now):
            if self.delete(row, expired_before=now):
                removed += 1
                on_removed(row)
                log.info("checkpoint %s expired and was removed", TinkerPath.of_record(row.model_id, row.checkpoint_id))
        return removed

    # -- reading one consistent version -------------------------------------------------------------
    def files(self, path: TinkerPath) -> list[Path]:
        """The checkpoint's files, by name (what downloads and archives carry). Listed under the
        lock: never in the middle of an overwrite's two renames."""
        folder = self.folder(path)
        with self.lock:
            return sorted((folder / n for n in CHECKPOINT_FILES + ENCRYPTED_FILES
                           if (folder / n).is_file() and not (folder / n).is_symlink()), key=lambda f: f.name)

    def open_files(self, path: TinkerPath, names: set[str] | None = None) -> list[OpenFile]:
        """Open the checkpoint's files (or those in `names`) at once, under the lock: one
        consistent version, readable to the end even if it is overwritten or deleted meanwhile."""
        with self.lock:
            out = []
            for f in self.files(path):
                if names is not None and f.name not in names:
                    continue
                fh = open(f, "rb")
                st = os.fstat(fh.fileno())
                out.append(OpenFile(f.name, fh, st.st_size, st.st_mtime))
            return out


class ExpirySweeper:
    """Removes expired checkpoints every `every_s` seconds on its own thread, until stopped."""

    def __init__(self, catalog: CheckpointCatalog, every_s: float = EXPIRY_SWEEP_S,
                 on_removed: Callable[[CheckpointRecord], None] = lambda row: None):
        self.catalog = catalog
        self.on_removed = on_removed  # the audit log hears of each checkpoint removed
        self._sweeps = Periodic("checkpoint-expiry", every_s, self._sweep, "expired checkpoint sweep failed", log)

    def start(self) -> None:
        self._sweeps.start()

    def stop(self) -> None:
        self._sweeps.stop()

    def _sweep(self) -> None:
        self.catalog.sweep_expired(on_removed=self.on_removed)
