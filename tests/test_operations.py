"""Operations (issues 6 and 15): request ids and refusal reasons in logs, one log format (or JSON),
/health and /version, Prometheus metrics with histograms, graceful shutdown, and clear answers for
what exists only on the hosted Tinker service."""

from __future__ import annotations

import json
import re
import signal
import sqlite3

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families
from tinker import types

from helpers import BASE_MODEL, database, sft_batch
from server_process import ServerProcess

pytestmark = pytest.mark.e2e


def test_request_ids_are_echoed_and_logged(server):
    r = httpx.post(f"{server.base_url}/api/v1/create_session", json={"tags": []},
                   headers={"X-API-Key": "tml-ops", "X-Request-ID": "trace-me-123"}, timeout=60)
    assert r.status_code == 200 and r.headers["x-request-id"] == "trace-me-123"
    generated = httpx.get(f"{server.base_url}/api/v1/healthz", timeout=60).headers["x-request-id"]
    assert re.fullmatch(r"[0-9a-f]{16}", generated)
    log = server.log_path.read_text()
    assert re.search(r"request_id=trace-me-123 method=POST route=/api/v1/create_session status=200", log)
    assert "tml-ops" not in log


def test_metrics_are_prometheus_text(server, service_client):
    tc = service_client.create_lora_training_client(base_model=BASE_MODEL, rank=4).result()
    tc.forward_backward(sft_batch(2), "cross_entropy").result()
    text = httpx.get(f"{server.base_url}/metrics", timeout=60).text
    for name in ("hosted_tinker_http_requests_total", "hosted_tinker_cycles_total", "hosted_tinker_queue_depth",
                 "hosted_tinker_last_cycle_seconds", "hosted_tinker_last_fused_pass_tokens",
                 "hosted_tinker_live_adapters", "hosted_tinker_process_max_rss_bytes"):
        assert re.search(rf"^# TYPE {name} (counter|gauge)$", text, re.M), name
        assert re.search(rf"^{name}(\{{[^}}]*\}})? [0-9.e+-]+$", text, re.M), name
    assert re.search(r'^hosted_tinker_http_requests_total\{route="/api/v1/forward_backward",status="200"\} \d+',
                     text, re.M)


def test_refusals_are_logged_with_their_reason_and_request_id(server):
    r = httpx.post(f"{server.base_url}/api/v1/asample", json={"num_samples": 1},
                   headers={"X-API-Key": "tml-ops", "X-Request-ID": "refused-1"}, timeout=60)
    assert r.status_code == 422
    r = httpx.post(f"{server.base_url}/v1/completions", json={"model": "no-such-model", "prompt": "hi"},
                   headers={"Authorization": "Bearer tml-ops", "X-Request-ID": "refused-2"}, timeout=60)
    assert r.status_code == 404  # an OpenAI-shaped error body: its error.message is the reason
    log = server.log_path.read_text()
    line = re.search(r"request_id=refused-1 method=POST route=/api/v1/asample status=422 ms=[0-9.]+ reason=(.*)", log)
    assert line and "sampling_params" in json.loads(line.group(1))
    line = re.search(r"request_id=refused-2 method=POST route=/v1/completions status=404 ms=[0-9.]+ reason=(.*)", log)
    assert line and "no-such-model" in json.loads(line.group(1))


def test_server_and_uvicorn_records_share_one_format(server):
    log = server.log_path.read_text()
    record = r"\d{4}-\d\d-\d\d \d\d:\d\d:\d\d,\d{3} (DEBUG|INFO|WARNING|ERROR|CRITICAL) [\w.]+: "
    assert re.search(rf"^{record}Application startup complete\.$", log, re.M)  # uvicorn's
    assert re.search(rf"^{record}hosted-tinker 0\.1\.0 ready at {re.escape(server.base_url)}$", log, re.M)  # ours


def test_health_and_version_as_vllm_serves_them(server):
    health = httpx.get(f"{server.base_url}/health", timeout=60)
    assert health.status_code == 200 and health.content == b""
    assert httpx.get(f"{server.base_url}/version", timeout=60).json() == {"version": "0.1.0"}


def test_metrics_parse_with_histograms_for_requests_cycles_and_sampling(server, service_client):
    tc = service_client.create_lora_training_client(base_model=BASE_MODEL, rank=4).result()
    tc.forward_backward(sft_batch(2), "cross_entropy").result()
    tc.optim_step(types.AdamParams()).result()
    sampler = tc.save_weights_and_get_sampling_client().result()
    sampler.sample(types.ModelInput.from_ints([1, 2, 3]), 2,
                   types.SamplingParams(max_tokens=4, stop=[], temperature=1.0)).result()
    text = httpx.get(f"{server.base_url}/metrics", timeout=60).text
    families = {f.name: f for f in text_string_to_metric_families(text)}

    def count(family: str, **labels) -> float:
        f = families[family]
        assert f.type == "histogram", family
        return sum(s.value for s in f.samples
                   if s.name == f"{family}_count" and all(s.labels.get(k) == v for k, v in labels.items()))

    assert count("hosted_tinker_http_request_duration_seconds", route="/api/v1/forward_backward") >= 1
    assert count("hosted_tinker_queue_wait_seconds", kind="forward_backward") >= 1
    assert count("hosted_tinker_queue_wait_seconds", kind="optim_step") >= 1
    assert count("hosted_tinker_cycle_duration_seconds") >= 1
    assert count("hosted_tinker_fused_pass_tokens") >= 1 and count("hosted_tinker_fused_pass_models") >= 1
    assert count("hosted_tinker_sampling_time_to_first_token_seconds") >= 1
    assert count("hosted_tinker_sampling_tokens_per_second") >= 1
    for counter in ("hosted_tinker_sample_requests", "hosted_tinker_sampled_tokens",
                    "hosted_tinker_sampler_weight_syncs", "hosted_tinker_http_requests", "hosted_tinker_cycles"):
        assert families[counter].type == "counter", counter
        assert sum(s.value for s in families[counter].samples) >= 1, counter
    assert families["hosted_tinker_queue_depth"].type == "gauge"


def test_json_logs_hold_every_record_uvicorns_included(tmp_path):
    srv = ServerProcess(tmp_path / "srv", args=("--log-format", "json")).start()
    try:
        httpx.post(f"{srv.base_url}/api/v1/asample", json={}, headers={"X-API-Key": "tml-ops",
                                                                      "X-Request-ID": "json-refused"}, timeout=60)
    finally:
        srv.stop()
    records = [json.loads(line) for line in srv.log_path.read_text().splitlines() if line.strip()]
    assert {"time", "level", "logger", "message"} <= set(records[0])
    assert any(r["logger"] == "uvicorn.error" and r["message"] == "Application startup complete." for r in records)
    refused = [r for r in records if r.get("request_id") == "json-refused"]
    assert len(refused) == 1 and refused[0]["status"] == 422 and refused[0]["route"] == "/api/v1/asample"
    assert refused[0]["reason"].startswith("invalid request")


def test_sigterm_finishes_work_and_exits_cleanly(tmp_path):
    srv = ServerProcess(tmp_path / "srv").start()
    sc = srv.client("tml-ops")
    tc = sc.create_lora_training_client(base_model=BASE_MODEL, rank=4).result()
    tc.forward_backward(sft_batch(4), "cross_entropy").result()
    tc.optim_step(types.AdamParams()).result()
    path = tc.save_state("before-shutdown").result().path
    srv.proc.send_signal(signal.SIGTERM)
    # uvicorn shuts down gracefully, then re-raises the signal it caught: -SIGTERM is a clean exit
    assert srv.proc.wait(90) in (0, -signal.SIGTERM)
    log = srv.log_path.read_text()
    assert "shutting down: finishing the running cycle" in log and "Application shutdown complete" in log
    with sqlite3.connect(database(srv.data_dir)) as db:
        assert db.execute("PRAGMA integrity_check").fetchone()[0] == "ok"
        assert db.execute("SELECT COUNT(*) FROM futures WHERE status='pending'").fetchone()[0] == 0
    srv.start()
    try:
        sc2 = srv.client("tml-ops")
        sc2.create_training_client_from_state_with_optimizer(path).result()
    finally:
        srv.stop()
