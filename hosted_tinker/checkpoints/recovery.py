"""Start-up repair: make checkpoint records and folders agree again after a kill -9.

Run by `Server.start()` before any work is served. Each crash point of a write (declared in
`faults.POINTS`) leaves one of these states:

| crash point                                   | on disk                        | recovery                 |
|-----------------------------------------------|--------------------------------|--------------------------|
| while writing the temporary folder            | `.tmp-<name>-*`                | removed: the old state   |
| overwrite, between its two renames            | `.old-<name>-*`, no `<name>`   | renamed back: old state  |
| after the rename, before the record           | `<name>` without a record      | removed: the old state   |
| overwrite, after the rename, before the record| `<name>` newer than its record | record refreshed: new    |
| delete, after the record went                 | `<name>` or `.trash-*`         | removed                  |

A save that had not resolved its future when the server died is failed at restart ("resubmit"),
so landing on the old state is what the client was told. Folders of runs the database does not
know are never touched: a lost database must not turn into deleted checkpoints.

A manifest is read as untrusted input here too (it may have been imported): one that does not
validate is logged and left out, never copied into the records.
"""

from __future__ import annotations

import logging
import os
import shutil
from dataclasses import dataclass, field
from pathlib import Path

from .catalog import CheckpointCatalog, dir_size
from .encryption import holds_adapter, is_encrypted
from .format import LATEST_TIME, CheckpointError, read_manifest
from .paths import KINDS, InvalidPath, TinkerPath

log = logging.getLogger(__name__)


@dataclass
class RecoveryReport:
    restored: list[str] = field(default_factory=list)         # overwrites rolled back to the old state
    removed_partial: list[str] = field(default_factory=list)  # .tmp-/.trash- leftovers
    removed_orphans: list[str] = field(default_factory=list)  # folders without a record
    removed_records: list[str] = field(default_factory=list)  # records without a folder
    refreshed: list[str] = field(default_factory=list)        # records updated to their newer files

    def __bool__(self) -> bool:
        return any((self.restored, self.removed_partial, self.removed_orphans, self.removed_records, self.refreshed))


def _base_name(hidden: str, prefix: str) -> str:
    return hidden[len(prefix):].rsplit("-", 1)[0]


def _recover_kind_dir(kind_dir: Path, report: RecoveryReport) -> None:
    entries = list(kind_dir.iterdir())
    finals = {e.name for e in entries if not e.name.startswith(".")}
    olds = sorted((e for e in entries if e.name.startswith(".old-")), key=lambda e: e.stat().st_mtime, reverse=True)
    for old in olds:
        name = _base_name(old.name, ".old-")
        if name not in finals:  # killed between the two renames of an overwrite: put the old one back
            os.rename(old, kind_dir / name)
            finals.add(name)
            report.restored.append(str(kind_dir / name))
        else:
            shutil.rmtree(old, ignore_errors=True)
    for e in entries:
        if e.name.startswith((".tmp-", ".trash-")) and e.exists():
            shutil.rmtree(e, ignore_errors=True)
            report.removed_partial.append(str(e))


def _written_at(folder: Path, path: TinkerPath) -> float | None:
    """When the folder's files were written, by its manifest; None if it has no valid one (or an
    encrypted one: the record's time stands)."""
    if is_encrypted(folder):
        return None
    try:
        return read_manifest(folder).created_at
    except CheckpointError as e:
        log.warning("checkpoint %s: its manifest is not used (%s)", path, e)
        return None


def _kind_dirs(run_dir: Path) -> list[Path]:
    return [d for d in run_dir.iterdir() if d.is_dir() and d.name in KINDS]


def recover(catalog: CheckpointCatalog) -> RecoveryReport:
    """Make records and folders agree after a crash (run before serving)."""
    store, root = catalog.store, catalog.root
    report = RecoveryReport()
    run_dirs = [d for d in root.iterdir() if d.is_dir()] if root.is_dir() else []
    with catalog.lock:
        for run_dir in run_dirs:
            for kind_dir in _kind_dirs(run_dir):
                _recover_kind_dir(kind_dir, report)
        known: set[Path] = set()
        for row in store.checkpoints.all():
            tag = f"{row.model_id}/{row.checkpoint_id}"
            try:
                path = TinkerPath.of_record(row.model_id, row.checkpoint_id)
            except InvalidPath:  # saved before names were matched whole (a trailing newline)
                path = None
            folder = catalog.folder(path) if path is not None else None
            if folder is None or not holds_adapter(folder):
                store.checkpoints.delete_if(row.model_id, row.checkpoint_id)
                report.removed_records.append(tag)
                continue
            known.add(folder)
            written = _written_at(folder, path)
            if not 0 <= row.created_at <= LATEST_TIME:  # copied from an unchecked manifest by an older version
                written = written if written is not None else folder.stat().st_mtime
            if written is not None and not written <= row.created_at <= LATEST_TIME:
                # an overwrite renamed in with its record not updated (or a record time no listing can print)
                store.checkpoints.set_files(path.run, path.checkpoint_id, dir_size(folder), written)
                report.refreshed.append(str(path))
            if row.expires_at is not None and not row.expires_at <= LATEST_TIME:
                store.checkpoints.set_expiry(path.run, path.checkpoint_id, None)  # a TTL beyond printable time
                report.refreshed.append(str(path))
        # Folders no record lists, only in runs the database knows.
        for run_dir in run_dirs:
            if store.runs.get(run_dir.name) is None:
                continue
            for kind_dir in _kind_dirs(run_dir):
                for d in kind_dir.iterdir():
                    if not d.name.startswith(".") and d.is_dir() and d not in known:
                        shutil.rmtree(d, ignore_errors=True)
                        report.removed_orphans.append(str(d))
    if report:
        log.warning("checkpoint recovery after an unclean stop: %s", report)
    return report
