"""Usage is exact across a restart (issue 36): what a session sent and sampled is what it is charged, counted
in memory, written with the cycles' records and once more at a graceful stop, and read back after the
server starts again (the audit log too); with a rate card, costs follow the SDK's formulas."""

from __future__ import annotations

from datetime import datetime, timedelta, timezone

import pytest
import tinker
from tinker import types

from helpers import BASE_MODEL, TEAM, sft_batch, write_team_keys
from server_process import ServerProcess

pytestmark = pytest.mark.e2e

RATES = {"training": 0.4, "sampling_prefill": 0.2, "sampling_sample": 0.6}
STORAGE_RATE = 0.02


def work(srv, seed: int) -> tuple[str, dict[str, int]]:
    """One session's training and sampling; (its id, the tokens it sent and got back, by kind)."""
    batch = sft_batch(4, seed=seed)
    with srv.client(TEAM["alice"], project_id="proj-restart") as sc:
        tc = sc.create_lora_training_client(base_model=BASE_MODEL, rank=4).result()
        tc.forward_backward(batch, "cross_entropy").result()
        tc.optim_step(types.AdamParams()).result()
        sampler = sc.create_sampling_client(base_model=BASE_MODEL).result()
        prompt = types.ModelInput.from_ints(list(range(3, 3 + seed)))
        out = sampler.sample(prompt, 3, types.SamplingParams(max_tokens=6, seed=seed)).result()
        tc.save_state(f"restart-{seed}").result()
        session = sc._get_session_holder().get_session_id()
    return session, {"training": sum(d.model_input.length for d in batch), "sampling_prefill": seed,
                     "sampling_sample": sum(len(s.tokens) for s in out.sequences), "checkpoint": 1}


def charged(srv, since: datetime) -> tuple[dict[str, dict[str, int]], list]:
    """Per session, the quantity of each kind; and every event."""
    hour = datetime.now(timezone.utc).replace(minute=0, second=0, microsecond=0) + timedelta(hours=1)
    report = tinker.AdminClient(base_url=srv.base_url, api_key=TEAM["root"]).get_billing_usage(since, hour).result()
    out: dict[str, dict[str, int]] = {}
    for e in report.data:
        if e.session_id is not None:
            kinds = out.setdefault(e.session_id, {})
            info = e.event_info
            kinds[info.type] = kinds.get(info.type, 0) + (info.count if info.type == "checkpoint" else info.token_count)
    return out, report.data


def test_usage_equals_what_was_sent_and_sampled_across_a_restart(tmp_path):
    since = datetime.now(timezone.utc).replace(minute=0, second=0, microsecond=0)
    keys = write_team_keys(tmp_path / "keys")
    card = tmp_path / "rates.yaml"
    card.write_text(f"models: {{'*': {RATES}}}\nstorage_usd_per_gigabyte_month: {STORAGE_RATE}\n")
    srv = ServerProcess(tmp_path / "srv", args=("--api-keys-file", str(keys), "--admin-users", "root",
                                                "--rate-card", str(card))).start()
    try:
        first, sent_first = work(srv, 5)
        srv.restart()  # SIGTERM: the last cycle and the counts still in memory are written before it exits
        before, _ = charged(srv, since)
        assert before[first] == sent_first
        audit = tinker.AdminClient(base_url=srv.base_url, api_key=TEAM["root"]).get_audit_log().result()
        assert [e.tinker_path for e in audit.entries if e.event == "checkpoint_create"] == [
            f"tinker://{first}:train:0/weights/restart-5"]  # the audit log survives the restart too
        second, sent_second = work(srv, 7)
        after, events = charged(srv, since)
        assert after[first] == sent_first and after[second] == sent_second
    finally:
        srv.stop()
    for e in events:
        info = e.event_info
        if info.type in RATES:
            assert e.effective_rate_usd_per_million_tokens == RATES[info.type]
            assert e.estimated_cost_usd == RATES[info.type] * info.token_count / 1_000_000
        elif info.type == "storage":
            assert e.session_id is None and e.project_id == "proj-restart" and info.gigabyte_hours > 0
            assert e.effective_rate_usd_per_gigabyte_month == STORAGE_RATE
            assert e.estimated_cost_usd == STORAGE_RATE * info.gigabyte_hours / 720
        else:
            assert info.type == "checkpoint" and e.estimated_cost_usd is None
    assert {e.event_info.type for e in events} == {*RATES, "storage", "checkpoint"}
