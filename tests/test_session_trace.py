"""`export_session_trace` (issue 36): a Perfetto trace (`.pftrace`, protobuf TracePackets) of a session's
requests, each with its arrival, wait, the clock cycle it ran in (the cycle's other tenants counted, not
named) and its answer; `pending` while it builds, then a signed URL the SDK's plain GET downloads; only
the session's owner may export it.

Perfetto's own trace processor downloads a native binary at first use (no network here), so the test
decodes the file with Perfetto's own protobuf definitions (the `perfetto` package) instead."""

from __future__ import annotations

import os
import sqlite3
import subprocess
import sys
import urllib.request
from pathlib import Path

import httpx
import pytest
import tinker
from perfetto.protos.perfetto.trace.perfetto_trace_pb2 import Trace, TrackEvent
from tinker import types

from helpers import BASE_MODEL, TEAM, database, open_gate, sft_batch, wait_until, write_team_keys
from server_process import ServerProcess

pytestmark = pytest.mark.e2e
TINKER_CLI = str(Path(sys.executable).with_name("tinker"))


def traced_session(srv, who: str = "alice") -> tuple[str, dict[str, str]]:
    """A session with training and sampling requests; its id, and each of its requests' id -> kind (the
    futures the server recorded for its training model and sampling sessions)."""
    with srv.client(TEAM[who]) as sc:
        tc = sc.create_lora_training_client(base_model=BASE_MODEL, rank=4).result()
        fb = tc.forward_backward(sft_batch(2), "cross_entropy")
        opt = tc.optim_step(types.AdamParams())
        fb.result(), opt.result()
        sampler = tc.save_weights_and_get_sampling_client().result()
        sampler.sample(types.ModelInput.from_ints([3, 4, 5]), 2, types.SamplingParams(max_tokens=4)).result()
        session = sc._get_session_holder().get_session_id()
    with sqlite3.connect(database(srv.data_dir)) as db:
        rows = db.execute("SELECT request_id, kind FROM futures WHERE model_id LIKE ?", (f"{session}:%",)).fetchall()
    return session, dict(rows)


def slices(trace: bytes) -> list[tuple[str, dict]]:
    """(name, debug annotations) of every slice begin and instant in the trace, in time order."""
    packets = Trace.FromString(trace).packet
    times = [p.timestamp for p in packets if p.HasField("track_event")]
    assert times == sorted(times)
    return [(p.track_event.name, {a.name: a.string_value or a.int_value for a in p.track_event.debug_annotations})
            for p in packets if p.HasField("track_event") and p.track_event.type != TrackEvent.TYPE_SLICE_END]


def test_a_sessions_trace_shows_each_request_its_wait_cycle_and_answer(team_server):
    session, requests = traced_session(team_server)
    url = tinker.RestClient(base_url=team_server.base_url, api_key=TEAM["alice"]).export_session_trace(session).result()
    with urllib.request.urlopen(url) as answer:  # a plain GET, no headers: the URL is the permission
        trace = answer.read()
    events = slices(trace)
    outer = {notes["request_id"]: name.split(" #")[0] for name, notes in events if "request_id" in notes}
    assert outer == requests  # every request of the session, each as its kind
    assert sorted(outer.values()) == ["create_model", "forward_backward", "optim_step", "sample",
                                      "save_weights_for_sampler"]
    cycles = [notes for name, notes in events if name.startswith("cycle ")]
    assert cycles and all(notes["cycle"] >= 1 and notes["other_tenants"] >= 0 for notes in cycles)
    assert "wait" in [name for name, _ in events] and [n for n, _ in events].count("answered") == len(outer)
    assert any(name.startswith("generate (+") for name, _ in events)
    assert all("tml:user" not in name and "bob" not in name for name, _ in events)  # tenants counted, never named
    # Asked again with nothing new: the same trace, a fresh URL; bob may not export alice's session.
    again = tinker.RestClient(base_url=team_server.base_url, api_key=TEAM["alice"]).export_session_trace(
        session).result()
    assert again.split("?")[0] == url.split("?")[0]
    with pytest.raises(tinker.NotFoundError):
        tinker.RestClient(base_url=team_server.base_url, api_key=TEAM["bob"]).export_session_trace(session).result()


def test_a_trace_url_is_the_only_permission_and_only_while_valid(team_server):
    session, _ = traced_session(team_server, "bob")
    url = tinker.RestClient(base_url=team_server.base_url, api_key=TEAM["bob"]).export_session_trace(session).result()
    assert httpx.get(url, timeout=60).status_code == 200
    forged = url.replace("signature=", "signature=0")
    assert httpx.get(forged, timeout=60).status_code == 403
    longer = url.replace("expires=", "expires=9")  # a later expiry is not what was signed
    assert httpx.get(longer, timeout=60).status_code == 403
    unicode = url.replace("signature=", "signature=%C3%A9")  # not a hex digest at all: still a 403, not a 500
    assert httpx.get(unicode, timeout=60).status_code == 403


def test_the_cli_downloads_a_trace(team_server, tmp_path):
    session, _ = traced_session(team_server)
    env = {**os.environ, "TINKER_BASE_URL": team_server.base_url, "TINKER_API_KEY": TEAM["alice"],
           "TINKER_TELEMETRY": "0", "HOME": str(tmp_path)}
    out = subprocess.run([TINKER_CLI, "session", "export-trace", session, "--output", str(tmp_path / "t.pftrace")],
                         env=env, cwd=tmp_path, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stdout + out.stderr
    assert slices((tmp_path / "t.pftrace").read_bytes())


def test_an_export_is_pending_while_it_builds_and_failed_when_it_fails(tmp_path):
    gates = tmp_path / "gates"
    gates.mkdir()
    os.mkfifo(gates / "trace.build")
    keys = write_team_keys(tmp_path / "keys")
    srv = ServerProcess(tmp_path / "srv", args=("--api-keys-file", str(keys)), env={
        "HOSTED_TINKER_FAULTS": "trace.build:1,trace.build_fails@2:1", "HOSTED_TINKER_GATES": str(gates)})
    srv.start()
    try:
        session, _ = traced_session(srv)
        http = httpx.Client(base_url=srv.base_url, headers={"X-API-Key": TEAM["alice"]}, timeout=60)
        with http:
            poll = f"/api/v1/sessions/{session}/trace_export"
            assert http.get(poll).json()["status"] == "pending"  # its build waits at the gate
            assert http.get(poll).json()["status"] == "pending"  # the same build, not a second one
            open_gate(gates / "trace.build").close()  # the build waits there: let it go on
            ready = wait_until(lambda: (r := http.get(poll).json())["status"] == "ready" and r, "the trace built")
            assert httpx.get(ready["url"], timeout=60).status_code == 200
        other, _ = traced_session(srv)  # the second build fails (trace.build_fails@2): the SDK raises, once
        rest = tinker.RestClient(base_url=srv.base_url, api_key=TEAM["alice"])
        with pytest.raises(RuntimeError, match="Trace export failed .*InjectedFault"):
            rest.export_session_trace(other).result()
        assert rest.export_session_trace(other).result()  # asked again: built anew
    finally:
        srv.stop()
