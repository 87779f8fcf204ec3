"""`/dashboard`: runs, checkpoints, sessions, loss curves and live cycle utilisation, in the browser.

Plain server-rendered HTML (Jinja2 templates in hosted_tinker/dashboard/templates), with uPlot
served from hosted_tinker/dashboard/static for the charts: no CDN, no build step.

Behind the same API keys as the API, and each key sees only its own runs, checkpoints and sessions
(the same owner rules as the REST routes). A browser cannot attach an `X-API-Key` header to a page
it navigates to, so the key is entered once in a login form and kept in a cookie that is
HttpOnly (page scripts cannot read it), SameSite=Strict (other sites cannot make the browser send
it), scoped to /dashboard, and Secure when the server is reached over https. A key in the URL
instead would land in access logs, proxies and browser history. Scripts may still send the key as
`X-API-Key` / `Authorization: Bearer`, as to the API.
"""

from __future__ import annotations

import json
import time
from datetime import date
from pathlib import Path
from urllib.parse import parse_qs

from fastapi import APIRouter, HTTPException, Request
from fastapi.responses import FileResponse, RedirectResponse, Response
from fastapi.templating import Jinja2Templates

from ..accounts.audit_log import AUDIT_EVENTS
from ..accounts.auth import InvalidCredential
from ..checkpoints.paths import TinkerPath
from ..errors import Forbidden, UserError
from ..server.core import Server
from ..services.reports import (
    AUDIT_EVENT_TYPES, DASHBOARD_DAYS, MAX_AUDIT_ENTRIES, audit_query, audit_report, usage_by_owner,
)
from .deps import credential, server_of

router = APIRouter(prefix="/dashboard", include_in_schema=False)

COOKIE = "hosted_tinker_key"
_ASSETS = Path(__file__).resolve().parent.parent / "dashboard"
_STATIC = {p.name: p for p in (_ASSETS / "static").iterdir() if p.suffix in (".js", ".css")}
templates = Jinja2Templates(directory=_ASSETS / "templates")
ROWS = 200  # runs / checkpoints / sessions listed per page
AUDIT_ROWS = 100  # audit log entries per page, unless the page asks for another `limit`


def _when(ts: float | None) -> str:
    return "" if ts is None else time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(ts))


def _size(n: int) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if n < 1024 or unit == "GiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return ""


def _expires(ts: float | None) -> str:
    if ts is None:
        return "never"
    left = ts - time.time()
    if left <= 0:
        return "expired"
    return f"in {left / 3600:.1f} h" if left < 48 * 3600 else f"in {left / 86400:.1f} days"


def _tinker_path(checkpoint) -> str:
    return str(TinkerPath.of_record(checkpoint.model_id, checkpoint.checkpoint_id))


def _utc(ts: float) -> str:
    return time.strftime("%Y-%m-%d %H:%M:%S", time.gmtime(ts))


templates.env.filters.update(when=_when, utc=_utc, size=_size, expires=_expires, tinker_path=_tinker_path)


def _key(request: Request) -> str | None:
    return request.cookies.get(COOKIE) or credential(request, request.headers.get("x-api-key"))


def _owner_of(server: Server, key: str | None) -> str | None:
    """Whom a key (or a JWT of this server's) acts for; None if it is refused."""
    try:
        return server.auth.owner(key)
    except InvalidCredential:
        return None


def _owner(request: Request) -> str | None:
    return _owner_of(server_of(request), _key(request))


def _require_owner(request: Request) -> str:
    owner = _owner(request)
    if owner is None:
        raise HTTPException(401, "log in at /dashboard with an API key (or send it as X-API-Key)")
    return owner


def _login_page(request: Request, error: str | None = None, status: int = 200) -> Response:
    return templates.TemplateResponse(request, "login.html", {"error": error}, status_code=status)


def _loss_points(server: Server, run_id: str) -> list[dict]:
    return [{"step": r.step, "loss": r.train_loss_sum, "eval_loss": r.eval_loss_sum, "requests": r.requests}
            for r in server.store.losses.curve(run_id)]


@router.get("")
def overview(request: Request):
    owner = _owner(request)
    if owner is None:
        return _login_page(request)
    server = server_of(request)
    runs, _ = server.store.runs.page(owner, accessible=False, project_id=None, limit=ROWS, offset=0)
    run_rows = []
    for row in runs:
        curve = [p for p in _loss_points(server, row.model_id) if p["loss"] is not None]
        run_rows.append({"id": row.model_id, "base_model": row.base_model,
                         "rank": json.loads(row.lora_config).get("rank"), "status": row.status,
                         "created": row.created_at, "last_request": row.last_request_at,
                         "steps": curve[-1]["step"] + 1 if curve else 0,
                         "last_loss": curve[-1]["loss"] if curve else None})
    checkpoints, _ = server.store.checkpoints.live_page(owner, ROWS, 0)
    session_ids, _ = server.store.sessions.page(owner, ROWS, 0)
    sessions = [server.store.sessions.get(sid) for sid in session_ids]
    admin = owner in server.config.admin_users
    usage = usage_by_owner(server, None if admin else {owner})
    return templates.TemplateResponse(request, "overview.html", {
        "owner": owner, "base_models": server.models.names, "dev_mode": server.keyring.dev_mode,
        "usage": usage, "usage_days": DASHBOARD_DAYS, "admin": admin,
        "data_dir": dict(sorted(server.retention.usage.items())) if admin or server.keyring.dev_mode else None,
        "runs": run_rows, "checkpoints": checkpoints, "sessions": [s for s in sessions if s is not None],
        "session_runs": {sid: len(server.store.runs.ids_in_session(sid)) for sid in session_ids}})


@router.post("/login")
async def login(request: Request):
    form = parse_qs((await request.body()).decode("utf-8", "replace"))
    key = (form.get("api_key") or [""])[0].strip()
    if _owner_of(server_of(request), key) is None:
        return _login_page(request, "That API key is not accepted by this server.", status=401)
    answer = RedirectResponse("/dashboard", status_code=303)
    answer.set_cookie(COOKIE, key, httponly=True, samesite="strict", path="/dashboard",
                      secure=request.url.scheme == "https")
    return answer


@router.post("/logout")
def logout():
    answer = RedirectResponse("/dashboard", status_code=303)
    answer.delete_cookie(COOKIE, path="/dashboard")
    return answer


def _owned_run(request: Request, run_id: str):
    owner = _require_owner(request)
    row = server_of(request).store.runs.get(run_id)
    if row is None or row.owner != owner:
        raise HTTPException(404, f"training run {run_id!r} not found")
    return row


@router.get("/runs/{run_id}")
def run_page(run_id: str, request: Request):
    if _owner(request) is None:
        return _login_page(request)
    row = _owned_run(request, run_id)
    server = server_of(request)
    return templates.TemplateResponse(request, "run.html", {
        "run": row, "lora": json.loads(row.lora_config), "points": _loss_points(server, run_id),
        "checkpoints": server.store.checkpoints.live(run_id)})


@router.get("/api/runs/{run_id}/loss")
def run_loss(run_id: str, request: Request):
    _owned_run(request, run_id)
    return {"run_id": run_id, "points": _loss_points(server_of(request), run_id)}


@router.get("/api/cycles")
def cycles(request: Request):
    """Recent clock cycles: how full each was. Server-wide totals, no tenant's identity."""
    _require_owner(request)
    server = server_of(request)
    queued = sum(served.scheduler.queue_depth() for served in server.models)
    return {"cycles": request.app.state.metrics.recent_cycles(), "queue_depth": queued,
            "max_tokens_per_cycle": server.config.max_tokens_per_cycle}


@router.get("/audit")
def audit_page(request: Request):
    """The admin's audit log, a page at a time: the query, pages and cursors of the admin route
    (`/api/v1/audit`), from a form (an empty field is not given) and the next page's link."""
    owner = _owner(request)
    if owner is None:
        return _login_page(request)
    server = server_of(request)
    access = request.app.state.access
    given = {name: value for name, value in request.query_params.items() if value.strip()}
    context = {"owner": owner, "given": given, "event_types": AUDIT_EVENT_TYPES, "events": AUDIT_EVENTS,
               "report": None, "query": None, "error": None}
    try:
        access.admin(owner)
        query = audit_query(cursor=given.get("cursor"), day=_form_day(given.get("day")),
                            event_type=given.get("event_type"), event=given.get("event"), user=given.get("user"))
        context.update(query=query, report=audit_report(server, access, owner, query, _form_limit(given.get("limit"))))
    except Forbidden as e:
        raise HTTPException(403, str(e)) from None
    except UserError as e:  # the form again, saying what is wrong
        context["error"] = str(e)
    return templates.TemplateResponse(request, "audit.html", context, status_code=400 if context["error"] else 200)


def _form_day(text: str | None) -> date | None:
    try:
        return None if text is None else date.fromisoformat(text)
    except ValueError:
        raise UserError(f"day: {text!r} is not a date (YYYY-MM-DD)") from None


def _form_limit(text: str | None) -> int:
    if text is None:
        return AUDIT_ROWS
    if not text.isdigit() or not 1 <= int(text) <= MAX_AUDIT_ENTRIES:
        raise UserError(f"limit: {text!r} is not a number of entries from 1 to {MAX_AUDIT_ENTRIES}")
    return int(text)


@router.get("/static/{name}")
def static(name: str):
    if name not in _STATIC:
        raise HTTPException(404, f"no static file {name!r}")
    return FileResponse(_STATIC[name], headers={"Cache-Control": "max-age=3600"})

