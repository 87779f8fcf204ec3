"""Request dependencies shared by the routers: the server, the caller's identity, its access.

The dependencies a route declares are `async`: each does no blocking I/O (attribute reads, the key
check in memory), and FastAPI runs a plain `def` dependency in the thread pool, one trip there and
back per dependency per request."""

from __future__ import annotations

from fastapi import Header, HTTPException, Request

from ..accounts.access import Access
from ..accounts.auth import InvalidCredential
from ..server.core import Server
from ..services.sampling import SamplingRequests
from ..services.training import TrainingRequests


def server_of(request: Request) -> Server:
    """The server, for code that is not a dependency (the dashboard's)."""
    return request.app.state.server


async def get_server(request: Request) -> Server:
    return request.app.state.server


async def get_access(request: Request) -> Access:
    return request.app.state.access


async def get_training(request: Request) -> TrainingRequests:
    return request.app.state.training


async def get_sampling(request: Request) -> SamplingRequests:
    return request.app.state.sampling


def credential(request: Request, x_api_key: str | None = None) -> str | None:
    """The caller's credential: the X-API-Key header (an API key or a JWT), or `Authorization: Bearer`."""
    if x_api_key is None:
        auth = request.headers.get("authorization", "")
        if auth.lower().startswith("bearer "):
            return auth[7:].strip()
    return x_api_key


async def require_owner(request: Request, x_api_key: str | None = Header(default=None)) -> str:
    """The caller's owner id. A refused JWT's 401 says `invalid_token` (RFC 6750): the SDK then
    exchanges its API key for a new token and sends the request once more."""
    try:
        return request.app.state.server.auth.owner(credential(request, x_api_key))
    except InvalidCredential as e:
        headers = {"WWW-Authenticate": 'Bearer error="invalid_token"'} if e.token else None
        raise HTTPException(401, str(e), headers=headers) from None


def accessible_scope(access_scope: str = "owned") -> bool:
    """The REST `access_scope` parameter: True for 'accessible' (others' published work too)."""
    if access_scope not in ("owned", "accessible"):
        raise HTTPException(400, f"invalid access_scope {access_scope!r}: expected 'owned' or 'accessible'")
    return access_scope == "accessible"
