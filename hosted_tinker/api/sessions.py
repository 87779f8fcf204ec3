"""Session routes beyond the SDK's session lifecycle: `RestClient.search_sessions`."""

from __future__ import annotations

from datetime import datetime, timedelta, timezone
from typing import Literal

from fastapi import APIRouter, Depends
from pydantic import AwareDatetime, Field

from ..auth_tokens import user_urn
from ..errors import UserError
from ..server import Server
from ..services.session_search import EPOCH, CLIENT_FINISH_REASONS, SessionQuery, StatusQuery, search_sessions
from ..store_search import DEFAULT_PROJECT, FoundSession, SessionSearch
from .deps import get_server, require_owner
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


def _summary(found: FoundSession) -> dict:
    s = found.record
    return {"session_id": s.session_id, "created_at": datetime.fromtimestamp(s.created_at, tz=timezone.utc).isoformat(),
            "owner": user_urn(s.owner), "project_id": s.project_id or DEFAULT_PROJECT, "status": _status(s.status),
            "checkpoints_count": found.checkpoints, "display_name": s.display_name,
            "user_metadata": str_dict(s.user_metadata) or None, "checkpoint_storage_bytes": found.checkpoint_bytes}


@router.post("/api/v1/sessions/search")
def search(body: SessionSearchBody, owner: str = Depends(require_owner), server: Server = Depends(get_server)):
    """Newest first; pass `next_cursor` back as `cursor` for the next page. Another owner's session appears
    only while it holds a published checkpoint."""
    try:
        query = body.query()
    except ValueError as e:
        raise UserError(str(e)) from None
    page = search_sessions(SessionSearch(server.store.db), owner, query)
    cursor = None if page.next_cursor is None else {
        "last_created_at": (EPOCH + timedelta(microseconds=page.next_cursor[0])).isoformat(),
        "last_session_id": page.next_cursor[1]}
    return {"sessions": [_summary(f) for f in page.sessions], "next_cursor": cursor}
