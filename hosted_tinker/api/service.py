"""Service endpoints: client config, sessions, telemetry, health, capabilities."""

from __future__ import annotations

import time
import uuid
from typing import Any

from fastapi import APIRouter, Body, Depends, Header, HTTPException, Query, Request
from pydantic import BaseModel

from ..accounts.access import Access
from ..accounts.auth import InvalidCredential, redact
from ..server.core import Server
from .deps import accessible_scope, credential, get_access, get_server, require_owner
from .limits import check_stored_json
from .schemas import (
    INT64_MAX, PAGE_MAX_ROWS, ClientConfigRequest, CreateSessionRequest, FinishSessionRequest, SessionHeartbeatRequest,
    ShortText, str_dict,
)

router = APIRouter()
# The SDK sends a batch every few seconds, a few KiB each; this leaves a wide margin.
TELEMETRY_MAX_BYTES = 1 << 20


@router.post("/api/v1/client/config")
def client_config(body: ClientConfigRequest, server: Server = Depends(get_server)):
    return {
        # The SDK exchanges its API key for a JWT (/api/v1/auth/token) and sends that; whoami reads it.
        "pjwt_auth_enabled": True,
        # Chunks may arrive concurrently and out of order: the scheduler orders them by seq_id.
        "parallel_fwdbwd_chunks": True,
        "fwdbwd_max_chunk_len": server.config.max_datums_per_request,
        "proto_compress_fwdbwd": server.config.compress_fwdbwd,
        "sample_use_retrieve_futures": False,
        "custom_loss_server_side": False,
    }


@router.post("/api/v1/auth/token")
def auth_token(request: Request, x_api_key: str | None = Header(default=None), server: Server = Depends(get_server)):
    """The SDK's token exchange: a short-lived JWT for the API key (or a still-valid JWT) it sends."""
    try:
        return {"jwt": server.auth.issue_token(credential(request, x_api_key))}
    except InvalidCredential as e:
        raise HTTPException(401, str(e)) from None


@router.post("/api/v1/client/dynamic_config")
def dynamic_config(body: ClientConfigRequest):
    return {"refresh_interval_sec": 300}


@router.get("/api/v1/healthz")
def healthz():
    return {"status": "ok"}


@router.get("/api/v1/get_server_capabilities")
def capabilities(server: Server = Depends(get_server)):
    """Every served base model: each is trained and sampled by its own runtime."""
    return {"supported_models": [{
        "model_name": served.name,
        "max_context_length": served.runtime.max_context,
        "trainable": True,
        "sampleable": True,
    } for served in server.models]}


@router.post("/api/v1/create_session")
def create_session(body: CreateSessionRequest, owner: str = Depends(require_owner),
                   x_idempotency_key: str | None = Header(default=None),
                   server: Server = Depends(get_server)):
    # The SDK's transport layer retries create_session with the same X-Idempotency-Key: the
    # store gives every retry, concurrent ones included, the session the first one made.
    session_id = server.store.sessions.create(f"sess-{uuid.uuid4().hex[:16]}", owner, body.tags, body.user_metadata,
                                              body.display_name, body.project_id,
                                              idempotency_key=x_idempotency_key or None)
    return {"type": "create_session", "session_id": session_id}


@router.post("/api/v1/session_heartbeat")
def heartbeat(body: SessionHeartbeatRequest, owner: str = Depends(require_owner),
              server: Server = Depends(get_server), access: Access = Depends(get_access)):
    row = access.session(owner, body.session_id)
    if row.status != "active":
        raise HTTPException(410, f"session {body.session_id!r} has finished")
    server.store.sessions.touch(body.session_id)
    return {"type": "session_heartbeat"}


@router.post("/api/v1/sessions/{session_id}/finish")
def finish_session(session_id: str, body: FinishSessionRequest, owner: str = Depends(require_owner),
                   server: Server = Depends(get_server), access: Access = Depends(get_access)):
    access.session(owner, session_id)
    server.store.sessions.finish(session_id, body.reason.type if body.reason else "success")
    return {}


# -- REST: sessions (RestClient.list_sessions / get_session) -----------------------------------------

@router.get("/api/v1/sessions")
def list_sessions(limit: int = Query(20, ge=0, le=PAGE_MAX_ROWS), offset: int = Query(0, ge=0, le=INT64_MAX),
                  accessible: bool = Depends(accessible_scope), owner: str = Depends(require_owner),
                  server: Server = Depends(get_server)):
    """The caller's sessions, newest first (sessions are never shared, whatever the scope)."""
    ids, _ = server.store.sessions.page(owner, limit, offset)
    return {"sessions": ids}


@router.get("/api/v1/sessions/{session_id}")
def get_session(session_id: str, accessible: bool = Depends(accessible_scope), owner: str = Depends(require_owner),
                server: Server = Depends(get_server), access: Access = Depends(get_access)):
    row = access.session(owner, session_id)
    return {"training_run_ids": server.store.runs.ids_in_session(session_id),
            "sampler_ids": server.store.sampling_sessions.ids_in_session(session_id),
            "user_metadata": str_dict(row.user_metadata), "display_name": row.display_name}


class ProjectBody(BaseModel):
    project_id: ShortText | None = None


@router.put("/api/v1/sessions/{session_id}/project")
def assign_session_project(session_id: str, body: ProjectBody, owner: str = Depends(require_owner),
                           server: Server = Depends(get_server), access: Access = Depends(get_access)):
    row = access.session(owner, session_id)
    server.store.sessions.set_project(session_id, body.project_id)
    server.accounting.audit("project_session_assign", owner, session_id=session_id, from_project=row.project_id,
                            to_project=body.project_id)
    return {"session_id": session_id, "project_id": body.project_id}


@router.post("/api/v1/telemetry")
def telemetry(batch: dict[str, Any] = Body(), owner: str = Depends(require_owner),
              server: Server = Depends(get_server)):
    # Events can echo request headers, X-API-Key included: credentials are blanked before the
    # batch is written (one JSON line per batch, under the data directory: telemetry_log.py).
    try:
        check_stored_json(batch, "a telemetry batch", TELEMETRY_MAX_BYTES)
    except ValueError as e:
        raise HTTPException(400, str(e)) from None
    server.telemetry.write({"owner": owner, "received_at": time.time(), "batch": redact(batch)})
    return {"status": "accepted"}
