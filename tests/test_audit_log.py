"""The audit log is complete and pageable (issue 40, item 4).

Before, the admin route gave the oldest 10,000 entries of a day and nothing more: 9,995 cheap TTL
changes pushed a later download of another owner's checkpoint, and a delete, out of every answer.
Now it pages with an opaque cursor that is stable while entries are written (none skipped, none
twice) and filters by user and event, and a page that does not hold everything says so and gives
the next page's cursor; the SDK's own call (`AdminClient.get_audit_log`) works as before.

The flood on the real server is a few hundred TTL changes read in pages of 100 (the same code as
the SDK's 10,000 a page); the tables' own test writes 10,005 entries to real SQLite.
"""

from __future__ import annotations

from datetime import date, datetime, timezone
from pathlib import Path

import httpx
import pytest
import tinker

from helpers import BASE_MODEL, TEAM
from hosted_tinker.store.database import SQLiteDB
from hosted_tinker.store.accounting import AccountingTables, AuditEntry

FLOOD = 300  # TTL changes on one checkpoint
PAGE = 100
DAY = 86400 * 20_000  # a UTC midnight


def _ttl_entry(at: float, i: int, actor: str = "alice") -> AuditEntry:
    return AuditEntry(at, "checkpoint_ttl_set", "checkpoints", actor, {"ttl_seconds": i})


def _walk(tables: AccountingTables, limit: int, **filters) -> list[AuditEntry]:
    entries, after = [], 0
    while True:
        page = tables.audit(DAY, DAY + 86400, after=after, limit=limit, **filters)
        entries += [e for _, e in page]
        if len(page) < limit:
            return entries
        after = page[-1][0]


def test_the_tables_page_every_entry_once_while_entries_are_written(tmp_path: Path):
    tables = AccountingTables(SQLiteDB(tmp_path / "db.sqlite"))
    tables.write({}, [_ttl_entry(DAY + i / 1000, i) for i in range(10_000)], [])
    tables.write({}, [AuditEntry(DAY + 20, "checkpoint_read", "checkpoints", "alice", {"purpose": "download"}),
                      AuditEntry(DAY + 21, "checkpoint_delete", "checkpoints", "alice", {}),
                      _ttl_entry(DAY - 1, -1), _ttl_entry(DAY + 86400, -2)], [])  # the days around: not in it
    first = tables.audit(DAY, DAY + 86400, limit=10_000)
    assert [e.details["ttl_seconds"] for _, e in first] == list(range(10_000))  # the old cap: nothing else
    # Written after the first page was read, one of them timed before entries already given (a batch
    # that waited in memory): paging on reaches both.
    tables.write({}, [_ttl_entry(DAY + 5, 10_000), _ttl_entry(DAY + 30, 10_001)], [])
    rest = tables.audit(DAY, DAY + 86400, after=first[-1][0], limit=10_000)
    assert [(e.event, e.details.get("ttl_seconds")) for _, e in rest] == [
        ("checkpoint_read", None), ("checkpoint_delete", None), ("checkpoint_ttl_set", 10_000),
        ("checkpoint_ttl_set", 10_001)]
    assert len(_walk(tables, 7)) == 10_004
    (read,) = _walk(tables, 3, event="checkpoint_read", actor="alice")
    assert read.details == {"purpose": "download"}
    assert _walk(tables, 3, actor="bob") == []


def _audit(srv, key: str = TEAM["root"], **params) -> httpx.Response:
    return httpx.get(f"{srv.base_url}/api/v1/audit", params=params, headers={"X-API-Key": key}, timeout=120)


def _pages(srv, days: list[date], between=lambda: None, **params) -> tuple[list[dict], int]:
    """Every entry of `days` that `params` ask for, read a page at a time (`between` runs after the
    first page), and how many pages it took; each page but the last is full and says there is more."""
    entries, pages = [], 0
    for day in days:
        answer = _audit(srv, day=day.isoformat(), limit=PAGE, **params).json()
        while True:
            pages += 1
            entries += answer["entries"]
            assert answer["truncated"] == (answer["next_cursor"] is not None)
            if answer["next_cursor"] is None:
                break
            assert len(answer["entries"]) == PAGE
            if pages == 1:
                between()
            answer = _audit(srv, cursor=answer["next_cursor"], limit=PAGE).json()
    return entries, pages


def test_a_flood_of_cheap_entries_hides_no_later_entry(team_server):
    since = datetime.now(timezone.utc).date()
    alice = tinker.RestClient(base_url=team_server.base_url, api_key=TEAM["alice"])
    with team_server.client(TEAM["bob"]) as sc:
        published = sc.create_lora_training_client(base_model=BASE_MODEL, rank=2).result().save_state("bobs").result().path
    tinker.RestClient(base_url=team_server.base_url, api_key=TEAM["bob"]).publish_checkpoint_from_tinker_path(
        published).result()
    with team_server.client(TEAM["alice"]) as sc:
        own = sc.create_lora_training_client(base_model=BASE_MODEL, rank=2).result().save_state("flooded").result().path
    for i in range(FLOOD):
        alice.set_checkpoint_ttl_from_tinker_path(own, 3600 + i).result()
    run, kind, name = published.removeprefix("tinker://").split("/")
    archive = httpx.get(f"{team_server.base_url}/api/v1/training_runs/{run}/checkpoints/{kind}/{name}/archive",
                        headers={"X-API-Key": TEAM["alice"]}, timeout=120)
    assert archive.status_code == 200
    alice.delete_checkpoint_from_tinker_path(own).result()

    def more_while_paging():  # written between two pages: reached, and nothing given twice
        with team_server.client(TEAM["bob"]) as sc:
            tc = sc.create_lora_training_client(base_model=BASE_MODEL, rank=2).result()
            later = tc.save_state("while-paging").result().path
        tinker.RestClient(base_url=team_server.base_url, api_key=TEAM["bob"]).delete_checkpoint_from_tinker_path(
            later).result()

    days = sorted({since, datetime.now(timezone.utc).date()})  # the day the test began and today
    entries, pages = _pages(team_server, days, between=more_while_paging, event_type="checkpoints")
    assert pages > FLOOD // PAGE
    mine = [(e["event"], e["event_details"].get("ttl_seconds")) for e in entries if e["tinker_path"] == own]
    assert mine == [("checkpoint_create", None), *[("checkpoint_ttl_set", 3600 + i) for i in range(FLOOD)],
                    ("checkpoint_delete", None)]
    reads = [e for e in entries if e["tinker_path"] == published and e["event"] == "checkpoint_read"]
    assert [(e["event_details"]["user_name"], e["purpose"]) for e in reads] == [("alice", "download")]
    assert sum(e["tinker_path"].endswith("/while-paging") and e["event"] == "checkpoint_delete" for e in entries) >= 1

    # By filter: alice's reads of the day, her URN as the SDK reports it or her name; each page is ours alone.
    for user in ("alice", "tml:user:alice"):
        found, _ = _pages(team_server, days, event="checkpoint_read", user=user)
        assert {(e["event"], e["event_details"]["user_name"]) for e in found} == {("checkpoint_read", "alice")}
        assert [e["purpose"] for e in found if e["tinker_path"] == published] == ["download"]

    # The SDK's own call gets the route's first page (at most 10,000 entries: here, all of them).
    today = datetime.now(timezone.utc).date()
    log = tinker.AdminClient(base_url=team_server.base_url, api_key=TEAM["root"]).get_audit_log(
        "checkpoints", day=today).result()
    first_page = _audit(team_server, event_type="checkpoints", day=today.isoformat()).json()
    assert not first_page["truncated"] and first_page["next_cursor"] is None
    assert [(e.event, e.tinker_path) for e in log.entries] == [
        (e["event"], e["tinker_path"]) for e in first_page["entries"]]


@pytest.mark.parametrize("params, status, detail", [
    ({"cursor": "not-a-cursor"}, 400, "cursor: not a cursor this route gave out"),
    ({"limit": 0}, 422, "query.limit"),
    ({"limit": 10_001}, 422, "query.limit"),
    ({"event": "checkpoint_eaten"}, 400, "event must be one of checkpoint_create, "),
    ({"event_type": "everything"}, 400, "event_type must be one of"),
    ({"cursor": "x" * 9000}, 422, "query.cursor"),
])
def test_a_bad_audit_page_request_is_a_4xx_naming_the_parameter(team_server, params, status, detail):
    r = _audit(team_server, **params)
    assert r.status_code == status and detail in r.json()["detail"], r.text


def test_a_cursor_continues_its_own_query_only(team_server):
    with team_server.client(TEAM["bob"]) as sc:
        tc = sc.create_lora_training_client(base_model=BASE_MODEL, rank=2).result()
        for i in range(3):
            tc.save_state(f"cursor-{i}").result()
    first = _audit(team_server, limit=1, user="bob", event="checkpoint_create").json()
    cursor = first["next_cursor"]
    assert first["truncated"] and cursor is not None
    same = _audit(team_server, cursor=cursor, limit=1, user="tml:user:bob", event_type="all").json()
    assert same["entries"][0]["event"] == "checkpoint_create" and same["entries"] != first["entries"]
    r = _audit(team_server, cursor=cursor, user="alice")
    assert r.status_code == 400 and "user: alice is not the user of the query the cursor continues" in r.json()["detail"]
    assert _audit(team_server, TEAM["bob"], cursor=cursor).status_code == 403  # an admin's cursor is no key
