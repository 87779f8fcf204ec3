"""Request dependencies shared by the routers: the server object and the caller's identity."""

from __future__ import annotations

from fastapi import Header, HTTPException, Request

from ..server import Server


def get_server(request: Request) -> Server:
    return request.app.state.server


def require_owner(request: Request, x_api_key: str | None = Header(default=None)) -> str:
    """The caller's owner id, from the X-API-Key header (or `Authorization: Bearer`)."""
    key = x_api_key
    if key is None:
        auth = request.headers.get("authorization", "")
        if auth.lower().startswith("bearer "):
            key = auth[7:].strip()
    if not key:
        raise HTTPException(401, "missing API key: send it in the X-API-Key header")
    if not key.startswith("tml-"):
        raise HTTPException(401, "invalid API key: Tinker keys start with 'tml-'")
    owner = request.app.state.server.keyring.owner(key)
    if owner is None:
        raise HTTPException(401, "invalid API key")
    return owner
