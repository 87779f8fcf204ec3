"""Where the SDK's telemetry batches go: JSON lines under the data directory, bounded on disk.

Each batch is bounded as it arrives (api/service.py), and the file is bounded too: otherwise a
client that keeps sending bounded batches fills the disk every tenant's checkpoints live on. At
`max_bytes` the file is rotated, one previous file kept (`telemetry.jsonl.1`), so at most twice
that stays on disk. logging's RotatingFileHandler does the rotation and serializes concurrent
writers (the route runs on many threads); the file is created with the first batch.
"""

from __future__ import annotations

import json
import logging
from logging.handlers import RotatingFileHandler
from pathlib import Path


class TelemetryLog:
    def __init__(self, path: Path, max_bytes: int):
        self._handler = RotatingFileHandler(path, maxBytes=max_bytes, backupCount=1, encoding="utf-8", delay=True)
        self._handler.setFormatter(logging.Formatter("%(message)s"))

    def write(self, entry: dict) -> None:
        """Append one entry as a JSON line (rotating first if it would pass the bound)."""
        self._handler.handle(logging.makeLogRecord({"msg": json.dumps(entry), "levelno": logging.INFO}))

    def close(self) -> None:
        self._handler.close()
