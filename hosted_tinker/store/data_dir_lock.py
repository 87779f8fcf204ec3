"""One data directory, one server: an exclusive lock taken before anything touches the store.

A second server on the same `--data-dir` would run its start-up repair on the first one's SQLite
(failing its running futures, marking its live training runs unloaded) before failing to bind the port.
`flock` on `<data-dir>/server.lock` stops it first; the kernel drops the lock when the holder
exits, kill -9 included, so a stale lock file never blocks a restart. The file holds the
holder's pid, for the refusal message.
"""

from __future__ import annotations

import fcntl
import os
from pathlib import Path

LOCK_FILE = "server.lock"


class DataDirInUse(RuntimeError):
    pass


class DataDirLock:
    def __init__(self, data_dir: Path):
        data_dir.mkdir(parents=True, exist_ok=True)
        self.path = data_dir / LOCK_FILE
        fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = os.read(fd, 32).decode(errors="replace").strip() or "unknown"
            os.close(fd)
            raise DataDirInUse(f"data dir {data_dir.resolve()} is in use by another hosted-tinker server "
                               f"(pid {holder}); stop it or pass another --data-dir") from None
        os.ftruncate(fd, 0)
        os.write(fd, f"{os.getpid()}\n".encode())
        self._fd: int | None = fd

    def release(self) -> None:
        if self._fd is not None:
            os.close(self._fd)  # closing the only descriptor drops the flock
            self._fd = None
