"""Request bodies, bounded: every route has a size limit, enforced while the body is read, and JSON
that cannot be parsed (malformed, or nested deeper than the parser's recursion allows) is a 400.

`BodyLimit` is an ASGI middleware in front of every route: a `Content-Length` above the route's
limit is refused before a byte is read, and a body sent without one (chunked) is counted as it
arrives and refused once it passes the limit. Binary bodies (protobuf `forward_backward`, checkpoint
tars) may be as large as `max_request_bytes`; every other body is JSON, up to
`max_json_request_bytes`.
"""

from __future__ import annotations

import json
from typing import Any

from fastapi import HTTPException
from fastapi.responses import JSONResponse
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from ..config.settings import ServerConfig

BINARY_ROUTES = frozenset({"/api/v1/forward_backward", "/api/v1/checkpoints/import"})
# Stored JSON a user sends (user metadata, telemetry) may nest this deep: far more than any real
# payload, far less than the depth at which Python's JSON encoder or `redact` would overflow.
MAX_STORED_JSON_DEPTH = 32


def _too_large(size: str, limit: int, setting: str) -> str:
    return f"request body of {size} is above this server's limit of {limit} bytes ({setting})"


class BodyLimit:
    def __init__(self, app: ASGIApp, config: ServerConfig):
        self.app = app
        self.config = config

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        if scope["path"] in BINARY_ROUTES:
            limit, setting = self.config.max_request_bytes, "max_request_bytes"
        else:
            limit, setting = self.config.max_json_request_bytes, "max_json_request_bytes"
        length = dict(scope["headers"]).get(b"content-length", b"")
        if length.isdigit() and int(length) > limit:
            response = JSONResponse({"detail": _too_large(f"{int(length)} bytes", limit, setting)}, status_code=413)
            return await response(scope, receive, send)
        received = 0

        async def bounded_receive() -> Message:
            nonlocal received
            message = await receive()
            if message["type"] == "http.request":
                received += len(message.get("body", b""))
                if received > limit:  # raised inside the route that reads: its error handler answers
                    raise HTTPException(413, _too_large(f"more than {limit} bytes", limit, setting))
            return message

        await self.app(scope, bounded_receive, send)


def parse_json(raw: bytes) -> Any:
    """A JSON body, or a 400 saying why it is not one."""
    try:
        return json.loads(raw)
    except (json.JSONDecodeError, UnicodeDecodeError):
        raise HTTPException(400, "the request body is not valid JSON") from None
    except RecursionError:
        raise HTTPException(400, "the request body's JSON is nested too deeply to parse") from None


def check_stored_json(value: Any, what: str, max_bytes: int) -> Any:
    """`value`, checked before it is stored: ValueError if it nests too deep or is too large."""
    stack = [(value, 1)]
    while stack:
        item, depth = stack.pop()
        if isinstance(item, (dict, list)):
            if depth > MAX_STORED_JSON_DEPTH:
                raise ValueError(f"{what} nests deeper than {MAX_STORED_JSON_DEPTH} levels")
            stack.extend((v, depth + 1) for v in (item.values() if isinstance(item, dict) else item))
    try:
        size = len(json.dumps(value, allow_nan=False).encode())
    except ValueError:  # Python reads the literal NaN; JSON readers (and our responses) refuse it
        raise ValueError(f"{what} holds NaN or Infinity, which JSON cannot store") from None
    if size > max_bytes:
        raise ValueError(f"{what} is {size} bytes as JSON; the limit is {max_bytes}")
    return value
