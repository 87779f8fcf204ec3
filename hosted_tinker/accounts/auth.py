"""API keys: who may call the server, and which owner each key acts for.

Keys come from `HOSTED_TINKER_API_KEYS` (comma-separated entries) and/or a keys file
(`--api-keys-file`, one entry per line, `#` comments). Both take the same entries, `owner: key` or a
bare `key`, parsed by one function; a malformed entry stops the server at start-up. Only SHA-256 digests of keys are held
in memory, and a presented key is checked against every digest with a constant-time compare, so
neither the keys nor which one matched leak through timing or logs.

With no keys configured the server runs in dev mode: any Tinker-shaped key (`tml-...`) is
accepted, each distinct key being its own owner. The server says so loudly at start-up.

The keys file is read again whenever it changes: a key removed from it is refused from the next
request on. `Authenticator` takes either credential the SDK sends as `X-API-Key`: an API key, or
a JWT this server issued for one (auth_tokens.py), refused once its key is gone.

A key's holder may ask what the key is (`tinker auth login` does) and delete it (`tinker auth logout`
of a key the CLI made). A key of the keys file or the environment is the operator's: deleting it is
refused, naming where it lives. In dev mode a deleted key is refused from then on (revoked_keys.py).
"""

from __future__ import annotations

import hashlib
import hmac
import logging
import os
import threading
from dataclasses import dataclass
from pathlib import Path

from .tokens import InvalidToken, TokenClaims, TokenSigner
from ..errors import Forbidden
from .revoked_keys import RevokedKeys

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
    """The accepted keys. Loaded with a keys file, it reads the file again when the file changes (one
    stat per look-up): a key removed there stops working at once, and so do the tokens issued for it."""

    def __init__(self, entries: list[tuple[str, str]], *, keys_file: Path | None = None,
                 env_entries: list[tuple[str, str]] = ()):
        """entries: (owner, key) pairs; those of `keys_file` are read again when it changes."""
        self._entries = [(_digest(key), owner) for owner, key in entries]
        self._dev_mode = not self._entries  # fixed at start: a keys file emptied later accepts nobody
        self._keys_file = keys_file
        self._env_entries = [(_digest(key), owner) for owner, key in env_entries]
        self._stamp = _stamp(keys_file)
        self._lock = threading.Lock()

    @property
    def dev_mode(self) -> bool:
        return self._dev_mode

    def __len__(self) -> int:
        self._refresh()
        return len(self._entries)

    @classmethod
    def load(cls, keys_file: Path | None, env: dict | None = None) -> "KeyRing":
        """Raises KeyConfigError if any entry is malformed, OSError if the keys file cannot be read."""
        env = os.environ if env is None else env
        env_entries: list[tuple[str, str]] = []
        for n, raw in enumerate(env.get(ENV_VAR, "").split(","), 1):
            entry = parse_entry(raw, f"${ENV_VAR} entry {n}", in_env=True)
            if entry is not None:
                env_entries.append(entry)
        file_entries = _read_keys_file(keys_file) if keys_file is not None else []
        return cls(env_entries + file_entries, keys_file=keys_file, env_entries=env_entries)

    def _refresh(self) -> None:
        if self._keys_file is None:
            return
        stamp = _stamp(self._keys_file)
        with self._lock:
            if stamp == self._stamp:
                return
            self._stamp = stamp
            try:
                entries = [(_digest(key), owner) for owner, key in _read_keys_file(self._keys_file)]
            except (OSError, KeyConfigError) as e:  # said loudly; the keys in force stay as they were
                log.error("the keys file %s changed but cannot be used (%s); the keys read before stay in force",
                          self._keys_file, e)
                return
            self._entries = self._env_entries + entries
            log.info("the keys file %s changed: %d API key(s) now", self._keys_file, len(self._entries))

    def owner(self, key: str | None) -> str | None:
        """The owner a key acts for, or None if the key is not accepted."""
        if not key or not key.startswith("tml-"):
            return None
        if self.dev_mode:
            return anonymous_owner(key)
        self._refresh()
        presented = _digest(key)
        found = None
        for digest, owner in self._entries:  # no early exit: constant time in the match position
            if hmac.compare_digest(digest, presented) and found is None:
                found = owner
        return found

    def source(self, key: str) -> str:
        """Where an accepted key comes from: DEV_MODE, KEYS_FILE or ENV_KEYS."""
        if self.dev_mode:
            return DEV_MODE
        presented = _digest(key)
        return ENV_KEYS if any(hmac.compare_digest(d, presented) for d, _ in self._env_entries) else KEYS_FILE

    def owners(self) -> set[str]:
        """Every owner named by a key (none in dev mode, where each key is its own anonymous owner)."""
        self._refresh()
        return {owner for _, owner in self._entries}

    def digests(self, owner: str) -> list[bytes]:
        """The digests of `owner`'s accepted keys."""
        self._refresh()
        return [digest for digest, o in self._entries if o == owner]


def _read_keys_file(keys_file: Path) -> list[tuple[str, str]]:
    entries = []
    for n, raw in enumerate(Path(keys_file).read_text().splitlines(), 1):
        entry = parse_entry(raw.split("#", 1)[0], f"{keys_file}:{n}", in_env=False)
        if entry is not None:
            entries.append(entry)
    return entries


def _stamp(path: Path | None) -> tuple[int, int, int] | None:
    """What tells a changed file: inode (a rename over it), size and modification time."""
    if path is None:
        return None
    try:
        st = os.stat(path)
    except OSError:
        return None
    return st.st_ino, st.st_size, st.st_mtime_ns


DEV_MODE, KEYS_FILE, ENV_KEYS = "dev mode", "keys file", f"${ENV_VAR}"


@dataclass(frozen=True)
class KeyInfo:
    """What the holder of an API key may learn about it (`GET /api/v1/auth/apikey/me`)."""

    key_id: int  # from the key's digest: stable, and tells nothing of the key
    owner: str
    source: str  # DEV_MODE, KEYS_FILE or ENV_KEYS


class InvalidCredential(Exception):
    """A credential that is refused; the message says why. `token`: it was a JWT (the answer says
    `invalid_token`, and the SDK exchanges its API key for a new one once)."""

    def __init__(self, message: str, *, token: bool = False):
        super().__init__(message)
        self.token = token


class Authenticator:
    """Who a credential acts for: an API key (`tml-...`) or a JWT this server issued for one (`eyJ...`)."""

    def __init__(self, keyring: KeyRing, tokens: TokenSigner, revoked: RevokedKeys):
        self.keyring = keyring
        self.tokens = tokens
        self.revoked = revoked  # consulted in dev mode only: otherwise the operator's keys say

    def owner(self, credential: str | None) -> str:
        """The owner `credential` acts for; `InvalidCredential` saying why it is refused."""
        if credential and credential.startswith("eyJ"):
            return self._token_claims(credential).owner
        return self._key_owner(credential)

    def issue_token(self, credential: str | None) -> str:
        """A fresh JWT for the owner of `credential` (an API key, or a valid token of this server's)."""
        if credential and credential.startswith("eyJ"):
            claims = self._token_claims(credential)
            return self.tokens.issue(claims.owner, claims.key_mark)
        owner = self._key_owner(credential)
        return self.tokens.issue(owner, self.tokens.key_marks([_digest(credential)])[0])

    def key_info(self, credential: str | None) -> KeyInfo:
        """What the API key `credential` is; `InvalidCredential` if it is refused (or is a token)."""
        if credential and credential.startswith("eyJ"):
            raise InvalidCredential("this call takes the API key itself (tml-...), not a token issued for it")
        owner = self._key_owner(credential)
        return KeyInfo(int.from_bytes(_digest(credential)[:6], "big"), owner, self.keyring.source(credential))

    def delete_key(self, credential: str | None) -> KeyInfo:
        """Refuse the API key `credential` from now on, asked by its holder. `Forbidden` for a key the
        operator manages: only they can remove it."""
        info = self.key_info(credential)
        if info.source == KEYS_FILE:
            raise Forbidden("this API key is managed by the server's operator in its keys file; it cannot be "
                            "deleted through the API: ask the operator to remove it there (it stops working at once)")
        if info.source == ENV_KEYS:
            raise Forbidden(f"this API key is managed by the server's operator in ${ENV_VAR}; it cannot be deleted "
                            "through the API: ask the operator to remove it there (and restart the server)")
        self.revoked.add(_digest(credential))
        log.info("dev mode: an API key of owner %s (key id %d) was deleted by its holder; it is refused from now on",
                 info.owner, info.key_id)
        return info

    def _key_owner(self, key: str | None) -> str:
        if not key:
            raise InvalidCredential("missing API key: send it in the X-API-Key header")
        if not key.startswith("tml-"):
            raise InvalidCredential("invalid API key: Tinker keys start with 'tml-'")
        owner = self.keyring.owner(key)
        if owner is None:
            raise InvalidCredential("invalid API key")
        if self.keyring.dev_mode and _digest(key) in self.revoked:
            raise InvalidCredential("invalid API key: it was deleted (tinker auth logout)")
        return owner

    def _token_claims(self, token: str) -> TokenClaims:
        try:
            claims = self.tokens.verify(token)
        except InvalidToken as e:
            raise InvalidCredential(str(e), token=True) from None
        if self.keyring.dev_mode:
            accepted = claims.key_mark not in self.tokens.key_marks(sorted(self.revoked.digests()))
        else:
            accepted = any(hmac.compare_digest(mark, claims.key_mark) for mark in
                           self.tokens.key_marks(self.keyring.digests(claims.owner)))
        if not accepted:
            raise InvalidCredential("invalid token: the API key it was issued for is no longer accepted", token=True)
        return claims


def redact(value):
    """Copy of a JSON value with credentials blanked (telemetry can echo request headers)."""
    secret = {"x-api-key", "authorization", "x-tinker-weights-access-token", "cf-access-client-secret"}
    if isinstance(value, dict):
        return {k: ("[redacted]" if isinstance(k, str) and k.lower() in secret else redact(v))
                for k, v in value.items()}
    if isinstance(value, list):
        return [redact(v) for v in value]
    if isinstance(value, str) and value.startswith(("tml-", "eyJ")):  # an API key or a JWT
        return "[redacted]"
    return value
