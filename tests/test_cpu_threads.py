"""CPU threads (runtime/cpu_threads.py): how many `serve` gives torch, and start-up compute on a
passing thread that leaves no OpenMP team behind.

The team checks run in a fresh interpreter with 2 torch threads: libgomp's teams live as long as
the thread that made them, so the pytest process's own history must not count. A team of 2
threads is the thread itself plus one worker, which stays alive while its master thread lives.
The thread-count checks start real servers and read the count the server's runtime used (its
start-up log) and reports (/metrics); nothing here is timed.
"""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from hosted_tinker.runtime.cpu_threads import choose_threads, on_passing_thread, usable_cpus
from helpers import metric
from server_process import ServerProcess

SCRIPT = """
import json, sys, threading, time
import psutil, torch
from hosted_tinker.runtime.cpu_threads import on_passing_thread

torch.set_num_threads(2)
me = psutil.Process()

def parallel_work():
    x = torch.randn(512, 512)
    for _ in range(3):
        x = torch.tanh(x @ x) * 0.5 + torch.sigmoid(x)  # large enough for parallel regions
    return float(x.sum())

def threads_settle(target, limit_s=30.0):
    # A passing thread's team ends as the thread exits; its workers go shortly after: wait (bounded).
    end = time.monotonic() + limit_s
    while me.num_threads() > target and time.monotonic() < end:
        time.sleep(0.05)
    return me.num_threads()

before = me.num_threads()
on_passing_thread(parallel_work)
after_passing = threads_settle(before)
parallel_work()  # on this (the main) thread: its team stays
after_main = me.num_threads()
print(json.dumps({"before": before, "after_passing": after_passing, "after_main": after_main}))
"""


def test_a_passing_threads_team_ends_with_it_and_the_main_threads_stays():
    out = subprocess.run([sys.executable, "-c", SCRIPT], capture_output=True, text=True, timeout=120,
                         env={"PATH": "/usr/bin:/bin", "OMP_NUM_THREADS": "2", **_pythonpath()})
    assert out.returncode == 0, out.stderr[-2000:]
    counts = json.loads(out.stdout.strip().splitlines()[-1])
    assert counts["after_passing"] == counts["before"], counts  # nothing left by the passing thread
    assert counts["after_main"] == counts["before"] + 1, counts  # what the server's start-up used to leave


def test_results_and_errors_come_back_to_the_caller():
    assert on_passing_thread(lambda a, b=0: a + b, 2, b=3) == 5
    with pytest.raises(ValueError, match="bad"):
        on_passing_thread(_raise, ValueError("bad"))


def _raise(e: Exception) -> None:
    raise e


def _pythonpath() -> dict[str, str]:
    import os

    return {k: v for k, v in os.environ.items() if k in ("PYTHONPATH", "HOME", "VIRTUAL_ENV")}


def test_auto_keeps_one_cpu_for_the_server_and_honours_a_count_or_the_environment(tmp_path):
    assert choose_threads("auto", {}, cpus=2).threads == 1
    assert choose_threads("auto", {}, cpus=16).threads == 15
    assert choose_threads("auto", {}, cpus=1).threads == 1
    assert choose_threads("auto", {"OMP_NUM_THREADS": "3"}, cpus=16).threads == 3
    assert choose_threads("4", {"OMP_NUM_THREADS": "3"}, cpus=16).threads == 4
    (tmp_path / "cpu.max").write_text("150000 100000\n")  # a container given 1.5 CPUs
    assert usable_cpus(tmp_path) == 1
    (tmp_path / "cpu.max").write_text("max 100000\n")
    assert usable_cpus(tmp_path) == usable_cpus(tmp_path / "absent")


@pytest.mark.parametrize("args, expected", [
    ((), max(1, usable_cpus() - 1)),  # the default: auto
    (("--cpu-threads", "2"), 2),
], ids=["auto", "flag"])
def test_the_server_runs_torch_on_the_threads_chosen(tmp_path, args, expected):
    srv = ServerProcess(tmp_path, args=args, env={"OMP_NUM_THREADS": ""}).start()  # the test's own must not count
    try:
        assert metric(srv, "hosted_tinker_cpu_threads") == expected
        log = srv.log(tail=None)
        assert f"CPU threads: {expected} (" in log
        assert f"'threads': {expected}," in log  # what the runtime's fusion probes ran with, at start-up
    finally:
        srv.stop()
