"""Request dependencies shared by the routers: the server object and the caller's identity."""

from __future__ import annotations

from fastapi import Header, HTTPException, Request

from ..server import Server, owner_of


def get_server(request: Request) -> Server:
    return request.app.state.server


def require_owner(x_api_key: str | None = Header(default=None)) -> str:
    """The caller's owner id. Keys must look like Tinker keys (`tml-...`)."""
    if not x_api_key:
        raise HTTPException(401, "missing X-API-Key header")
    if not x_api_key.startswith("tml-"):
        raise HTTPException(401, "invalid API key: Tinker keys start with 'tml-'")
    return owner_of(x_api_key)
