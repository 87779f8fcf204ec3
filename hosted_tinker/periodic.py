"""`Periodic`: a piece of background work run every so many seconds on a thread of its own, until stopped
(the checkpoint expiry sweep, the accounting's flush)."""

from __future__ import annotations

import logging
import threading
from typing import Callable


class Periodic:
    def __init__(self, name: str, every_s: float, work: Callable[[], None], failed: str, logger: logging.Logger):
        """`work` runs every `every_s` seconds on the daemon thread `name`. One that raises is logged on
        `logger` (its owner's) with `failed` (what failed) and runs again next time: a full disk must not
        end it for good."""
        self.every_s = every_s
        self._work = work
        self._failed = failed
        self._log = logger
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        """No more runs; returns once a run in progress has ended."""
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join()

    def _run(self) -> None:
        while not self._stop.wait(self.every_s):
            try:
                self._work()
            except Exception:
                self._log.exception("%s", self._failed)
