"""Session routes beyond the SDK's session lifecycle: `RestClient.search_sessions` and
`RestClient.export_session_trace` (with the signed download its URL points at)."""

from __future__ import annotations

import time
from datetime import datetime, timedelta, timezone
from urllib.parse import quote
from typing import Literal

from fastapi import APIRouter, Depends, HTTPException, Query, Request
from fastapi.responses import FileResponse, JSONResponse
from pydantic import AwareDatetime, Field

from ..accounts.tokens import user_urn
from ..errors import UserError
from ..accounts.access import Access
from ..server.core import Server
from ..observability.trace_exports import TRACE_URL_TTL_S, TraceGrant
from ..services.session_search import EPOCH, CLIENT_FINISH_REASONS, SessionQuery, StatusQuery, search_sessions
from ..store.search import DEFAULT_PROJECT, FoundSession, SessionSearch
from .deps import get_access, get_server, require_owner
from .schemas import Body, ShortText, str_dict

router = APIRouter()


class SearchOwnerIn(Body):
    type: Literal["own", "accessible", "user"] = "own"
    owner_urns: list[ShortText] = Field(default_factory=list, max_length=10)


class SearchStatusIn(Body):
    type: Literal["active", "cancelled", "failed", "client_finished"]
    reasons: list[Literal[CLIENT_FINISH_REASONS]] | None = Field(None, min_length=1)  # type: ignore[valid-type]


class SearchCursorIn(Body):
    last_created_at: AwareDatetime
    last_session_id: ShortText


# Words of a display_name search: each is a LIKE over every candidate session's name.
MAX_NAME_WORDS = 16


class SessionSearchBody(Body):
    session_id: ShortText | None = None
    project_ids: list[ShortText] | None = Field(None, min_length=1, max_length=100)
    user_metadata: dict[ShortText, ShortText] = Field(default_factory=dict, max_length=64)
    display_name: ShortText | None = Field(None, min_length=1)
    owner: SearchOwnerIn = Field(default_factory=SearchOwnerIn)
    statuses: list[SearchStatusIn] | None = Field(None, min_length=1, max_length=8)
    limit: int = Field(50, ge=1, le=200)
    cursor: SearchCursorIn | None = None

    def query(self) -> SessionQuery:
        if self.owner.type == "user" and not self.owner.owner_urns:
            raise ValueError("owner.owner_urns: a user search names 1 to 10 owner URNs")
        if self.display_name is not None and len(self.display_name.split()) > MAX_NAME_WORDS:
            raise ValueError(f"display_name: at most {MAX_NAME_WORDS} words (each must appear in the name), got "
                             f"{len(self.display_name.split())}")
        return SessionQuery(
            session_id=self.session_id, project_ids=None if self.project_ids is None else tuple(self.project_ids),
            user_metadata=self.user_metadata, display_name=self.display_name, owner_type=self.owner.type,
            owner_urns=tuple(self.owner.owner_urns),
            statuses=None if self.statuses is None else tuple(
                StatusQuery(s.type, None if s.reasons is None else tuple(s.reasons)) for s in self.statuses),
            limit=self.limit,
            cursor=None if self.cursor is None else (self.cursor.last_created_at, self.cursor.last_session_id))


def _status(stored: str) -> dict | None:
    if stored == "active":
        return {"type": "active"}
    if stored in CLIENT_FINISH_REASONS:
        return {"type": "client_finished", "reason": {"type": stored}}
    return None  # a finish reason the SDK has no name for


def _summary(found: FoundSession, caller: str) -> dict:
    s = found.record
    public = {"session_id": s.session_id, "created_at": datetime.fromtimestamp(s.created_at, tz=timezone.utc).isoformat(),
              "owner": user_urn(s.owner), "checkpoints_count": found.checkpoints,
              "checkpoint_storage_bytes": found.checkpoint_bytes}  # of what the caller may see
    if s.owner != caller:  # another owner's, shown for its published checkpoints: nothing of its own
        return {**public, "project_id": "", "status": None, "display_name": None, "user_metadata": None}
    return {**public, "project_id": s.project_id or DEFAULT_PROJECT, "status": _status(s.status),
            "display_name": s.display_name, "user_metadata": str_dict(s.user_metadata) or None}


@router.post("/api/v1/sessions/search")
def search(body: SessionSearchBody, owner: str = Depends(require_owner), server: Server = Depends(get_server)):
    """Newest first; pass `next_cursor` back as `cursor` for the next page. Another owner's session appears
    only while it holds a published checkpoint, with its public fields only (an empty `project_id`, no
    status, name or metadata), and only for the public filters (session id, owner)."""
    try:
        query = body.query()
    except ValueError as e:
        raise UserError(str(e)) from None
    page = search_sessions(SessionSearch(server.store.db), owner, query)
    cursor = None if page.next_cursor is None else {
        "last_created_at": (EPOCH + timedelta(microseconds=page.next_cursor[0])).isoformat(),
        "last_session_id": page.next_cursor[1]}
    # JSON types only: sent as is, without FastAPI's walk over every value (a page can be 200 x 64 KB of metadata)
    return JSONResponse({"sessions": [_summary(f, owner) for f in page.sessions], "next_cursor": cursor})


TRACE_WAIT_S = 2.0  # a poll waits this long for a build before it answers "pending" (the SDK polls every 5 s)


@router.get("/api/v1/sessions/{session_id}/trace_export")
def trace_export(session_id: str, request: Request, owner: str = Depends(require_owner),
                 server: Server = Depends(get_server), access: Access = Depends(get_access)):
    """The session's Perfetto trace: `pending` while it builds, then a signed URL the SDK's plain GET
    downloads (valid an hour). Only the session's owner may export it (others: 404, as for the session)."""
    access.session(owner, session_id)
    server.accounting.settle(server.cycles_started())  # every request answered so far is in it
    job = server.traces.request(session_id)
    try:
        job.result(timeout=TRACE_WAIT_S)
    except Exception:  # still building (a timeout), or failed: the state says which
        pass
    state = server.traces.state(session_id, job)
    if state.status != "ready":
        return {"status": state.status, "error": state.error}
    expires = int(time.time()) + TRACE_URL_TTL_S
    grant = TraceGrant(session_id, state.filename, expires)
    base = str(request.base_url).rstrip("/")
    return {"status": "ready", "url": f"{base}/api/v1/signed_traces/{quote(session_id, safe='')}/{state.filename}"
                                      f"?expires={expires}&signature={server.url_signer.signature(grant)}"}


@router.get("/api/v1/signed_traces/{session_id}/{filename}")
def signed_trace(session_id: str, filename: str, expires: int = Query(...), signature: str = Query(...),
                 server: Server = Depends(get_server)):
    """A trace file through its signed URL: no API key; the signature is the permission, until it expires."""
    if not server.url_signer.valid(TraceGrant(session_id, filename, expires), signature):
        raise HTTPException(403, "invalid trace URL: the signature does not match")
    if time.time() > expires:
        raise HTTPException(410, "this trace URL has expired; export the session's trace again for a new one")
    path = server.traces.file(session_id, filename)
    if path is None:
        raise HTTPException(404, "this trace was replaced by a newer one of its session; export it again")
    return FileResponse(path, media_type="application/octet-stream", filename=f"{session_id}.pftrace")
