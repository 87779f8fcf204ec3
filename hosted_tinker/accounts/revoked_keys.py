"""API keys deleted by their holders in dev mode (`tinker auth logout` of a key the CLI made), kept in
the data directory so that a restart does not bring them back.

In dev mode the server accepts any `tml-` key, so deleting one means refusing it from then on: its
SHA-256 digest goes into `DATA_DIR/revoked_api_keys` (one hex digest a line). Only digests are kept,
never a key. The file is rewritten whole through a synced temporary file and a rename, so a crash
leaves the old list or the new one. With keys configured the list is not consulted: the operator's
keys file (or environment) alone says which keys work.
"""

from __future__ import annotations

import os
import threading
import uuid
from pathlib import Path

REVOKED_KEYS_FILE = "revoked_api_keys"


class RevokedKeys:
    def __init__(self, path: Path):
        self.path = Path(path)
        self._lock = threading.Lock()
        self._digests = self._read()

    def _read(self) -> frozenset[bytes]:
        try:
            lines = self.path.read_text().split()
        except FileNotFoundError:
            return frozenset()
        try:
            return frozenset(bytes.fromhex(line) for line in lines)
        except ValueError:
            raise ValueError(f"{self.path} is not a list of key digests (one hex digest a line): fix or remove "
                             "it (removing it accepts again the keys deleted in dev mode)") from None

    def __contains__(self, digest: bytes) -> bool:
        return digest in self._digests

    def digests(self) -> frozenset[bytes]:
        return self._digests

    def add(self, digest: bytes) -> None:
        """Refuse the key of `digest` from now on (written to disk before this returns)."""
        with self._lock:
            digests = self._digests | {digest}
            self.path.parent.mkdir(parents=True, exist_ok=True)
            tmp = self.path.parent / f".{self.path.name}.{uuid.uuid4().hex[:8]}"
            fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
            with os.fdopen(fd, "w") as f:
                f.write("".join(d.hex() + "\n" for d in sorted(digests)))
                f.flush()
                os.fsync(f.fileno())
            os.replace(tmp, self.path)
            self._digests = digests
