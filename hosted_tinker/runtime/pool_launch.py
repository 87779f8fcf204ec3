"""Starting the worker pool's ranks: their settings, the rendezvous store, torchrun.

Rank 0 is the server process itself (it answers HTTP and holds the pool's state); the other
ranks are processes started by torchrun, one per device:

- on the server's machine, `hosted-tinker serve --workers N` starts torchrun for ranks 1..N-1;
- on each other machine, `launch.sh pool-node --nnodes M --node-rank K --master-addr A
  --master-port P --workers N` (this module's `main`) starts torchrun for ranks K*N..K*N+N-1.

torchrun runs standalone on every machine (its own rendezvous, `--standalone`): it starts and
watches that machine's ranks, and on other machines restarts them when they exit. The pool's
own rendezvous is a TCPStore that rank 0 keeps at --master-addr:--master-port: every rank reads
the settings there and joins the current epoch's process group (rank_group.py). Why not one
torchrun job over all machines: when any rank fails torchrun restarts every rank of its job,
rank 0 included, and rank 0 is the server, whose clients, futures and adapters must outlive a
rank's death.
"""

from __future__ import annotations

import argparse
import datetime
import json
import logging
import os
import secrets
import signal
import subprocess
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
import torch.distributed as dist

from .rank_group import PoolBroken, RankGroup

log = logging.getLogger(__name__)

WORKER_MODULE = "hosted_tinker.runtime.pool_worker"
# Keys of the pool's store (rank 0's TCPStore); an epoch's group keys live under "<id>/epoch<N>/".
POOL_ID, SETTINGS, EPOCH, REJOIN = "pool/id", "pool/settings", "pool/epoch", "pool/rejoin"
READY, FORMED = "ready", "formed"  # per epoch: ranks about to join; the group has formed
# A restarted rank on another machine that finds its epoch formed without it waits this long for
# rank 0 to open the next one before it gives up (torchrun then starts it again).
REJOIN_WAIT_S = 600.0


@dataclass(frozen=True)
class PoolSettings:
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

    @property
    def world(self) -> int:
        return self.workers * self.nnodes

    def rank_of(self, node_rank: int, local_rank: int) -> int:
        """Global rank of torchrun's `local_rank` on machine `node_rank` (rank 0, the server, is
        the first device of machine 0, so its torchrun starts at rank 1)."""
        return node_rank * self.workers + local_rank + (1 if node_rank == 0 else 0)

    def device_of(self, node_rank: int, local_rank: int) -> torch.device:
        if self.device_type == "cpu":
            return torch.device("cpu")
        return torch.device(self.device_type, local_rank + (1 if node_rank == 0 else 0))

    def to_json(self) -> str:
        return json.dumps(asdict(self))

    @classmethod
    def from_json(cls, text: bytes | str) -> "PoolSettings":
        return cls(**json.loads(text))


def cpu_threads_per_rank(ranks_on_this_machine: int) -> int:
    """Ranks on one machine share its cores; more threads than cores slows every rank down."""
    return max(1, (os.cpu_count() or 1) // ranks_on_this_machine)


def torchrun_command(nproc: int, worker_args: list[str], *, max_restarts: int) -> list[str]:
    return [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nnodes", "1",
            "--nproc-per-node", str(nproc), "--max-restarts", str(max_restarts), "-m", WORKER_MODULE, *worker_args]


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
    """The pool's ranks could not be (re)started; the message says why."""


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
        self.settings = settings
        self.master_addr = master_addr
        self.device = device
        self.data_dir = data_dir
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

    def prefix(self, epoch: int) -> str:
        return f"{self.pool_id}/epoch{epoch}/"

    def healthy(self) -> bool:
        """The group has not failed, this machine's ranks are running, and no rank of another
        machine came back asking for a new epoch (cheap: called before every pass)."""
        return (self.group is not None and not self.group.broken
                and (self.local is None or self.local.alive())
                and self.store.add(REJOIN, 0) == self._rejoins_seen)

    def start(self) -> RankGroup:
        """Open the next epoch: stop what is left of the last one, start this machine's ranks,
        wait until every rank has joined (or one of ours died, or the timeout passed)."""
        self._stop_epoch()
        self.epoch += 1
        prefix = self.prefix(self.epoch)
        self.store.set(EPOCH, str(self.epoch))
        s = self.settings
        if s.workers > 1:
            self.local = LocalRanks(s.workers - 1, [
                "--master-addr", self.master_addr, "--master-port", str(self.master_port), "--node-rank", "0",
                "--data-dir", str(self.data_dir), "--pool-id", self.pool_id, "--epoch", str(self.epoch)], s.threads)
        deadline = time.monotonic() + s.timeout_s
        while self.store.add(prefix + READY, 0) < s.world - 1:  # the others load the model first
            if self.local is not None and not self.local.alive():
                self._stop_epoch()
                raise PoolUnavailable(f"a rank of this machine exited (status {self.local.proc.returncode}) before "
                                      "the pool formed; its log above says why")
            if time.monotonic() > deadline:
                self._stop_epoch()
                raise PoolUnavailable(f"only {self.store.add(prefix + READY, 0) + 1} of {s.world} ranks came within "
                                      f"{s.timeout_s:.0f}s (other machines: is `launch.sh pool-node` running there, "
                                      f"and can it reach {self.master_addr}:{self.master_port}?)")
            time.sleep(0.05)
        try:
            self.group = RankGroup.join(self.store, prefix, 0, s.world, self.device, s.timeout_s)
        except PoolBroken as e:
            self._stop_epoch()
            raise PoolUnavailable(str(e)) from e
        self.store.set(prefix + FORMED, "1")
        self._rejoins_seen = self.store.add(REJOIN, 0)
        log.info("worker pool epoch %d: %d rank(s) on %d machine(s) joined (%s)", self.epoch, s.world, s.nnodes,
                 "NCCL" if self.device.type == "cuda" else "gloo")
        return self.group

    def _stop_epoch(self) -> None:
        if self.group is not None:
            self.group.leave()
            self.group = None
        if self.local is not None:
            self.local.stop()
            self.local = None

    def close(self) -> None:
        self._stop_epoch()


def main(argv: list[str] | None = None) -> int:
    """`launch.sh pool-node`: this machine's ranks of a pool whose rank 0 is another machine's server."""
    p = argparse.ArgumentParser(prog="launch.sh pool-node", description=(
        "Run this machine's ranks of a hosted-tinker worker pool: torchrun starts one per device and restarts "
        "them when they exit. Start the server first: hosted-tinker serve --workers N --nnodes M "
        "--master-addr A --master-port P (docs/scale.md)."))
    p.add_argument("--nnodes", type=int, required=True, help="machines in the pool (as the server's --nnodes)")
    p.add_argument("--node-rank", type=int, required=True, help="this machine: 1 .. nnodes-1 (0 is the server's)")
    p.add_argument("--master-addr", required=True, help="the server's address (its --master-addr)")
    p.add_argument("--master-port", type=int, required=True, help="the server's --master-port")
    p.add_argument("--workers", type=int, required=True, help="ranks on this machine, one per device (the server's "
                                                               "--workers)")
    p.add_argument("--data-dir", default="./data", help="where this machine builds or finds the base model")
    p.add_argument("--max-restarts", type=int, default=1000, help="how often torchrun restarts this machine's ranks")
    args = p.parse_args(argv)
    if not 1 <= args.node_rank < args.nnodes:
        p.error(f"--node-rank must be 1 .. {args.nnodes - 1} (machine 0 runs the server)")
    threads = cpu_threads_per_rank(args.workers)
    cmd = torchrun_command(args.workers, [
        "--master-addr", args.master_addr, "--master-port", str(args.master_port), "--node-rank", str(args.node_rank),
        "--data-dir", args.data_dir, "--nnodes", str(args.nnodes), "--workers", str(args.workers)],
        max_restarts=args.max_restarts)
    os.environ.setdefault("OMP_NUM_THREADS", str(threads))
    os.execv(cmd[0], cmd)
    return 0  # not reached


if __name__ == "__main__":
    sys.exit(main())
