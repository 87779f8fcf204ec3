"""API keys: who may call the server, and which owner each key acts for.

Keys come from `HOSTED_TINKER_API_KEYS` (comma-separated entries) and/or a keys file
(`--api-keys-file`, one entry per line, `#` comments). Both take the same entries, `owner: key` or a
bare `key`, parsed by one function; a malformed entry stops the server at start-up. Only SHA-256 digests of keys are held
in memory, and a presented key is checked against every digest with a constant-time compare, so
neither the keys nor which one matched leak through timing or logs.

With no keys configured the server runs in dev mode: any Tinker-shaped key (`tml-...`) is
accepted, each distinct key being its own owner. The server says so loudly at start-up.
"""

from __future__ import annotations

import hashlib
import hmac
import logging
import os
from pathlib import Path

log = logging.getLogger(__name__)
ENV_VAR = "HOSTED_TINKER_API_KEYS"


def _digest(key: str) -> bytes:
    return hashlib.sha256(key.encode()).digest()


def anonymous_owner(key: str) -> str:
    """A stable, non-reversible owner id for a key that has no configured owner name."""
    return "key-" + hashlib.sha256(key.encode()).hexdigest()[:16]


class KeyConfigError(ValueError):
    """A malformed API key entry; the message names the entry (never the key)."""

    def __init__(self, message: str, *, in_env: bool):
        super().__init__(message)
        self.in_env = in_env  # from $HOSTED_TINKER_API_KEYS, else from the keys file


def parse_entry(text: str, where: str, *, in_env: bool) -> tuple[str, str] | None:
    """`owner: tml-key` or a bare `tml-key` -> (owner, key); None for a blank entry."""
    text = text.strip()
    if not text:
        return None
    owner, _, key = text.rpartition(":")
    owner, key = owner.strip(), key.strip()
    if not key.startswith("tml-") or len(key) <= len("tml-"):
        raise KeyConfigError(f"{where}: API keys must start with 'tml-' (the SDK refuses others); "
                             "expected 'owner: tml-key' or 'tml-key'", in_env=in_env)
    if any(c.isspace() for c in key):
        raise KeyConfigError(f"{where}: an API key contains whitespace; expected 'owner: tml-key' or 'tml-key'",
                             in_env=in_env)
    return owner or anonymous_owner(key), key


class KeyRing:
    def __init__(self, entries: list[tuple[str, str]]):
        """entries: (owner, key) pairs."""
        self._entries = [(_digest(key), owner) for owner, key in entries]

    @property
    def dev_mode(self) -> bool:
        return not self._entries

    def __len__(self) -> int:
        return len(self._entries)

    @classmethod
    def load(cls, keys_file: Path | None, env: dict | None = None) -> "KeyRing":
        """Raises KeyConfigError if any entry is malformed, OSError if the keys file cannot be read."""
        env = os.environ if env is None else env
        entries: list[tuple[str, str]] = []
        for n, raw in enumerate(env.get(ENV_VAR, "").split(","), 1):
            entry = parse_entry(raw, f"${ENV_VAR} entry {n}", in_env=True)
            if entry is not None:
                entries.append(entry)
        if keys_file is not None:
            for n, raw in enumerate(Path(keys_file).read_text().splitlines(), 1):
                entry = parse_entry(raw.split("#", 1)[0], f"{keys_file}:{n}", in_env=False)
                if entry is not None:
                    entries.append(entry)
        return cls(entries)

    def owner(self, key: str | None) -> str | None:
        """The owner a key acts for, or None if the key is not accepted."""
        if not key or not key.startswith("tml-"):
            return None
        if self.dev_mode:
            return anonymous_owner(key)
        presented = _digest(key)
        found = None
        for digest, owner in self._entries:  # no early exit: constant time in the match position
            if hmac.compare_digest(digest, presented) and found is None:
                found = owner
        return found


def redact(value):
    """Copy of a JSON value with credentials blanked (telemetry can echo request headers)."""
    secret = {"x-api-key", "authorization", "x-tinker-weights-access-token", "cf-access-client-secret"}
    if isinstance(value, dict):
        return {k: ("[redacted]" if isinstance(k, str) and k.lower() in secret else redact(v))
                for k, v in value.items()}
    if isinstance(value, list):
        return [redact(v) for v in value]
    if isinstance(value, str) and value.startswith("tml-"):
        return "[redacted]"
    return value
