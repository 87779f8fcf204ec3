"""The API key routes of `tinker auth login` and `tinker auth logout` (the SDK's `tinker/cli/auth_api.py`).

Both take the key itself in `X-API-Key` (not a token: the CLI calls them before it stores the key):

- `GET /api/v1/auth/apikey/me`: what the key is (login checks a pasted key with it, then stores it);
- `DELETE /api/v1/auth/apikey/me`: delete the key (logout calls it for a key the CLI made, which
  SDK 0.38 never does, but credentials written by an older CLI may hold one). A key of the keys file
  or of `$HOSTED_TINKER_API_KEYS` is the operator's: a 403 says so and where it lives. In dev mode the
  key is refused from then on.
"""

from __future__ import annotations

from fastapi import APIRouter, Depends, Header, HTTPException, Request

from ..accounts.auth import DEV_MODE, InvalidCredential, KeyInfo
from ..accounts.tokens import user_urn
from ..server.core import Server
from .deps import credential, get_server

router = APIRouter()

_NOTES = {DEV_MODE: "dev mode: this server accepts any tml- key; deleting this one refuses it from then on"}
_OPERATORS = "managed by the server's operator ({}): only they can revoke it"


def _key_json(server: Server, info: KeyInfo) -> dict:
    """The SDK's `SelfApiKeyResponse`: no e-mail here, so the user's URN (as `whoami` gives it) in its place."""
    return {"key_id": info.key_id, "name": f"{info.owner} ({info.source})",
            "note": _NOTES.get(info.source, _OPERATORS.format(info.source)),
            "details": {"org_details": {"name": server.auth.tokens.org_id},
                        "user_details": {"email": user_urn(info.owner)}}}


def _refused(e: InvalidCredential) -> HTTPException:
    return HTTPException(401, str(e))


@router.get("/api/v1/auth/apikey/me")
def my_api_key(request: Request, x_api_key: str | None = Header(default=None), server: Server = Depends(get_server)):
    try:
        return _key_json(server, server.auth.key_info(credential(request, x_api_key)))
    except InvalidCredential as e:
        raise _refused(e) from None


@router.delete("/api/v1/auth/apikey/me")
def delete_my_api_key(request: Request, x_api_key: str | None = Header(default=None),
                      server: Server = Depends(get_server)):
    """403 for a key the operator manages (keys file, environment); in dev mode, the key is refused from now on."""
    try:
        info = server.auth.delete_key(credential(request, x_api_key))
    except InvalidCredential as e:
        raise _refused(e) from None
    return {"key_id": info.key_id, "deleted": True}
