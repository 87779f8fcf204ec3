"""The FastAPI application: auth, error bodies, metrics, and the routers."""

from __future__ import annotations

import asyncio
import logging
import time
import uuid
from contextlib import asynccontextmanager

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from ..checkpoints.paths import InvalidPath
from ..config import ServerConfig
from ..server import Server
from . import openai_compat, rest, sampling, service, training
from .metrics import Metrics

log = logging.getLogger(__name__)
access = logging.getLogger("hosted_tinker.access")
# Polled or background routes: logged only at debug level unless they fail.
QUIET_ROUTES = {"/api/v1/retrieve_future", "/api/v1/session_heartbeat", "/api/v1/telemetry", "/api/v1/healthz",
                "/metrics"}


def create_app(config: ServerConfig, server: Server | None = None) -> FastAPI:
    """Build the app. `server` may be passed in (tests); otherwise it is built at start-up."""

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        srv = server or Server(config)
        srv.futures.bind_loop(asyncio.get_running_loop())
        srv.start()
        app.state.server = srv
        pruner = asyncio.create_task(_prune_forever(srv))
        log.info("hosted-tinker serving %s on http://%s:%d", config.base_model, config.host, config.port)
        try:
            yield
        finally:
            pruner.cancel()
            srv.stop()

    app = FastAPI(title="hosted-tinker", version="0.1.0", lifespan=lifespan)
    app.state.metrics = Metrics()

    @app.middleware("http")
    async def access_log(request: Request, call_next):
        """One structured line per request, with a request id echoed as X-Request-ID."""
        start = time.perf_counter()
        request_id = request.headers.get("x-request-id") or uuid.uuid4().hex[:16]
        response = await call_next(request)
        elapsed = time.perf_counter() - start
        path = getattr(request.scope.get("route"), "path", "unmatched")
        app.state.metrics.observe_request(path, response.status_code, elapsed)
        response.headers["X-Request-ID"] = request_id
        level = logging.DEBUG if path in QUIET_ROUTES and response.status_code < 400 else logging.INFO
        access.log(level, "request_id=%s method=%s route=%s status=%d ms=%.1f", request_id, request.method,
                   path, response.status_code, elapsed * 1000)
        return response

    @app.exception_handler(StarletteHTTPException)
    async def http_error(request: Request, exc: StarletteHTTPException):
        # Always a non-empty JSON body: the SDK treats an empty 400 as a proxy glitch and retries.
        return JSONResponse({"detail": exc.detail or "error"}, status_code=exc.status_code,
                            headers=getattr(exc, "headers", None))

    @app.exception_handler(InvalidPath)
    async def invalid_path(request: Request, exc: InvalidPath):  # a malformed tinker:// path, name or run id
        return JSONResponse({"detail": str(exc)}, status_code=400)

    @app.exception_handler(RequestValidationError)
    async def validation_error(request: Request, exc: RequestValidationError):
        problems = "; ".join(
            f"{'.'.join(str(p) for p in e['loc'] if p != 'body') or 'body'}: {e['msg']}" for e in exc.errors())
        return JSONResponse({"detail": f"invalid request: {problems}"}, status_code=422)

    @app.exception_handler(Exception)
    async def internal_error(request: Request, exc: Exception):
        log.exception("unhandled error on %s", request.url.path)
        return JSONResponse({"detail": f"internal server error: {type(exc).__name__}"}, status_code=500)

    app.include_router(service.router)
    app.include_router(training.router)
    app.include_router(sampling.router)
    app.include_router(openai_compat.router)
    app.include_router(rest.router)
    return app


async def _prune_forever(srv: Server) -> None:
    while True:
        await asyncio.sleep(60)
        srv.futures.prune()
        srv.store.prune_futures(time.time() - 24 * 3600)
