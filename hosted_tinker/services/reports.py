"""The admin role's reports (`tinker.AdminClient`): usage by the hour, checkpoint storage now, the audit log.

Each is for the admin role only (`Access.admin`: anyone else gets `Forbidden`, a 403 naming the role) and
first settles the accounting (accounting.py): it shows everything answered before it was asked. Each is
bounded: a usage window of at most 14 days on hour boundaries holding at most `MAX_USAGE_EVENTS` events,
and pages of at most `MAX_AUDIT_ENTRIES` entries of one day's audit log. A page that does not hold every
entry says so with the cursor of the next one (`AuditQuery`): paging reaches every entry once, those
written while it pages included, and never drops one silently.
"""

from __future__ import annotations

import base64
import json
import time
from dataclasses import dataclass
from datetime import date, datetime, timedelta, timezone

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from ..accounts.access import Access
from ..accounts.audit_log import AUDIT_EVENTS
from ..accounts.tokens import owner_of_urn
from ..errors import UserError
from ..accounts.rate_card import HOURS_PER_MONTH
from ..server.core import Server
from ..store.accounting import AuditEntry
from ..store.records import SessionRecord
from ..accounts.usage_meter import CHECKPOINT, STORAGE

MAX_WINDOW = timedelta(days=14)
MAX_AUDIT_ENTRIES = 10_000  # a page's most, and its size by default: the SDK's call (it cannot page) gets one
MAX_USAGE_EVENTS = 100_000
AUDIT_EVENT_TYPES = ("all", "checkpoints", "projects", "teams", "organizations")


@dataclass(frozen=True)
class UsageEvent:
    """One hour's usage of one kind, by one owner in one session (storage: in one project), priced."""

    bucket_start: int
    base_model: str | None
    owner: str
    session_id: str | None
    project_id: str | None
    kind: str  # training | sampling_prefill | sampling_sample | checkpoint | storage
    cached: bool
    quantity: float  # tokens, checkpoints or GB-hours
    rate: float | None  # USD per million tokens, or per GB-month for storage
    cost: float | None


@dataclass(frozen=True)
class UsageReport:
    events: list[UsageEvent]
    sessions: dict[str, SessionRecord]  # every session an event names


@dataclass(frozen=True)
class StorageGroup:
    project_id: str | None
    owner: str
    checkpoints: int
    size_bytes: int
    monthly_cost: float | None


@dataclass(frozen=True)
class AuditReport:
    entries: list[AuditEntry]
    next_cursor: str | None  # the page did not hold every entry: where the next one starts

    @property
    def truncated(self) -> bool:
        return self.next_cursor is not None


class AuditQuery(BaseModel):
    """What an audit report asks for: one UTC day's entries of one resource type (`event_type`, as the SDK
    names it), of one event and one user if given; `after`: the last entry id a previous page gave."""

    model_config = ConfigDict(frozen=True, extra="forbid", strict=True)
    day: date
    event_type: str = "all"
    event: str | None = None
    user: str | None = None
    after: int = Field(0, ge=0, lt=2**63)  # an SQLite integer

    def cursor(self, after: int) -> str:
        """Opaque to its reader: this query, continued after entry `after` (URL-safe text)."""
        text = self.model_copy(update={"after": after}).model_dump_json()
        return base64.urlsafe_b64encode(text.encode()).decode().rstrip("=")

    @classmethod
    def of_cursor(cls, cursor: str) -> "AuditQuery":
        try:
            return cls.model_validate_json(base64.urlsafe_b64decode(cursor + "=" * (-len(cursor) % 4)), strict=False)
        except (ValueError, ValidationError):  # binascii.Error is a ValueError
            raise UserError("cursor: not a cursor this route gave out; start again without one") from None


def audit_query(*, cursor: str | None, day: date | None, event_type: str | None, event: str | None,
                user: str | None) -> AuditQuery:
    """The query a request asks for: its parameters (`user` an owner or its URN), or the query its `cursor`
    continues, with which any parameter given beside it must agree; a `UserError` naming what is wrong."""
    user = None if user is None else owner_of_urn(user) or user
    given = {"day": day, "event_type": event_type, "event": event, "user": user}
    if cursor is None:
        query = AuditQuery(**{**given, "day": day or datetime.now(timezone.utc).date(), "event_type": event_type or "all"})
    else:
        query = AuditQuery.of_cursor(cursor)
        for name, value in given.items():
            if value is not None and value != getattr(query, name):
                raise UserError(f"{name}: {value} is not the {name} of the query the cursor continues "
                                f"({getattr(query, name)}); leave {name} out, or start again without the cursor")
    if query.event_type not in AUDIT_EVENT_TYPES:
        raise UserError(f"event_type must be one of {', '.join(AUDIT_EVENT_TYPES)}; got {query.event_type!r}")
    if query.event is not None and query.event not in AUDIT_EVENTS:
        raise UserError(f"event must be one of {', '.join(AUDIT_EVENTS)}; got {query.event!r}")
    return query


def usage_window(starting_on: datetime, ending_before: datetime) -> tuple[int, int]:
    """[start, end) in unix seconds, checked as the SDK documents it; a `UserError` naming the field."""
    for name, t in (("starting_on", starting_on), ("ending_before", ending_before)):
        if t.tzinfo is None:
            raise UserError(f"{name} must carry a time zone (e.g. 2026-07-13T05:00:00Z); got {t.isoformat()}")
        if t.minute or t.second or t.microsecond or t.utcoffset().total_seconds() % 3600:
            raise UserError(f"{name} must be on a UTC hour boundary (e.g. 2026-07-13T05:00:00Z); got {t.isoformat()}")
    if starting_on > datetime.now(timezone.utc):
        raise UserError(f"starting_on must not be in the future; got {starting_on.isoformat()}")
    if ending_before <= starting_on:
        raise UserError(f"ending_before ({ending_before.isoformat()}) must be after starting_on "
                        f"({starting_on.isoformat()})")
    if ending_before - starting_on > MAX_WINDOW:
        raise UserError(f"the window from starting_on to ending_before is {ending_before - starting_on}; at most "
                        f"{MAX_WINDOW.days} days are reported at once")
    return int(starting_on.timestamp()), int(ending_before.timestamp())


def usage_report(server: Server, access: Access, owner: str, start: int, end: int) -> UsageReport:
    access.admin(owner)
    server.accounting.settle(server.cycles_started())
    sessions: dict[str, SessionRecord] = {}
    merged: dict[tuple, float] = {}  # storage is reported per project, not per session
    for row in server.accounting.tables.usage(start, end):
        k = row.key
        if k.session_id and k.session_id not in sessions:
            record = server.store.sessions.get(k.session_id)
            if record is not None:
                sessions[k.session_id] = record
        project = sessions[k.session_id].project_id if k.session_id in sessions else None
        session = None if k.kind == STORAGE or not k.session_id else k.session_id
        group = (k.bucket_start, k.base_model or None, k.owner, session, project, k.kind, k.cached)
        merged[group] = merged.get(group, 0) + row.quantity
    if len(merged) > MAX_USAGE_EVENTS:
        raise UserError(f"the window from starting_on to ending_before holds {len(merged)} usage events; at most "
                        f"{MAX_USAGE_EVENTS} are reported at once: ask for a shorter window")
    events = [_priced(server, *group, quantity) for group, quantity in merged.items()]
    events.sort(key=lambda e: (e.bucket_start, -e.quantity, e.kind, e.owner, e.session_id or ""))
    named = {e.session_id for e in events}
    return UsageReport(events, {sid: record for sid, record in sessions.items() if sid in named})


def _priced(server: Server, bucket_start: int, base_model: str | None, owner: str, session_id: str | None,
            project_id: str | None, kind: str, cached: bool, quantity: float) -> UsageEvent:
    """The event with its rate and estimated cost, by the SDK's formulas (none for checkpoints)."""
    card = server.rate_card
    if kind == CHECKPOINT:
        rate = cost = None
    elif kind == STORAGE:
        rate = card.storage_usd_per_gigabyte_month
        cost = None if rate is None else rate * quantity / HOURS_PER_MONTH
    else:
        rate = None if base_model is None else card.token_rate(base_model, kind, cached)
        cost = None if rate is None else rate * quantity / 1_000_000
    return UsageEvent(bucket_start, base_model, owner, session_id, project_id, kind, cached, quantity, rate, cost)


def storage_report(server: Server, access: Access, owner: str, project_id: str | None) -> list[StorageGroup]:
    """Live checkpoints and their bytes per (project, owner): what is on disk now."""
    access.admin(owner)
    groups: dict[tuple[str | None, str], list[int]] = {}
    projects: dict[str, str | None] = {}
    for held in server.store.checkpoints.live_storage():
        if held.session_id not in projects:
            record = server.store.sessions.get(held.session_id) if held.session_id else None
            projects[held.session_id] = None if record is None else record.project_id
        project = projects[held.session_id]
        if project_id is not None and project != project_id:
            continue
        counts = groups.setdefault((project, held.owner), [0, 0])
        counts[0] += held.checkpoints
        counts[1] += held.size_bytes
    rate = server.rate_card.storage_usd_per_gigabyte_month
    return [StorageGroup(project, who, n, size, None if rate is None else rate * size / 1e9)
            for (project, who), (n, size) in sorted(groups.items(), key=lambda g: (g[0][0] or "", g[0][1]))]


def audit_report(server: Server, access: Access, owner: str, query: AuditQuery,
                 limit: int = MAX_AUDIT_ENTRIES) -> AuditReport:
    """One page of at most `limit` of the audit entries `query` asks for, in the order they were written (time
    order but for entries written in the same moment), and the cursor of the next page if there are more."""
    access.admin(owner)
    if not 1 <= limit <= MAX_AUDIT_ENTRIES:
        raise UserError(f"limit must be from 1 to {MAX_AUDIT_ENTRIES} entries a page; got {limit}")
    start = datetime(query.day.year, query.day.month, query.day.day, tzinfo=timezone.utc).timestamp()
    server.accounting.settle(server.cycles_started())
    resource = None if query.event_type == "all" else query.event_type
    rows = server.accounting.tables.audit(start, start + 86400, after=query.after, resource=resource,
                                          event=query.event, actor=query.user, limit=limit + 1)
    page = rows[:limit]
    return AuditReport([entry for _, entry in page], query.cursor(page[-1][0]) if len(rows) > limit else None)


@dataclass(frozen=True)
class OwnerUsage:
    """One owner's usage over the dashboard's window: tokens by kind, checkpoints saved, storage, cost."""

    owner: str
    training_tokens: int
    prefill_tokens: int
    sampled_tokens: int
    checkpoints: int
    storage_gigabyte_hours: float
    cost: float | None  # None when no rate applies to any of it


DASHBOARD_DAYS = 7


def usage_by_owner(server: Server, owners: set[str] | None) -> list[OwnerUsage]:
    """Usage per owner over the last `DASHBOARD_DAYS` days (whole UTC hours): of `owners`, or of all (None)."""
    end = (int(time.time()) // 3600 + 1) * 3600
    server.accounting.flush()
    totals: dict[str, dict[str, float]] = {}
    costs: dict[str, float | None] = {}
    for row in server.accounting.tables.usage(end - DASHBOARD_DAYS * 86400, end):
        k = row.key
        if owners is not None and k.owner not in owners:
            continue
        kinds = totals.setdefault(k.owner, {})
        kinds[k.kind] = kinds.get(k.kind, 0) + row.quantity
        cost = _priced(server, k.bucket_start, k.base_model or None, k.owner, None, None, k.kind, k.cached,
                       row.quantity).cost
        if cost is not None:
            costs[k.owner] = (costs.get(k.owner) or 0) + cost
    return [OwnerUsage(who, int(t.get("training", 0)), int(t.get("sampling_prefill", 0)),
                       int(t.get("sampling_sample", 0)), int(t.get(CHECKPOINT, 0)), t.get(STORAGE, 0.0), costs.get(who))
            for who, t in sorted(totals.items())]


def session_metadata(record: SessionRecord) -> dict | None:
    """A session's user_metadata as stored (a JSON object), or None when it has none."""
    value = json.loads(record.user_metadata) if record.user_metadata else {}
    return value or None
