"""Secrets kept in the data directory (the URL signing key, the JWT signing key): made on first
use, readable by this user alone (mode 0600), replaced atomically.

A new secret is written to a temporary file created with O_EXCL at mode 0600, synced, then renamed
over the old one: a reader sees the old secret or the new one, never a partial file, and a second
process starting at the same moment keeps whichever rename came last (both read it back).
"""

from __future__ import annotations

import os
import secrets
import uuid
from pathlib import Path

SECRET_BYTES = 32


def write_secret(path: Path) -> bytes:
    """A fresh random secret written to `path` (replacing any there); returns it."""
    path.parent.mkdir(parents=True, exist_ok=True)
    secret = secrets.token_bytes(SECRET_BYTES)
    tmp = path.parent / f".{path.name}.{uuid.uuid4().hex[:8]}"
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    with os.fdopen(fd, "w") as f:
        f.write(secret.hex())
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
    return secret


def read_secret(path: Path) -> bytes | None:
    """The secret in `path`, or None if there is none (missing, or not a secret this module wrote)."""
    try:
        secret = bytes.fromhex(path.read_text().strip())
    except (FileNotFoundError, ValueError):
        return None
    return secret if len(secret) >= SECRET_BYTES else None


def load_or_create_secret(path: Path) -> bytes:
    """The secret in `path`, made there first if there is none."""
    for _ in range(2):
        secret = read_secret(path)
        if secret is not None:
            return secret
        write_secret(path)
    raise RuntimeError(f"cannot read or create the secret key file {path}")
