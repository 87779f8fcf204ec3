"""`search_sessions`: the caller's sessions (and others' published ones) by id, name words, metadata,
project, status and owner, newest first, a page at a time (store_search.py runs the query).

Statuses: a session here is active until its client finishes it with a reason (success, errored,
interrupted); nothing fails or cancels a whole session on this server, so those statuses match none.
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import datetime, timedelta, timezone

from ..accounts.tokens import owner_of_urn
from ..errors import NotFound, UserError
from ..store.search import FoundSession, SessionFilter, SessionSearch, micros

CLIENT_FINISH_REASONS = ("success", "errored", "interrupted")
EPOCH = datetime(1970, 1, 1, tzinfo=timezone.utc)


@dataclass(frozen=True)
class StatusQuery:
    type: str  # active | cancelled | failed | client_finished
    reasons: tuple[str, ...] | None = None  # client_finished: any of these (None: any)


@dataclass(frozen=True)
class SessionQuery:
    """A search as the SDK's `SessionSearchRequest` asks it, already type-checked at the API edge."""

    session_id: str | None
    project_ids: tuple[str, ...] | None
    user_metadata: dict[str, str]
    display_name: str | None
    owner_type: str  # own | accessible | user
    owner_urns: tuple[str, ...]
    statuses: tuple[StatusQuery, ...] | None
    limit: int
    cursor: tuple[datetime, str] | None


@dataclass(frozen=True)
class SearchPage:
    sessions: list[FoundSession]
    next_cursor: tuple[int, str] | None  # (created_at in microseconds, session_id) of the page's last session


def _owners(caller: str, q: SessionQuery) -> frozenset[str] | None:
    if q.owner_type == "own":
        return frozenset({caller})
    if q.owner_type == "accessible":
        return None
    owners = set()
    for urn in q.owner_urns:
        owner = owner_of_urn(urn)
        if owner is None:
            raise UserError(f"owner.owner_urns: {urn!r} is not a user URN (tml:user:<name>, as whoami gives it)")
        owners.add(owner)
    return frozenset(owners)


def _statuses(q: SessionQuery) -> frozenset[str] | None:
    if q.statuses is None:
        return None
    stored: set[str] = set()
    for status in q.statuses:
        if status.type == "active":
            stored.add("active")
        elif status.type == "client_finished":
            stored.update(status.reasons or CLIENT_FINISH_REASONS)
    return frozenset(stored)


def search_sessions(search: SessionSearch, caller: str, q: SessionQuery) -> SearchPage:
    if q.project_ids is not None:
        wanted = frozenset(q.project_ids)
        missing = sorted(wanted - search.listable_projects(caller, wanted))
        if missing:  # the same for a project that does not exist and one the caller may not list
            raise NotFound(f"project_ids: project {missing[0]!r} not found")
    statuses = _statuses(q)
    if statuses is not None and not statuses:
        return SearchPage([], None)  # only statuses no session here has
    found = search.find(SessionFilter(
        caller=caller, owners=_owners(caller, q), session_id=q.session_id,
        name_words=tuple(q.display_name.split()) if q.display_name else (), metadata=q.user_metadata,
        projects=None if q.project_ids is None else frozenset(q.project_ids), statuses=statuses, limit=q.limit + 1,
        after=None if q.cursor is None else ((q.cursor[0] - EPOCH) // timedelta(microseconds=1), q.cursor[1])))
    page = found[:q.limit]
    more = len(found) > q.limit
    return SearchPage(page, (micros(page[-1].record.created_at), page[-1].record.session_id) if more else None)
