"""Short-lived JWTs for the SDK's token exchange, and the URNs that name users and the organization.

With `pjwt_auth_enabled` in its client config the SDK posts its API key to `/api/v1/auth/token`,
sends the JWT it gets back as its credential, and refreshes it at about half its lifetime
(`tinker/lib/_jwt_auth.py`); `RestClient.whoami()` reads the token's claims: `sub` is the user's
URN and `org_id` the organization's id (the SDK prefixes `tml:organization:`).

Tokens are HS256-signed (PyJWT) with a key kept in the data directory (`jwt_signing.key`, mode
0600, made on first start). `hosted-tinker rotate-token-key` replaces it: every token signed
before then is refused at once (a running server sees the new file on its next check), and the
SDK, told `invalid_token`, exchanges its API key for a new one. A token also carries a mark of the
API key it was issued for (an HMAC of the key's digest under the signing key, so it reveals
nothing of the key): once that key leaves the keys file, its tokens are refused too.
"""

from __future__ import annotations

import hashlib
import hmac
import os
import secrets
import threading
import time
from collections import OrderedDict
from dataclasses import dataclass
from pathlib import Path
from urllib.parse import quote, unquote

import jwt

from ..store.secret_files import load_or_create_secret, read_secret, write_secret

TOKEN_KEY_FILE = "jwt_signing.key"
ORG_ID_FILE = "organization_id"
ISSUER = "hosted-tinker"
ALGORITHM = "HS256"
USER_URN_PREFIX = "tml:user:"
ORG_URN_PREFIX = "tml:organization:"


def user_urn(owner: str) -> str:
    """The URN of an owner of API keys (`whoami`, usage, storage, session search)."""
    return USER_URN_PREFIX + quote(owner, safe="")


def owner_of_urn(urn: str) -> str | None:
    """The owner a user URN names, or None if `urn` is not one."""
    if not urn.startswith(USER_URN_PREFIX) or len(urn) == len(USER_URN_PREFIX):
        return None
    return unquote(urn[len(USER_URN_PREFIX):])


def org_urn(org_id: str) -> str:
    return ORG_URN_PREFIX + org_id


def organization_id(data_dir: Path) -> str:
    """This server's organization id: made on first start, kept in the data directory (a key rotation
    keeps it)."""
    path = data_dir / ORG_ID_FILE
    try:
        return path.read_text().strip()
    except FileNotFoundError:
        org = f"org-{secrets.token_hex(8)}"
        path.parent.mkdir(parents=True, exist_ok=True)
        try:
            with open(path, "x") as f:
                f.write(org + "\n")
        except FileExistsError:  # another process made it first: theirs holds
            return path.read_text().strip()
        return org


def rotate_token_key(data_dir: Path) -> Path:
    """A new signing key in `data_dir`: every token signed with the old one is refused from now on."""
    path = Path(data_dir) / TOKEN_KEY_FILE
    write_secret(path)
    return path


VERIFIED_TOKENS_KEPT = 4096  # live tokens remembered as verified (one per SDK client, renewed hourly)
_EXPIRED = ("invalid token: it has expired; exchange the API key for a new one at /api/v1/auth/token "
            "(the SDK does this by itself)")


class InvalidToken(Exception):
    """A token that is not (or no longer) valid; the message says why, for the 401."""


@dataclass(frozen=True)
class TokenClaims:
    owner: str
    key_mark: str  # mark of the API key the token was issued for (`TokenSigner.key_mark`)
    expires_at: float


class TokenSigner:
    """Issues and checks the server's JWTs. The key file is checked on every use (one stat): a rotation
    by the CLI takes effect at once, without a restart."""

    def __init__(self, data_dir: Path, lifetime_s: int, clock=time.time):
        self.key_path = Path(data_dir) / TOKEN_KEY_FILE
        self.lifetime_s = lifetime_s
        self.org_id = organization_id(Path(data_dir))
        self.clock = clock  # injectable: a test steps past a token's expiry
        self._lock = threading.Lock()
        self._key = load_or_create_secret(self.key_path)
        self._stamp = self._file_stamp()
        # Tokens whose signature passed, with the key that signed them: the SDK sends the same token on
        # every request, and decoding it (base64, JSON, an HMAC) was ~10 % of the event loop's busy time
        # under one stepping client. A hit still checks the key (a rotation refuses it at once) and
        # the expiry; a refused token is never kept.
        self._verified: OrderedDict[str, tuple[bytes, TokenClaims]] = OrderedDict()

    def _file_stamp(self) -> tuple[int, int, int] | None:
        try:
            st = os.stat(self.key_path)
        except FileNotFoundError:
            return None
        return st.st_ino, st.st_size, st.st_mtime_ns

    def _current_key(self) -> bytes:
        stamp = self._file_stamp()
        with self._lock:
            if stamp != self._stamp:
                # Rotated (or removed: a new key is made, so that no old token passes).
                self._key = read_secret(self.key_path) or load_or_create_secret(self.key_path)
                self._stamp = self._file_stamp()
            return self._key

    def key_marks(self, key_digests: list[bytes]) -> list[str]:
        """What a token carries of the API key it was issued for, for each key (by its SHA-256 digest)."""
        key = self._current_key()
        return [hmac.new(key, b"api-key\n" + d, hashlib.sha256).hexdigest()[:32] for d in key_digests]

    def issue(self, owner: str, key_mark: str) -> str:
        now = int(self.clock())
        claims = {"iss": ISSUER, "sub": user_urn(owner), "org_id": self.org_id, "iat": now,
                  "exp": now + self.lifetime_s, "key": key_mark}
        return jwt.encode(claims, self._current_key(), algorithm=ALGORITHM)

    def verify(self, token: str) -> TokenClaims:
        """The token's claims; `InvalidToken` saying why it is refused (expired, not signed with this
        server's current key, or malformed)."""
        key = self._current_key()
        with self._lock:
            known = self._verified.get(token)
            if known is not None:
                self._verified.move_to_end(token)
        if known is not None and known[0] == key:
            if known[1].expires_at <= self.clock():
                raise InvalidToken(_EXPIRED)
            return known[1]
        claims = self._decode(token, key)
        with self._lock:
            self._verified[token] = (key, claims)
            while len(self._verified) > VERIFIED_TOKENS_KEPT:
                self._verified.popitem(last=False)
        return claims

    def _decode(self, token: str, key: bytes) -> TokenClaims:
        try:
            claims = jwt.decode(token, key, algorithms=[ALGORITHM], issuer=ISSUER,
                                options={"require": ["exp", "iat", "sub", "key"]})
        except jwt.ExpiredSignatureError:
            raise InvalidToken(_EXPIRED) from None
        except jwt.InvalidSignatureError:
            raise InvalidToken("invalid token: it is not signed with this server's current key (forged, or "
                               "issued before the key was rotated); exchange the API key for a new one") from None
        except jwt.InvalidTokenError as e:
            raise InvalidToken(f"invalid token: {e}") from None
        owner = owner_of_urn(str(claims["sub"]))
        if owner is None or claims.get("org_id") != self.org_id:
            raise InvalidToken("invalid token: it names no user of this server")
        return TokenClaims(owner=owner, key_mark=str(claims["key"]), expires_at=float(claims["exp"]))
