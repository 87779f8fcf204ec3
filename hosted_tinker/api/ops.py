"""Operator endpoints in vLLM's conventions, and `/metrics`.

* `GET /health`: 200 with an empty body once the server is up (as `vllm serve`), 503 if a
  device loop thread has died; `/api/v1/healthz` (the SDK's) stays as it is.
* `GET /version`: `{"version": ...}` (as `vllm serve`).
* `GET /metrics`: Prometheus text (api/metrics.py).
"""

from __future__ import annotations

from fastapi import APIRouter, Depends, HTTPException, Request
from fastapi.responses import Response
from prometheus_client import CONTENT_TYPE_LATEST

from .. import __version__
from ..server.core import Server
from .deps import get_server

router = APIRouter()


@router.get("/health")
def health(server: Server = Depends(get_server)):
    if not all(model.loop.is_alive() for model in server.models):
        raise HTTPException(503, "a device loop thread has stopped; see the server log")
    return Response(status_code=200)


@router.get("/version")
def version():
    return {"version": __version__}


@router.get("/metrics")
def metrics(request: Request, server: Server = Depends(get_server)):
    return Response(request.app.state.metrics.render(), media_type=CONTENT_TYPE_LATEST)
