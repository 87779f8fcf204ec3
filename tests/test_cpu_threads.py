"""Start-up compute on a passing thread leaves no OpenMP team behind (runtime/cpu_threads.py).

Each check runs in a fresh interpreter with 2 torch threads: libgomp's teams live as long as the
thread that made them, so the pytest process's own history must not count. A team of 2 threads
is the thread itself plus one worker, which stays alive while its master thread lives.
"""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from hosted_tinker.runtime.cpu_threads import on_passing_thread

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
