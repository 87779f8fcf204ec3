"""Starting the worker pool's ranks: their settings, the rendezvous store, torchrun.

Rank 0 is the server process itself (it answers HTTP and holds the pool's state); the other
ranks are processes started by torchrun, one per device:

- on the server's machine, `hosted-tinker serve --workers N` starts torchrun for ranks 1..N-1;
- on each other machine, `hosted-tinker pool-node --nnodes M --node-rank K --master-addr A
  --master-port P --workers N` (pool_node.py) starts torchrun for ranks K*N..K*N+N-1.

torchrun runs standalone on every machine (its own rendezvous, `--standalone`): it starts and
watches that machine's ranks, and on other machines restarts them when they exit. The pool's
own rendezvous is a TCPStore that rank 0 keeps at --master-addr:--master-port: every rank reads
the settings there and joins the current epoch's process group (rank_group.py). Why not one
torchrun job over all machines: when any rank fails torchrun restarts every rank of its job,
rank 0 included, and rank 0 is the server, whose clients, futures and adapters must outlive a
rank's death.

Forming an epoch's group has one deadline, `--pool-timeout-s` from its start: the ranks coming
(each publishes the address it advertises, pool_address.py, before it says it is ready; a machine
whose ranks cannot work says why, under `PROBLEM`), then their group connecting (on a thread the
server stops waiting for at the deadline: gloo's own connection waits run several times the
timeout they are given).
"""

from __future__ import annotations

import datetime
import ipaddress
import json
import logging
import os
import secrets
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.distributed as dist

from .pool_address import Advertised, address_problem, advertised_address, loopback_line, use_interface
from .rank_group import PoolBroken, RankGroup
from .store_json import StoreJson

log = logging.getLogger(__name__)

WORKER_MODULE = "hosted_tinker.runtime.pool_worker"
# Keys of the pool's store (rank 0's TCPStore); an epoch's group keys live under "<id>/epoch<N>/".
POOL_ID, SETTINGS, EPOCH, REJOIN = "pool/id", "pool/settings", "pool/epoch", "pool/rejoin"
PROBLEM = "pool/problem/"  # + machine: why its ranks cannot join (JSON: the epoch it was written in, the line)
# Per epoch: the address rank N advertises (+ N), ranks about to join, the group has formed.
ADDRESS, READY, FORMED = "address/", "ready", "formed"
# A restarted rank on another machine that finds its epoch formed without it waits this long for
# rank 0 to open the next one before it gives up (torchrun then starts it again).
REJOIN_WAIT_S = 600.0


@dataclass(frozen=True)
class PoolSettings(StoreJson):
    """What every rank must agree on; rank 0 publishes it in the store, the others read it there."""

    base_model: str
    dtype: str  # the --dtype setting (auto resolves per device type)
    device_type: str  # "cpu" | "cuda": gloo or NCCL
    workers: int  # ranks per machine
    nnodes: int  # machines
    shard_base: bool
    max_tokens_per_micro_batch: int
    max_live_adapters: int
    timeout_s: float  # collectives and joins
    threads: int  # CPU threads per rank; 0 = torch's default (GPU ranks)
    recompute: bool = False  # activation checkpointing (runtime/recompute.py)
    log_level: str = "info"
    log_format: str = "text"
    interface: str = ""  # --pool-interface: every rank's GLOO_SOCKET_IFNAME / NCCL_SOCKET_IFNAME

    @property
    def world(self) -> int:
        return self.workers * self.nnodes

    def rank_of(self, node_rank: int, local_rank: int) -> int:
        """Global rank of torchrun's `local_rank` on machine `node_rank` (rank 0, the server, is
        the first device of machine 0, so its torchrun starts at rank 1)."""
        return node_rank * self.workers + local_rank + (1 if node_rank == 0 else 0)

    def machine_of(self, rank: int) -> int:
        return rank // self.workers

    def device_of(self, node_rank: int, local_rank: int) -> torch.device:
        if self.device_type == "cpu":
            return torch.device("cpu")
        return torch.device(self.device_type, local_rank + (1 if node_rank == 0 else 0))


def cpu_threads_per_rank(ranks_on_this_machine: int) -> int:
    """Ranks on one machine share its cores; more threads than cores slows every rank down."""
    return max(1, (os.cpu_count() or 1) // ranks_on_this_machine)


def spans_machines(nnodes: int, master_addr: str) -> bool:
    """Ranks on other machines: more than one, and a rendezvous address they reach from elsewhere
    (a loopback one means every "machine" is this one, as in tests)."""
    if nnodes < 2:
        return False
    try:
        return not any(ipaddress.ip_address(info[4][0]).is_loopback
                       for info in socket.getaddrinfo(master_addr, None, type=socket.SOCK_STREAM))
    except socket.gaierror:
        return True


def epoch_formed(store: dist.Store, pool_id: str, epoch: int) -> bool:
    return store.check([f"{pool_id}/epoch{epoch}/{FORMED}"])


def torchrun_command(nproc: int, worker_args: list[str], *, max_restarts: int) -> list[str]:
    # --local-addr: torchrun's own rendezvous (one machine, --standalone) on loopback; by default it
    # advertises the hostname, and a machine whose hostname does not resolve could start no rank.
    return [sys.executable, "-m", "torch.distributed.run", "--standalone", "--local-addr", "127.0.0.1",
            "--nnodes", "1", "--nproc-per-node", str(nproc), "--max-restarts", str(max_restarts),
            "-m", WORKER_MODULE, *worker_args]


class LocalRanks:
    """This machine's other ranks: one torchrun job, started by rank 0 for one epoch."""

    def __init__(self, nproc: int, worker_args: list[str], threads: int):
        env = {**os.environ, "OMP_NUM_THREADS": str(threads or 1)}
        # No restarts: rank 0 notices a dead rank (a failed collective, or this job's exit) and
        # starts the next epoch with a new job.
        self.proc = subprocess.Popen(torchrun_command(nproc, worker_args, max_restarts=0), env=env,
                                     start_new_session=True)  # rank 0 stops it itself, after telling it

    def alive(self) -> bool:
        return self.proc.poll() is None

    def stop(self, grace_s: float = 5.0, timeout_s: float = 30.0) -> None:
        """Let it end (its ranks exit once told to stop, or once their group is gone), else
        SIGTERM (torchrun then stops its ranks), else SIGKILL."""
        for ask in (None, signal.SIGTERM, signal.SIGKILL):
            if ask is not None:
                self.proc.send_signal(ask)
            try:
                self.proc.wait(grace_s if ask is None else timeout_s)
                return
            except subprocess.TimeoutExpired:
                continue


class PoolUnavailable(RuntimeError):
    """The pool's ranks could not be (re)started; the message (one line) says why."""


class RankPool:
    """Rank 0's side of the pool: the store, this machine's other ranks, the current epoch's group."""

    def __init__(self, settings: PoolSettings, *, master_addr: str, master_port: int, device: torch.device,
                 data_dir: Path):
        if dist.is_initialized():
            raise PoolUnavailable("this process already runs a worker pool: torch.distributed has one default "
                                  "process group per process, so a server has at most one pool")
        if device.type == "cuda":
            # An NCCL error or timeout must fail rank 0's collective, not end the process (torch's
            # default, 3, tears the process down): rank 0 is the server. 2 = abort the communicators
            # and raise in the waiting call. Read when the NCCL group is created.
            os.environ.setdefault("TORCH_NCCL_ASYNC_ERROR_HANDLING", "2")
        if settings.interface:  # this process's gloo and NCCL, and this machine's other ranks (inherited)
            use_interface(settings.interface)
        self.settings = settings
        self.master_addr = master_addr
        self.device = device
        self.data_dir = data_dir
        self.spans_machines = spans_machines(settings.nnodes, master_addr)
        problem = address_problem("rank 0", "--pool-interface", multi_machine=self.spans_machines)
        if problem:  # preflight checked this; a machine whose network changed since is refused here
            raise PoolUnavailable(problem)
        self.address = advertised_address()
        log.info("worker pool: rank 0 advertises %s", self.address)
        self.store = dist.TCPStore(master_addr, master_port, None, True, wait_for_workers=False,
                                   timeout=datetime.timedelta(seconds=settings.timeout_s))
        self.master_port = self.store.port
        self.pool_id = secrets.token_hex(6)
        self.store.set(POOL_ID, self.pool_id)
        self.store.set(SETTINGS, settings.to_json())
        self.epoch = 0
        self.group: RankGroup | None = None
        self.local: LocalRanks | None = None
        self._rejoins_seen = 0
        self._joining: GroupJoin | None = None  # the last epoch's join, while it may still run

    def prefix(self, epoch: int) -> str:
        return f"{self.pool_id}/epoch{epoch}/"

    def healthy(self) -> bool:
        """The group has not failed, this machine's ranks are running, and no rank of another
        machine came back asking for a new epoch (cheap: called before every pass)."""
        return (self.group is not None and not self.group.broken
                and (self.local is None or self.local.alive())
                and self.store.add(REJOIN, 0) == self._rejoins_seen)

    def start(self) -> RankGroup:
        """Open the next epoch: stop what is left of the last one, start this machine's ranks, wait
        until every rank has joined; all of it within `timeout_s` (else `PoolUnavailable`)."""
        deadline = time.monotonic() + self.settings.timeout_s
        self._stop_epoch()
        self.epoch += 1
        prefix = self.prefix(self.epoch)
        self.store.set(EPOCH, str(self.epoch))
        s = self.settings
        if s.workers > 1:
            self.local = LocalRanks(s.workers - 1, [
                "--master-addr", self.master_addr, "--master-port", str(self.master_port), "--node-rank", "0",
                "--data-dir", str(self.data_dir), "--pool-id", self.pool_id, "--epoch", str(self.epoch)], s.threads)
        try:
            addresses = self._wait_for_ranks(prefix, deadline)
            self.group = self._join(prefix, addresses, deadline)
        except PoolUnavailable:
            self._stop_epoch()
            raise
        self.store.set(prefix + FORMED, "1")
        self._rejoins_seen = self.store.add(REJOIN, 0)
        log.info("worker pool epoch %d: %d rank(s) on %d machine(s) joined (%s)", self.epoch, s.world, s.nnodes,
                 "NCCL" if self.device.type == "cuda" else "gloo")
        return self.group

    def _wait_for_ranks(self, prefix: str, deadline: float) -> dict[int, Advertised]:
        """Until every other rank is ready to join (they load the model first); the address each
        advertises. A machine that reports why its ranks cannot come, a rank of this machine
        that exited, a rank advertising loopback to other machines, or the deadline ends it."""
        s = self.settings
        while self.store.add(prefix + READY, 0) < s.world - 1:
            if self.local is not None and not self.local.alive():
                raise PoolUnavailable(f"a rank of this machine exited (status {self.local.proc.returncode}) before "
                                      "the pool formed; its log above says why")
            problem = self._reported_problem()
            if problem is not None:
                raise PoolUnavailable(problem)
            if time.monotonic() > deadline:
                raise PoolUnavailable(self._missing_ranks(prefix))
            time.sleep(0.1)
        addresses = {r: Advertised.from_json(self.store.get(f"{prefix}{ADDRESS}{r}")) for r in range(1, s.world)}
        log.info("worker pool epoch %d: every rank came (%s)", self.epoch,
                 ", ".join(f"rank {r} at {a}" for r, a in addresses.items()))
        for r, a in addresses.items():
            if self.spans_machines and a.loopback:
                raise PoolUnavailable(loopback_line(f"rank {r} (machine {s.machine_of(r)})", a, "--pool-interface"))
        return addresses

    def _reported_problem(self) -> str | None:
        """What a machine's `hosted-tinker pool-node` reported while this epoch formed, if anything."""
        for machine in range(1, self.settings.nnodes):
            key = f"{PROBLEM}{machine}"
            if self.store.check([key]):
                report = json.loads(self.store.get(key))
                if report["epoch"] >= self.epoch:
                    return report["line"]  # it names the machine
        return None

    def _missing_ranks(self, prefix: str) -> str:
        s = self.settings
        missing = [r for r in range(1, s.world) if not self.store.check([f"{prefix}{ADDRESS}{r}"])]
        machines = sorted({s.machine_of(r) for r in missing})
        where = "; ".join(
            f"machine {m}: is `hosted-tinker pool-node --node-rank {m}` running there, and can it reach "
            f"{self.master_addr}:{self.master_port}? its output says why not" if m else
            "this machine: they are still starting (a slow model load?)" for m in machines)
        return (f"the worker pool did not form within {s.timeout_s:g}s (--pool-timeout-s): rank(s) "
                f"{', '.join(map(str, missing))} never came ({where})")

    def _join(self, prefix: str, addresses: dict[int, Advertised], deadline: float) -> RankGroup:
        if self._joining is not None and self._joining.is_alive():
            raise PoolUnavailable("the last try to form the worker pool is still waiting for its ranks to connect; "
                                  "the next pass tries again")
        s = self.settings
        self._joining = GroupJoin(lambda: RankGroup.join(self.store, prefix, 0, s.world, self.device, s.timeout_s))
        try:
            group = self._joining.result(max(0.0, deadline - time.monotonic()))
        except PoolBroken as e:
            raise PoolUnavailable(str(e)) from e
        if group is None:
            ranks = ", ".join(f"rank {r} {a}" for r, a in {0: self.address, **addresses}.items())
            raise PoolUnavailable(f"the worker pool did not form within {s.timeout_s:g}s (--pool-timeout-s): every "
                                  f"rank came, but their connections did not complete ({ranks}): each machine must "
                                  "reach the others at these addresses (--pool-interface picks the interface)")
        return group

    def _stop_epoch(self) -> None:
        if self.group is not None:
            self.group.leave()
            self.group = None
        if self.local is not None:
            self.local.stop()
            self.local = None

    def close(self) -> None:
        self._stop_epoch()


class GroupJoin(threading.Thread):
    """Rank 0 forming a group on a thread it can stop waiting for: a group that forms after the
    server gave up on it is torn down at once (its ranks then exit and are started again)."""

    def __init__(self, form: Callable[[], RankGroup]):
        super().__init__(name="pool-join", daemon=True)
        self._form = form
        self._lock = threading.Lock()
        self._abandoned = False
        self._group: RankGroup | None = None
        self._error: Exception | None = None
        self.start()

    def run(self) -> None:
        try:
            group = self._form()
        except Exception as e:  # handed to the waiting caller
            self._error = e
            return
        with self._lock:
            if self._abandoned:
                group.leave()
            else:
                self._group = group

    def result(self, timeout_s: float) -> RankGroup | None:
        """The group, None if it did not form within `timeout_s`; raises PoolBroken if it failed."""
        self.join(timeout_s)
        with self._lock:
            if self._group is None and self._error is None:
                self._abandoned = True
                return None
        if self._error is not None:
            raise self._error
        return self._group
