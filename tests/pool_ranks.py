"""A worker pool's ranks as processes, for tests that kill one (tests/test_worker_pool.py,
tests/test_pool_two_machines.py)."""

from __future__ import annotations

import signal
from collections.abc import Callable
from typing import Any

import psutil

from helpers import wait_until

# What rank 0 logs when a command finds a rank gone as it goes out (runtime/distributed.py), and
# part of it: the collective's error (rank_group.py), which a pool that fails the pass logs too.
GONE = "a rank was gone before this command went out"
NOT_SENT = "sending a command to the pool failed"


def torchrun_of(pid: int) -> psutil.Process:
    """The torchrun that runs a machine's ranks: `pid` itself (a `pool-node`, which became torchrun),
    or the child of `pid` (the server) that is one."""
    proc = psutil.Process(pid)
    if "torch.distributed.run" in proc.cmdline():
        return proc
    return wait_until(lambda: next((p for p in proc.children() if "torch.distributed.run" in p.cmdline()), None),
                      "the server's torchrun runs")


def rank_of(torchrun: psutil.Process) -> psutil.Process:
    """The (live) rank that torchrun runs, once it runs one."""
    def find():
        return next((p for p in torchrun.children(recursive=True)
                     if p.status() != psutil.STATUS_ZOMBIE and "hosted_tinker.runtime.pool_worker" in p.cmdline()),
                    None)
    return wait_until(find, "torchrun runs a rank")


def kill_rank_before_sending(torchrun: psutil.Process, send: Callable[[], Any], server_log: Callable[[], str]) -> Any:
    """Kill torchrun's rank while the pool is idle, then `send()` a request whose pass goes to the
    pool (returns what it returns). Torchrun is held (SIGSTOP) meanwhile, so that neither its exit
    nor a restarted rank tells rank 0: rank 0 can learn of the death only from the rank's closed
    socket as the pass goes out. Torchrun goes on once rank 0 has logged that it could not send."""
    rank, seen = rank_of(torchrun), server_log().count(NOT_SENT)
    torchrun.send_signal(signal.SIGSTOP)
    try:
        rank.kill()
        sent = send()
        wait_until(lambda: server_log().count(NOT_SENT) > seen, "rank 0 finds the rank gone as the pass goes out")
    finally:
        torchrun.send_signal(signal.SIGCONT)
    return sent
