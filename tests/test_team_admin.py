"""The admin role through the SDK's AdminClient (issue 36): hourly usage per model, user, session and
project, checkpoint storage per project and owner, and the audit log; everyone else gets a 403
naming the role. Each test reads only what its own sessions did on the shared team server."""

from __future__ import annotations

import re
from datetime import datetime, timedelta, timezone

import httpx
import pytest
import tinker
from tinker import types

from helpers import BASE_MODEL, TEAM, checkpoint_dir, sft_batch

pytestmark = pytest.mark.e2e


def admin(srv) -> tinker.AdminClient:
    return tinker.AdminClient(base_url=srv.base_url, api_key=TEAM["root"])


def this_hour() -> datetime:
    return datetime.now(timezone.utc).replace(minute=0, second=0, microsecond=0)


def usage_of(srv, session_id: str, since: datetime) -> dict[str, float]:
    """The session's usage by kind (prefill split by `cached`), summed over the hours since `since`."""
    report = admin(srv).get_billing_usage(since, this_hour() + timedelta(hours=1)).result()
    totals: dict[str, float] = {}
    for event in report.data:
        if event.session_id == session_id:
            info = event.event_info
            kind = info.type + (":cached" if getattr(info, "cached", False) else "")
            amount = info.count if info.type == "checkpoint" else info.token_count
            totals[kind] = totals.get(kind, 0) + amount
    return totals


def test_admin_calls_need_the_admin_role(team_server):
    for key in (TEAM["alice"], TEAM["bob"]):
        client = tinker.AdminClient(base_url=team_server.base_url, api_key=key)
        for call in (lambda: client.get_billing_usage(this_hour(), this_hour() + timedelta(hours=1)),
                     client.get_current_checkpoint_storage_usage, client.get_audit_log):
            with pytest.raises(tinker.PermissionDeniedError, match="needs the admin role"):
                call().result()
    assert "admins     root" in team_server.log(tail=None)  # the start-up summary names them


@pytest.mark.parametrize("query, field", [
    ({"starting_on": "2026-01-01T00:30:00Z", "ending_before": "2026-01-01T02:00:00Z"}, "starting_on must be on a UTC hour"),
    ({"starting_on": "2026-01-01T00:00:00Z", "ending_before": "2026-01-16T00:00:00Z"}, "at most 14 days"),
    ({"starting_on": "2026-01-01T02:00:00Z", "ending_before": "2026-01-01T01:00:00Z"}, "ending_before"),
    ({"starting_on": "2999-01-01T00:00:00Z", "ending_before": "2999-01-02T00:00:00Z"}, "starting_on must not be in the future"),
    ({"starting_on": "2026-01-01T00:00:00", "ending_before": "2026-01-01T01:00:00Z"}, "starting_on must carry a time zone"),
    ({"starting_on": "yesterday", "ending_before": "2026-01-01T01:00:00Z"}, "query.starting_on"),
])
def test_a_bad_usage_window_is_a_4xx_naming_the_field(team_server, query, field):
    r = httpx.get(f"{team_server.base_url}/api/v1/billing/usage/events", params=query,
                  headers={"X-API-Key": TEAM["root"]}, timeout=60)
    assert r.status_code in (400, 422) and field in r.json()["detail"], r.text


@pytest.mark.parametrize("query, field", [({"event_type": "everything"}, "event_type must be one of"),
                                          ({"day": "tuesday"}, "query.day")])
def test_a_bad_audit_query_is_a_4xx_naming_the_field(team_server, query, field):
    r = httpx.get(f"{team_server.base_url}/api/v1/audit", params=query, headers={"X-API-Key": TEAM["root"]},
                  timeout=60)
    assert r.status_code in (400, 422) and field in r.json()["detail"], r.text


def test_usage_is_exactly_what_each_session_sent_and_sampled(team_server):
    since = this_hour()
    batch = sft_batch(3, seed=5)
    sent = sum(d.model_input.length for d in batch)
    with team_server.client(TEAM["alice"], project_id="proj-usage", user_metadata={"run": "usage-test"}) as sc:
        tc = sc.create_lora_training_client(base_model=BASE_MODEL, rank=4).result()
        tc.forward_backward(batch, "cross_entropy").result()
        tc.forward(batch[:1], "cross_entropy").result()
        tc.optim_step(types.AdamParams()).result()
        sampler = tc.save_weights_and_get_sampling_client().result()
        prompt = types.ModelInput.from_ints([5, 6, 7, 8])
        out = sampler.sample(prompt, 2, types.SamplingParams(max_tokens=5, seed=1)).result()
        alice_session = sc._get_session_holder().get_session_id()
    with team_server.client(TEAM["bob"]) as sc:
        bob_sampler = sc.create_sampling_client(base_model=BASE_MODEL).result()
        bob_out = bob_sampler.sample(types.ModelInput.from_ints([9, 9]), 1, types.SamplingParams(max_tokens=3)).result()
        bob_session = sc._get_session_holder().get_session_id()
    sampled = sum(len(s.tokens) for s in out.sequences)
    assert usage_of(team_server, alice_session, since) == {
        "training": sent + batch[0].model_input.length, "sampling_prefill": 4, "sampling_sample": sampled,
        "checkpoint": 1}  # save_weights_and_get_sampling_client saved one
    assert usage_of(team_server, bob_session, since) == {
        "sampling_prefill": 2, "sampling_sample": len(bob_out.sequences[0].tokens)}
    report = admin(team_server).get_billing_usage(since, this_hour() + timedelta(hours=1)).result()
    mine = [e for e in report.data if e.session_id == alice_session]
    assert {e.user_id for e in mine} == {"tml:user:alice"} and {e.project_id for e in mine} == {"proj-usage"}
    assert {e.base_model for e in mine} == {BASE_MODEL} and all(e.estimated_cost_usd is None for e in mine)
    assert report.sessions[alice_session].user_metadata == {"run": "usage-test"}


def test_storage_is_what_is_on_disk_per_project_and_owner(team_server):
    with team_server.client(TEAM["bob"], project_id="proj-storage") as sc:
        tc = sc.create_lora_training_client(base_model=BASE_MODEL, rank=4).result()
        paths = [tc.save_state("s1").result().path, tc.save_weights_for_sampler("w1").result().path]
    usage = admin(team_server).get_current_checkpoint_storage_usage("proj-storage").result()
    (group,) = usage.data
    on_disk = sum(f.stat().st_size for p in paths for f in checkpoint_dir(team_server, p).iterdir())
    assert group.org_user_urn == "tml:user:bob" and group.user_name == "bob" and group.project_id == "proj-storage"
    assert group.checkpoint_count == 2 and group.size_bytes == on_disk and group.size_gigabytes == on_disk / 1e9
    assert group.estimated_monthly_cost_usd is None and usage.effective_rate_usd_per_gigabyte_month is None
    everyone = admin(team_server).get_current_checkpoint_storage_usage().result()
    assert group in everyone.data


def test_the_audit_log_records_who_did_what_to_which_checkpoint(team_server):
    rest = tinker.RestClient(base_url=team_server.base_url, api_key=TEAM["alice"])
    with team_server.client(TEAM["alice"], project_id="proj-audit-a") as sc:
        tc = sc.create_lora_training_client(base_model=BASE_MODEL, rank=4).result()
        path = tc.save_state("audited").result().path
        sampler_path = tc.save_weights_for_sampler("audited-w").result().path
        session = sc._get_session_holder().get_session_id()
        rest.publish_checkpoint_from_tinker_path(path).result()
        rest.unpublish_checkpoint_from_tinker_path(path).result()
        rest.set_checkpoint_ttl_from_tinker_path(path, 7200).result()
        run, kind, name = path.removeprefix("tinker://").split("/")
        archive = httpx.get(f"{team_server.base_url}/api/v1/training_runs/{run}/checkpoints/{kind}/{name}/archive",
                            headers={"X-API-Key": TEAM["alice"]}, timeout=60)
        assert archive.status_code == 200
        sc.create_training_client_from_state(path).result()
        sc.create_sampling_client(model_path=sampler_path).result()
        rest.assign_session_project(session, "proj-audit-b").result()
    rest.delete_checkpoint_from_tinker_path(sampler_path).result()
    log = admin(team_server).get_audit_log("checkpoints").result()
    events = [(e.event, e.event_details.get("purpose")) for e in log.entries if e.tinker_path == path]
    assert events == [("checkpoint_create", None), ("checkpoint_publish", None), ("checkpoint_unpublish", None),
                      ("checkpoint_ttl_set", None), ("checkpoint_read", "download"), ("checkpoint_read", "load")]
    sampler_events = [(e.event, e.purpose) for e in log.entries if e.tinker_path == sampler_path]
    assert sampler_events == [("checkpoint_create", None), ("checkpoint_read", "sample"), ("checkpoint_delete", None)]
    created = next(e for e in log.entries if e.tinker_path == path)
    assert created.event_details["actor"] == "tml:user:alice" and created.model_id == path.split("/")[2]
    moves = [e for e in admin(team_server).get_audit_log("projects").result().entries
             if e.event_details.get("session_id") == session]
    assert [(e.event, e.event_details["from_project"], e.event_details["to_project"]) for e in moves] == [
        ("project_session_assign", "proj-audit-a", "proj-audit-b")]
    yesterday = (datetime.now(timezone.utc) - timedelta(days=1)).date()
    assert not [e for e in admin(team_server).get_audit_log(day=yesterday).result().entries if e.tinker_path == path]


def test_the_dashboard_shows_usage_per_user(team_server):
    for who in ("alice", "bob"):
        with team_server.client(TEAM[who]) as sc:
            sampler = sc.create_sampling_client(base_model=BASE_MODEL).result()
            sampler.sample(types.ModelInput.from_ints([4, 4, 4]), 1, types.SamplingParams(max_tokens=2)).result()

    def rows(key: str) -> set[str]:
        page = httpx.get(f"{team_server.base_url}/dashboard", headers={"X-API-Key": key}, timeout=60).text
        return set(re.findall(r'<tr data-owner="([^"]+)">', page))

    assert rows(TEAM["bob"]) == {"bob"}  # one's own
    assert {"alice", "bob"} <= rows(TEAM["root"]) and "root" not in rows(TEAM["root"])  # every user's, for an admin
