"""The FastAPI application: access log, error bodies, metrics, and the routers."""

from __future__ import annotations

import asyncio
import logging
from contextlib import asynccontextmanager

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from ..accounts.access import Access
from ..checkpoints.paths import InvalidPath
from ..config.settings import ServerConfig
from ..errors import Busy, Forbidden, NotFound, QueryTooSlow, UserError
from ..server.core import Server
from ..services.images import ImagePixelBudget
from ..services.sampling import SamplingRequests
from ..services.training import TrainingRequests
from ..server.startup import base_url, summary_lines
from . import admin, api_keys, dashboard, hub, openai_compat, ops, rest, sampling, service, sessions, training
from .access_log import AccessLog
from .hot_routes import HotRoutes
from .limits import BodyLimit
from .metrics import Metrics
from .openai_compat import OpenAIErrorRoute, openai_error

log = logging.getLogger(__name__)

# The status code of each domain error (errors.py): the services raise them, only this module speaks HTTP.
STATUS_CODES: dict[type[UserError], int] = {NotFound: 404, Forbidden: 403, Busy: 429, QueryTooSlow: 400, UserError: 400}


def http_error_of(exc: UserError) -> StarletteHTTPException:
    """A domain error as HTTP: its class's status code (the nearest listed ancestor's), its message as the
    detail, and for `Busy` the Retry-After the SDK waits before it retries."""
    status = next(STATUS_CODES[cls] for cls in type(exc).__mro__ if cls in STATUS_CODES)
    headers = {"Retry-After": str(exc.retry_after_s)} if isinstance(exc, Busy) else None
    return StarletteHTTPException(status, str(exc), headers=headers)


def error_response(request: Request, status_code: int, detail, headers: dict | None = None) -> JSONResponse:
    """`{"detail": ...}`, and on an OpenAI route the `error` object its clients read too."""
    body = {"detail": detail}
    if isinstance(request.scope.get("route"), OpenAIErrorRoute):
        body = {"detail": str(detail), "error": openai_error(str(detail), status_code)}
    return JSONResponse(body, status_code=status_code, headers=headers)


def create_app(config: ServerConfig, server: Server | None = None, metrics: Metrics | None = None) -> FastAPI:
    """Build the app. `server` may be passed in (built with `metrics` as its observer); otherwise it
    is built at start-up."""
    app = FastAPI(title="hosted-tinker", version="0.1.0", lifespan=_lifespan(config, server))
    app.state.metrics = metrics or Metrics()
    app.add_middleware(HotRoutes)  # the training step's requests, served without FastAPI's routing
    app.add_middleware(BodyLimit, config=config)  # inside the access log, which sees its 413s too
    app.add_middleware(AccessLog, metrics=app.state.metrics)
    app.add_exception_handler(StarletteHTTPException, _http_error)
    app.add_exception_handler(UserError, _domain_error)
    app.add_exception_handler(InvalidPath, _invalid_path)
    app.add_exception_handler(RequestValidationError, _validation_error)
    app.add_exception_handler(Exception, _internal_error)
    for module in ROUTES:
        app.include_router(module.router)
    return app


# In the order they match: sessions' routes before service's /api/v1/sessions/{session_id}, and the
# hub's last (its routes match any "<org>/<name>/resolve/..." path).
ROUTES = (sessions, service, api_keys, training, sampling, openai_compat, rest, admin, ops, dashboard, hub)


def _lifespan(config: ServerConfig, server: Server | None):
    """Start-up and shut-down: the `Server` and what the routes read from `app.state`."""

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        srv = server or Server(config, observer=app.state.metrics)
        srv.futures.bind_loop(asyncio.get_running_loop())
        app.state.metrics.bind(srv)
        srv.start()
        app.state.server = srv
        app.state.access = Access(srv.store, srv.models.has_training_model, admins=srv.config.admin_users,
                                  on_read=srv.audit_read)
        # one per key, training and sampling
        images = ImagePixelBudget(srv.config.max_image_pixels_per_key, srv.image_decodes)
        app.state.training = TrainingRequests(srv, app.state.access, images)
        app.state.sampling = SamplingRequests(srv, app.state.access, images)
        pruner = asyncio.create_task(_prune_forever(srv))
        for line in summary_lines(srv, config, base_url(config.host, config.port)):
            log.info("%s", line)
        try:
            yield
        finally:
            pruner.cancel()
            srv.stop()

    return lifespan


async def _http_error(request: Request, exc: StarletteHTTPException):
    # Always a non-empty JSON body: the SDK treats an empty 400 as a proxy glitch and retries.
    detail = exc.detail or "error"
    if isinstance(exc.__cause__, RecursionError):  # FastAPI's "error parsing the body", said precisely
        detail = "the request body's JSON is nested too deeply to parse"
    return error_response(request, exc.status_code, detail, getattr(exc, "headers", None))


async def _domain_error(request: Request, exc: UserError):  # a refusal of the services (errors.py)
    return await _http_error(request, http_error_of(exc))


async def _invalid_path(request: Request, exc: InvalidPath):  # a malformed tinker:// path, name or run id
    return error_response(request, 400, str(exc))


async def _validation_error(request: Request, exc: RequestValidationError):
    await training.close_refused_seq_id(request, exc.body)
    problems = "; ".join(
        f"{'.'.join(str(p) for p in e['loc'] if p != 'body') or 'body'}: {e['msg']}" for e in exc.errors())
    return JSONResponse({"detail": f"invalid request: {problems}"}, status_code=422)


async def _internal_error(request: Request, exc: Exception):
    log.exception("unhandled error on %s", request.url.path)
    return JSONResponse({"detail": f"internal server error: {type(exc).__name__}"}, status_code=500)


async def _prune_forever(srv: Server) -> None:
    """The retention sweep (retention.py) at start-up and every --retention-sweep-s, off the event loop."""
    while True:
        try:
            await asyncio.to_thread(srv.retention.sweep)
        except Exception:  # a disk error must not end the sweeping for good
            log.exception("the retention sweep failed")
        await asyncio.sleep(srv.config.retention_sweep_s)
