"""The admin role's reports (`tinker.AdminClient`): usage by the hour, checkpoint storage now, the audit log.

Each is for the admin role only (`Access.admin`: anyone else gets `Forbidden`, a 403 naming the role) and
first settles the accounting (accounting.py): it shows everything answered before it was asked. Each is
bounded: a usage window of at most 14 days on hour boundaries holding at most `MAX_USAGE_EVENTS` events,
at most `MAX_AUDIT_ENTRIES` entries of one day's audit log.
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass
from datetime import date, datetime, timedelta, timezone

from ..access import Access
from ..accounting import CHECKPOINT, STORAGE
from ..errors import UserError
from ..rate_card import HOURS_PER_MONTH
from ..server import Server
from ..store_accounting import AuditEntry
from ..store_records import SessionRecord

MAX_WINDOW = timedelta(days=14)
MAX_AUDIT_ENTRIES = 10_000
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
    truncated: bool  # more entries than MAX_AUDIT_ENTRIES that day: the first ones are given


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
            record = server.store.get_session(k.session_id)
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
    for held in server.store.live_checkpoint_storage():
        if held.session_id not in projects:
            record = server.store.get_session(held.session_id) if held.session_id else None
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


def audit_report(server: Server, access: Access, owner: str, event_type: str, day: date | None) -> AuditReport:
    """One UTC day's audit entries (today's by default) of one resource type, oldest first."""
    access.admin(owner)
    if event_type not in AUDIT_EVENT_TYPES:
        raise UserError(f"event_type must be one of {', '.join(AUDIT_EVENT_TYPES)}; got {event_type!r}")
    day = day or datetime.now(timezone.utc).date()
    start = datetime(day.year, day.month, day.day, tzinfo=timezone.utc).timestamp()
    server.accounting.settle(server.cycles_started())
    resource = None if event_type == "all" else event_type
    entries = server.accounting.tables.audit(start, start + 86400, resource, MAX_AUDIT_ENTRIES + 1)
    return AuditReport(entries[:MAX_AUDIT_ENTRIES], len(entries) > MAX_AUDIT_ENTRIES)


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
