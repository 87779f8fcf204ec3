"""Session trace exports (`RestClient.export_session_trace`): built in the background from the request
timings the accounting recorded, kept in the data directory, downloaded through a signed URL.

A trace is named after the timings it was built from (`trace-<rows>-<last row id>.pftrace`): asking again
while nothing new happened in the session hands out the same file with a fresh URL; a new request makes
the next ask build a new one (the older file is removed then). One build runs at a time, on a thread of
its own; a trace holds at most `MAX_TRACE_REQUESTS` request timings, the session's latest.
"""

from __future__ import annotations

import os
import re
import shutil
import threading
import uuid
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

from .. import faults
from ..store.accounting import AccountingTables
from .trace_builder import build_trace

MAX_TRACE_REQUESTS = 20_000
TRACE_URL_TTL_S = 3600  # a download URL is valid this long, as the SDK says ("about an hour")
_SAFE_ID = re.compile(r"^[A-Za-z0-9_:-][A-Za-z0-9._:-]{0,200}$")
_TRACE_FILE = re.compile(r"^trace-\d+-\d+\.pftrace$")


@dataclass(frozen=True)
class TraceGrant:
    """What a trace download URL allows: one trace file of one session, until `expires`."""

    session_id: str
    filename: str
    expires: int

    def message(self) -> bytes:
        return "\n".join(("session-trace", self.session_id, self.filename, str(self.expires))).encode()


@dataclass(frozen=True)
class ExportState:
    status: str  # pending | ready | failed (the SDK's words)
    filename: str | None = None
    error: str | None = None


class TraceExports:
    def __init__(self, tables: AccountingTables, root: Path):
        self.tables = tables
        self.root = root
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="trace-export")
        self._lock = threading.Lock()
        self._jobs: dict[str, tuple[str, Future]] = {}  # session -> (the file it builds, its job)

    def request(self, session_id: str) -> Future:
        """The build of the session's trace as of now: done at once if that trace exists, else the build
        running for it, else a new one."""
        rows, last = self.tables.timings_version(session_id)
        filename = f"trace-{rows}-{last}.pftrace"
        if (self.folder(session_id) / filename).is_file():
            done: Future = Future()
            done.set_result(filename)
            return done
        with self._lock:
            known = self._jobs.get(session_id)
            if known is not None and known[0] == filename:  # running, or failed and not yet told
                return known[1]
            job = self._pool.submit(self._build, session_id, filename, rows)
            self._jobs[session_id] = (filename, job)
            return job

    def state(self, session_id: str, job: Future) -> ExportState:
        """What to tell of `job`; a failure is told once, and asking again starts a new build."""
        if not job.done():
            return ExportState("pending")
        error = job.exception()
        if error is not None:
            with self._lock:
                if self._jobs.get(session_id, (None, None))[1] is job:
                    del self._jobs[session_id]
            return ExportState("failed", error=f"{type(error).__name__}: {error}")
        return ExportState("ready", filename=job.result())

    def folder(self, session_id: str) -> Path:
        if not _SAFE_ID.match(session_id):
            raise ValueError(f"session id {session_id!r} cannot name a folder")
        return self.root / session_id

    def file(self, session_id: str, filename: str) -> Path | None:
        """A built trace file, if it exists (a name that is not a trace's: None)."""
        if not _TRACE_FILE.match(filename) or not _SAFE_ID.match(session_id):
            return None
        path = self.folder(session_id) / filename
        return path if path.is_file() else None

    def _build(self, session_id: str, filename: str, rows: int) -> str:
        faults.gate("trace.build")
        faults.check("trace.build_fails")
        timings = self.tables.timings(session_id, MAX_TRACE_REQUESTS)
        data = build_trace(session_id, timings, max(rows - len(timings), 0), self.tables.sampling_overlaps)
        folder = self.folder(session_id)
        folder.mkdir(parents=True, exist_ok=True)
        tmp = folder / f".{filename}.{uuid.uuid4().hex[:8]}"
        tmp.write_bytes(data)
        os.replace(tmp, folder / filename)
        for old in folder.iterdir():  # the session's earlier traces: one is kept
            if old.name == filename:
                continue
            if old.is_file():
                old.unlink(missing_ok=True)
            else:
                shutil.rmtree(old, ignore_errors=True)
        return filename

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)
