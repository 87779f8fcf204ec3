"""The admin role's routes, what `tinker.AdminClient` (and the `tinker billing` CLI) calls: hourly usage,
checkpoint storage now, the audit log. Owners named by `--admin-users` only; anyone else gets a 403
naming the role (services/reports.py builds the reports).
"""

from __future__ import annotations

from datetime import date, datetime, timezone
from typing import Annotated

from fastapi import APIRouter, Depends, Query

from ..accounts.access import Access
from ..accounts.tokens import user_urn
from ..server.core import Server
from ..services.reports import (
    MAX_AUDIT_ENTRIES, AuditReport, StorageGroup, UsageEvent, audit_query, audit_report, session_metadata,
    storage_report, usage_report, usage_window,
)
from ..store.accounting import AuditEntry
from .deps import get_access, get_server, require_owner
from .schemas import ShortText

router = APIRouter()
MAX_CURSOR_CHARS = 8192  # an audit cursor: its query as JSON in base64, a user name of up to 1024 characters included


def _iso(ts: float) -> str:
    return datetime.fromtimestamp(ts, tz=timezone.utc).isoformat()


def _event_info(e: UsageEvent) -> dict:
    if e.kind == "storage":
        return {"type": "storage", "free": False, "gigabyte_hours": e.quantity}
    if e.kind == "checkpoint":
        return {"type": "checkpoint", "count": int(e.quantity)}
    info = {"type": e.kind, "token_count": int(e.quantity)}
    if e.kind == "sampling_prefill":
        info["cached"] = e.cached
    return info


def _usage_event(e: UsageEvent) -> dict:
    storage = e.kind == "storage"
    return {
        "bucket_start": _iso(e.bucket_start), "bucket_end": _iso(e.bucket_start + 3600), "base_model": e.base_model,
        "user_id": user_urn(e.owner), "user_name": e.owner, "session_id": e.session_id, "project_id": e.project_id,
        "estimated_cost_usd": e.cost,
        "effective_rate_usd_per_million_tokens": None if storage else e.rate,
        "effective_rate_usd_per_gigabyte_month": e.rate if storage else None,
        "event_info": _event_info(e),
    }


@router.get("/api/v1/billing/usage/events")
def billing_usage(starting_on: datetime = Query(...), ending_before: datetime = Query(...),
                  owner: str = Depends(require_owner), server: Server = Depends(get_server),
                  access: Access = Depends(get_access)):
    """`AdminClient.get_billing_usage`: [starting_on, ending_before), UTC hours, at most 14 days."""
    access.admin(owner)
    start, end = usage_window(starting_on, ending_before)
    report = usage_report(server, access, owner, start, end)
    return {"data": [_usage_event(e) for e in report.events],
            "sessions": {sid: {"user_metadata": _strings(session_metadata(record))}
                         for sid, record in report.sessions.items()},
            "cost_data_through": None}  # every estimate is from the operator's rate card, none from an invoice


def _strings(metadata: dict | None) -> dict[str, str] | None:
    return None if metadata is None else {str(k): v if isinstance(v, str) else str(v) for k, v in metadata.items()}


def _storage_item(g: StorageGroup) -> dict:
    return {"project_id": g.project_id, "org_user_urn": user_urn(g.owner), "user_email": None, "user_name": g.owner,
            "checkpoint_count": g.checkpoints, "size_bytes": g.size_bytes, "size_gigabytes": g.size_bytes / 1e9,
            "estimated_monthly_cost_usd": g.monthly_cost}


@router.get("/api/v1/billing/usage/checkpoints/current")
def checkpoint_storage(project_id: ShortText | None = None, owner: str = Depends(require_owner),
                       server: Server = Depends(get_server), access: Access = Depends(get_access)):
    """`AdminClient.get_current_checkpoint_storage_usage`: live checkpoints per project and owner."""
    return {"effective_rate_usd_per_gigabyte_month": server.rate_card.storage_usd_per_gigabyte_month,
            "data": [_storage_item(g) for g in storage_report(server, access, owner, project_id)]}


def _audit_entry(e: AuditEntry) -> dict:
    details = {"actor": user_urn(e.actor) if e.actor else None, "user_name": e.actor or None, **e.details}
    checkpoint = e.resource == "checkpoints"
    return {"timestamp": _iso(e.at), "event": e.event, "event_details": details,
            "model_id": details.get("model_id") if checkpoint else None,
            "tinker_path": details.get("tinker_path") if checkpoint else None,
            "purpose": details.get("purpose") if e.event == "checkpoint_read" else None}


@router.get("/api/v1/audit")
def audit_log(event_type: ShortText | None = None, day: date | None = None, event: ShortText | None = None,
              user: ShortText | None = None, cursor: Annotated[str | None, Query(max_length=MAX_CURSOR_CHARS)] = None,
              limit: int = Query(MAX_AUDIT_ENTRIES, ge=1, le=MAX_AUDIT_ENTRIES),
              owner: str = Depends(require_owner), server: Server = Depends(get_server),
              access: Access = Depends(get_access)):
    """`AdminClient.get_audit_log` (`event_type`, `day`): one UTC day (default today) of one resource type,
    in the order the entries were written, a page of at most `limit` (10,000 by default). Ours besides:
    `event` (one event, e.g. checkpoint_read) and `user` (an owner or its URN) filter it; a page that does
    not hold every entry has `truncated: true` and `next_cursor`, which, sent as `cursor`, gives the next
    page of the same query (stable while entries are added: none is skipped or given twice)."""
    access.admin(owner)
    query = audit_query(cursor=cursor, day=day, event_type=event_type, event=event, user=user)
    report: AuditReport = audit_report(server, access, owner, query, limit)
    return {"entries": [_audit_entry(e) for e in report.entries], "truncated": report.truncated,
            "next_cursor": report.next_cursor}
