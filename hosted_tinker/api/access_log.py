"""One access-log line per request, with a request id and, for a refusal, its reason.

A plain ASGI middleware (not BaseHTTPMiddleware): it watches the response go by without buffering
it, so streamed answers (SSE, archives) flow as before. For an error status it keeps the first few
KiB of the body to log the reason the client was given: `detail` of our errors, `error.message` of
the OpenAI API's.

    request_id=3f9a... method=POST route=/api/v1/asample status=400 ms=18.0 reason="num_samples must be ..."

The request id is the client's `X-Request-ID` or a new one, echoed in the response's `X-Request-ID`.
With `--log-format json` the same fields are keys of the JSON record.
"""

from __future__ import annotations

import json
import logging
import time
import uuid

from . import hub
from .metrics import Metrics

log = logging.getLogger("hosted_tinker.accounts.access")
# Polled or background routes: logged only at debug level unless they fail.
QUIET_ROUTES = {"/api/v1/retrieve_future", "/api/v1/session_heartbeat", "/api/v1/telemetry", "/api/v1/healthz",
                "/health", "/metrics", "/dashboard/api/cycles"}
# The hub's routes: huggingface_hub probes for optional files, so their 404s are expected answers.
PROBED_ROUTES = {route.path for route in hub.router.routes}
_KEPT_BODY = 4096


def refusal_reason(body: bytes, content_type: str) -> str | None:
    """The message an error body gives the client: `detail` of our JSON errors, `error.message` of the
    OpenAI API's, or a plain-text body; None for anything else (an HTML page)."""
    if content_type.startswith("text/plain"):
        return body[:500].decode("utf-8", "replace") or None
    if not content_type.startswith("application/json"):
        return None
    try:
        answer = json.loads(body)
    except ValueError:
        return None
    if not isinstance(answer, dict):
        return None
    reason = answer.get("detail")
    if reason is None and isinstance(answer.get("error"), dict):
        reason = answer["error"].get("message")
    return None if reason is None else str(reason)[:500]


class AccessLog:
    def __init__(self, app, metrics: Metrics):
        self.app = app
        self.metrics = metrics

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        start = time.perf_counter()
        given = dict(scope["headers"]).get(b"x-request-id", b"").decode("latin-1")[:128]
        request_id = given or uuid.uuid4().hex[:16]
        status = 500
        content_type = ""
        error_body = bytearray()
        failure: str | None = None
        logged = False

        def write_log() -> None:
            nonlocal logged
            if logged:
                return
            logged = True
            elapsed = time.perf_counter() - start
            route = getattr(scope.get("route"), "path", "unmatched")
            self.metrics.observe_request(route, status, elapsed)
            reason = failure or (refusal_reason(bytes(error_body), content_type) if status >= 400 else None)
            quiet = (route in QUIET_ROUTES and status < 400) or (route in PROBED_ROUTES and status < 500)
            fields = {"request_id": request_id, "method": scope["method"], "route": route, "status": status,
                      "ms": round(elapsed * 1000, 1)}
            extra = ""
            if route == "unmatched":  # the path only here: matched routes' paths may hold ids, names
                fields["path"] = scope["path"][:200]
                extra += f" path={json.dumps(fields['path'])}"
            if reason is not None:
                fields["reason"] = reason
                extra += f" reason={json.dumps(reason)}"
            log.log(logging.DEBUG if quiet else logging.INFO, "request_id=%s method=%s route=%s status=%d ms=%.1f%s",
                    request_id, scope["method"], route, status, elapsed * 1000, extra, extra=fields)

        async def watch(message):
            nonlocal status, content_type
            if message["type"] == "http.response.start":
                status = message["status"]
                content_type = dict(message.get("headers", ())).get(b"content-type", b"").decode("latin-1")
                message["headers"] = [*message.get("headers", ()), (b"x-request-id", request_id.encode("latin-1"))]
            elif message["type"] == "http.response.body":
                if status >= 400 and len(error_body) < _KEPT_BODY:
                    error_body.extend(message.get("body", b"")[:_KEPT_BODY - len(error_body)])
                if not message.get("more_body", False):
                    write_log()  # before the last byte leaves: a client that has its answer finds the line
            await send(message)

        try:
            await self.app(scope, receive, watch)
        except Exception as e:  # answered as a 500 by the outermost handler, which logs the traceback
            failure = f"internal error: {type(e).__name__}"
            raise
        finally:
            write_log()
