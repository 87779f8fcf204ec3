"""The leak guard that conftest.py runs after every module and after the session (leak_guard.py),
and ServerProcess closing its clients: what they rely on, checked against the real SDK."""

from __future__ import annotations

import signal
import subprocess
import sys

import psutil
import pytest
import tinker

import leak_guard
from hosted_tinker.accounts.auth import anonymous_owner
from hosted_tinker.accounts.tokens import user_urn
from helpers import BASE_MODEL
from server_process import ServerProcess

pytestmark = pytest.mark.e2e


def test_an_open_sdk_client_is_seen_until_it_is_closed(server):
    before = set(leak_guard.open_sdk_sessions())
    sc = server.client("tml-leak-guard")
    sc.create_sampling_client(base_model=BASE_MODEL).result()  # the client's session (and heartbeat) starts
    assert len(set(leak_guard.open_sdk_sessions()) - before) == 1
    sc.close("success").result()
    assert set(leak_guard.open_sdk_sessions()) == before


def _whoami_from_environment(server, monkeypatch, key: str) -> str:
    """Who `RestClient(base_url=...)` acts as with $TINKER_API_KEY=key: how the cookbook makes one."""
    monkeypatch.setenv("TINKER_API_KEY", key)
    return tinker.RestClient(base_url=server.base_url).whoami().result().user_urn


def test_a_rest_client_from_the_environment_is_left_behind(server, monkeypatch):
    """This test leaves the SDK's cached client of the shared server keyed by $TINKER_API_KEY=first;
    the next test sets another key (in the full suite, test_isolation_matrix's weights.download as
    bob came before test_rest_client's as alice, whose export then answered 404)."""
    assert _whoami_from_environment(server, monkeypatch, "tml-env-first") == user_urn(anonymous_owner("tml-env-first"))


def test_the_next_test_acts_as_its_own_tinker_api_key(server, monkeypatch):
    assert _whoami_from_environment(server, monkeypatch, "tml-env-next") == user_urn(anonymous_owner("tml-env-next"))


def test_a_server_process_is_told_from_other_children():
    pretend = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)", "hosted_tinker", "serve"])
    other = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"])
    try:
        children = {p.pid: p for p in leak_guard.child_processes()}
        assert leak_guard.is_server(children[pretend.pid]) and not leak_guard.is_server(children[other.pid])
    finally:
        leak_guard.end([children[pretend.pid], children[other.pid]])
    assert pretend.wait(30) is not None and other.wait(30) is not None


def test_stop_releases_the_clients_of_a_server_that_was_killed(tmp_path):
    """A client of a server killed for good cannot finish its session; stop() still ends its
    heartbeat, at once (SDK's close() would retry finishing the session for five minutes)."""
    srv = ServerProcess(tmp_path / "srv").start()
    before = set(leak_guard.open_sdk_sessions())
    try:
        srv.client("tml-leak-guard").create_sampling_client(base_model=BASE_MODEL).result()
        assert len(set(leak_guard.open_sdk_sessions()) - before) == 1
        srv.kill9()
    finally:
        srv.stop()
    assert set(leak_guard.open_sdk_sessions()) == before


def test_multiprocessings_resource_tracker_is_not_a_leak():
    """The interpreter's own resource tracker (started by the first SharedMemory, e.g. in
    test_vllm_sidecar.py) lives until the interpreter exits: the session guard once failed a
    green run on it."""
    from multiprocessing import resource_tracker

    resource_tracker.ensure_running()
    tracker_pid = resource_tracker._resource_tracker._pid  # noqa: SLF001 (no public accessor)
    assert tracker_pid is not None
    assert tracker_pid not in {p.pid for p in leak_guard.child_processes()}


# -- servers forked from the pre-imported parent (server_process._forked_start) ---------------------

def test_a_forked_server_is_a_server_and_its_fork_parent_is_nobodys_leak(tmp_path):
    from multiprocessing import forkserver

    srv = ServerProcess(tmp_path / "srv")
    assert srv.forked
    srv.start()
    try:
        children = {p.pid: p for p in leak_guard.child_processes()}
        assert leak_guard.is_server(children[srv.proc.pid])
        parent = psutil.Process(forkserver._forkserver._forkserver_pid)
        assert leak_guard.is_fork_server(parent) and parent.pid not in children
        assert parent.pid in {p.ppid() for p in children.values()}  # the server is the parent's child
    finally:
        srv.stop()


def test_a_forked_server_reads_its_own_settings_and_dies_by_kill9_as_a_process(tmp_path):
    srv = ServerProcess(tmp_path / "srv", env={"HOSTED_TINKER_MAX_NUM_SAMPLES": "7"})
    assert srv.forked
    srv.start()
    try:
        assert "7 samples per request" in srv.log(tail=None)  # the start-up summary of its limits
        srv.kill9()
        assert srv.proc.returncode == -signal.SIGKILL and not srv.alive()
    finally:
        srv.stop()


def test_a_server_is_forked_only_where_the_parent_can_stand_for_it(tmp_path):
    """Variables read at import time (torch's, the hub's) and other checkouts or wrapped commands
    get the real command line."""
    assert ServerProcess(tmp_path, env={"HOSTED_TINKER_MAX_QUERY_S": "3"}).forked
    assert ServerProcess(tmp_path, env={"HOSTED_TINKER_FAULTS": "after_forward_backward:1"}).forked
    assert not ServerProcess(tmp_path, env={"ATEN_CPU_CAPABILITY": "default"}).forked
    assert not ServerProcess(tmp_path, env={"HF_HUB_OFFLINE": "1"}).forked
    assert not ServerProcess(tmp_path, wrap=lambda cmd: cmd).forked
    assert not ServerProcess(tmp_path, checkout=tmp_path).forked
