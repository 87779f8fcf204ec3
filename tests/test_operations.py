"""Operations (issue 6): request ids in logs, Prometheus metrics, graceful shutdown."""

from __future__ import annotations

import re
import signal
import sqlite3

import httpx
import pytest
import tinker
from tinker import types

from helpers import BASE_MODEL, database, sft_batch
from server_process import ServerProcess

pytestmark = pytest.mark.e2e


def test_request_ids_are_echoed_and_logged(server):
    r = httpx.post(f"{server.base_url}/api/v1/create_session", json={"tags": []},
                   headers={"X-API-Key": "tml-ops", "X-Request-ID": "trace-me-123"}, timeout=10)
    assert r.status_code == 200 and r.headers["x-request-id"] == "trace-me-123"
    generated = httpx.get(f"{server.base_url}/api/v1/healthz", timeout=10).headers["x-request-id"]
    assert re.fullmatch(r"[0-9a-f]{16}", generated)
    log = server.log_path.read_text()
    assert re.search(r"request_id=trace-me-123 method=POST route=/api/v1/create_session status=200", log)
    assert "tml-ops" not in log


def test_metrics_are_prometheus_text(server, service_client):
    tc = service_client.create_lora_training_client(base_model=BASE_MODEL, rank=4).result()
    tc.forward_backward(sft_batch(2), "cross_entropy").result()
    text = httpx.get(f"{server.base_url}/metrics", timeout=10).text
    for name in ("hosted_tinker_http_requests_total", "hosted_tinker_cycles_total", "hosted_tinker_queue_depth",
                 "hosted_tinker_last_cycle_seconds", "hosted_tinker_last_fused_pass_tokens",
                 "hosted_tinker_live_adapters", "hosted_tinker_process_max_rss_bytes"):
        assert re.search(rf"^# TYPE {name} (counter|gauge)$", text, re.M), name
        assert re.search(rf"^{name}(\{{[^}}]*\}})? [0-9.e+-]+$", text, re.M), name
    assert re.search(r'^hosted_tinker_http_requests_total\{route="/api/v1/forward_backward",status="200"\} \d+',
                     text, re.M)


def test_sigterm_finishes_work_and_exits_cleanly(tmp_path):
    srv = ServerProcess(tmp_path / "srv").start()
    sc = tinker.ServiceClient(base_url=srv.base_url, api_key="tml-ops")
    tc = sc.create_lora_training_client(base_model=BASE_MODEL, rank=4).result()
    tc.forward_backward(sft_batch(4), "cross_entropy").result()
    tc.optim_step(types.AdamParams()).result()
    path = tc.save_state("before-shutdown").result().path
    srv.proc.send_signal(signal.SIGTERM)
    # uvicorn shuts down gracefully, then re-raises the signal it caught: -SIGTERM is a clean exit
    assert srv.proc.wait(90) in (0, -signal.SIGTERM)
    log = srv.log_path.read_text()
    assert "shutting down: finishing the running cycle" in log and "Application shutdown complete" in log
    with sqlite3.connect(database(srv)) as db:
        assert db.execute("PRAGMA integrity_check").fetchone()[0] == "ok"
        assert db.execute("SELECT COUNT(*) FROM futures WHERE status='pending'").fetchone()[0] == 0
    srv.start()
    try:
        sc2 = tinker.ServiceClient(base_url=srv.base_url, api_key="tml-ops")
        sc2.create_training_client_from_state_with_optimizer(path).result()
    finally:
        srv.stop()
