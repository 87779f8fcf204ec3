"""`HotRoutes`: the three requests of every training step answered without FastAPI's routing.

A pipelining SDK client posts `forward_backward` and `optim_step` and long-polls
`retrieve_future` for each on every step. FastAPI spends ~2 ms of the event loop on each of them
in its router, dependency solving, response serialisation and exception middleware (py-spy,
issue 42), time the device loop then waits for the GIL. This ASGI middleware sits inside the
access log and the body limit (app.py) and serves those three routes itself: the same route
functions (`submit_forward_backward`, `submit_optim_step`, `answer_future` in training.py), the
same pydantic request models, the same error handlers.

What it does not answer the same way it does not answer at all: a body that is not JSON of the
route's model goes to FastAPI as it came (its 422, with the refused seq_id closed), so every
refusal keeps its one source. Errors raised once the route runs are turned into responses by the
app's own exception handlers; anything else propagates to the outermost handler (a 500), as from
a FastAPI route.
"""

from __future__ import annotations

import json
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any

from fastapi.concurrency import run_in_threadpool
from pydantic import BaseModel, ValidationError
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from . import training
from .deps import require_owner
from .schemas import OptimStepRequest, RetrieveFutureRequest


class NotOurs(Exception):
    """The body is not what the route takes: FastAPI answers the request (its 422)."""


def _json_model(model: type[BaseModel]) -> Callable[[Request, bytes], BaseModel]:
    def parse(request: Request, body: bytes) -> BaseModel:
        if "json" not in request.headers.get("content-type", ""):
            raise NotOurs
        try:
            return model.model_validate(json.loads(body))
        except (ValueError, ValidationError, RecursionError):  # JSONDecodeError, UnicodeDecodeError: ValueErrors
            raise NotOurs from None

    return parse


async def _forward_backward(request: Request, owner: str, body: bytes):
    training.check_protobuf(request.headers.get("content-type", ""))
    return await training.submit_forward_backward(request.app.state.training, owner, body,
                                                  request.headers.get("content-encoding"))


async def _optim_step(request: Request, owner: str, body: OptimStepRequest):
    return await run_in_threadpool(training.submit_optim_step, request.app.state.training, owner, body)


async def _retrieve_future(request: Request, owner: str, body: RetrieveFutureRequest):
    return await training.answer_future(request.app.state.server, request.app.state.access, owner, body)


@dataclass(frozen=True)
class HotRoute:
    """parse(request, body) -> the route's input, or NotOurs, before the key is checked (FastAPI's
    order: a body it refuses is refused whatever the key); run(request, owner, input) -> its answer."""

    parse: Callable[[Request, bytes], Any]
    run: Callable[[Request, str, Any], Awaitable[Response | dict]]


HOT_ROUTES: dict[str, HotRoute] = {
    "/api/v1/forward_backward": HotRoute(lambda request, body: body, _forward_backward),  # no body model
    "/api/v1/optim_step": HotRoute(_json_model(OptimStepRequest), _optim_step),
    "/api/v1/retrieve_future": HotRoute(_json_model(RetrieveFutureRequest), _retrieve_future),
}
# The FastAPI route of each path: put in the scope as routing would (the access log names it).
ROUTES = {route.path: route for route in training.router.routes if getattr(route, "path", None) in HOT_ROUTES}


class HotRoutes:
    def __init__(self, app: ASGIApp):
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        hot = HOT_ROUTES.get(scope["path"]) if scope["type"] == "http" and scope["method"] == "POST" else None
        if hot is None:
            return await self.app(scope, receive, send)
        request = Request(scope, receive)
        scope["route"] = ROUTES[scope["path"]]  # FastAPI's routing sets it again for a request handed on
        try:
            body = await request.body()  # bounded by the body limit outside (limits.py): a 413 is raised
            parsed = hot.parse(request, body)
            answer = await hot.run(request, await _owner(request), parsed)
        except NotOurs:  # handed on outside the try: what FastAPI raises is not answered here a second time
            return await self.app(scope, _replay(body, receive), send)
        except Exception as exc:
            handle = _handler_of(scope, exc)
            if handle is None:
                raise
            answer = await handle(request, exc)
        if not isinstance(answer, Response):
            answer = JSONResponse(answer)
        await answer(scope, receive, send)


async def _owner(request: Request) -> str:
    return await require_owner(request, request.headers.get("x-api-key"))


def _handler_of(scope: Scope, exc: Exception):
    """The app's handler for `exc` (by its class's MRO, as Starlette's exception middleware looks it
    up); None for one only the outermost 500 handler takes."""
    handlers = scope["app"].exception_handlers
    for cls in type(exc).__mro__:
        if cls is Exception:
            return None
        if cls in handlers:
            return handlers[cls]
    return None


def _replay(body: bytes, receive: Receive) -> Receive:
    """A receive that gives the body already read, then whatever the client sends next (a disconnect)."""
    sent = False

    async def replayed() -> Message:
        nonlocal sent
        if not sent:
            sent = True
            return {"type": "http.request", "body": body, "more_body": False}
        return await receive()

    return replayed
