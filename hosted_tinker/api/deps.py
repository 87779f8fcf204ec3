"""Request dependencies shared by the routers: the server, the caller's identity, its access."""

from __future__ import annotations

from fastapi import Header, HTTPException, Request

from ..access import Access
from ..server import Server
from ..services.sampling import SamplingRequests
from ..services.training import TrainingRequests


def get_server(request: Request) -> Server:
    return request.app.state.server


def get_access(request: Request) -> Access:
    return request.app.state.access


def get_training(request: Request) -> TrainingRequests:
    return request.app.state.training


def get_sampling(request: Request) -> SamplingRequests:
    return request.app.state.sampling


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


def accessible_scope(access_scope: str = "owned") -> bool:
    """The REST `access_scope` parameter: True for 'accessible' (others' published work too)."""
    if access_scope not in ("owned", "accessible"):
        raise HTTPException(400, f"invalid access_scope {access_scope!r}: expected 'owned' or 'accessible'")
    return access_scope == "accessible"
