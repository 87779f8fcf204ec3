"""`hosted-tinker pool-node`: a machine other than the server's runs its ranks of the worker pool.

It waits for the server's rendezvous store, checks what would keep this machine's ranks out of
the pool (its --nnodes / --workers against the server's, the address its ranks would advertise,
pool_address.py), and then becomes torchrun, which starts one rank per device (pool_worker.py)
and starts each again when it exits. A check that fails is one line here, and the same line in
the store, where the server, waiting for this machine's ranks, reads it and stops waiting.
"""

from __future__ import annotations

import datetime
import json
import os
import socket
from dataclasses import dataclass
from pathlib import Path

import torch.distributed as dist

from .pool_address import address_problem, use_interface
from .pool_launch import (EPOCH, POOL_ID, PROBLEM, REJOIN_WAIT_S, SETTINGS, PoolSettings, PoolUnavailable,
                          cpu_threads_per_rank, epoch_formed, spans_machines, torchrun_command)


@dataclass(frozen=True)
class NodeArgs:
    """`hosted-tinker pool-node`'s flags (cli.py)."""

    nnodes: int
    node_rank: int
    master_addr: str
    master_port: int
    workers: int
    data_dir: Path
    max_restarts: int
    pool_interface: str | None


def run_node(args: NodeArgs) -> None:
    """Checks, then execs torchrun (does not return); raises `PoolUnavailable` with one line."""
    if not 1 <= args.node_rank < args.nnodes:
        raise PoolUnavailable(f"--node-rank must be 1 .. {args.nnodes - 1} (machine 0 runs the server)")
    try:  # waits for the server to come up
        store = dist.TCPStore(args.master_addr, args.master_port, None, False,
                              timeout=datetime.timedelta(seconds=REJOIN_WAIT_S))
    except (RuntimeError, TimeoutError) as e:
        raise PoolUnavailable(f"no worker pool answered at {args.master_addr}:{args.master_port} within "
                              f"{REJOIN_WAIT_S:.0f}s: start the server (hosted-tinker serve --nnodes {args.nnodes} "
                              f"--master-addr {args.master_addr} --master-port {args.master_port}) ({e})") from None
    settings = PoolSettings.from_json(store.get(SETTINGS))
    problem = _mismatch(args, settings)
    if problem is None:
        interface = args.pool_interface or os.environ.get("GLOO_SOCKET_IFNAME") or settings.interface
        if interface:
            use_interface(interface)  # torchrun's ranks inherit it
        problem = address_problem(f"machine {args.node_rank} ({socket.gethostname()})", "--pool-interface",
                                  multi_machine=spans_machines(args.nnodes, args.master_addr))
    report = f"{PROBLEM}{args.node_rank}"
    if problem is not None:  # for the epoch forming now, else the next one (which waits for this machine)
        epoch = int(store.get(EPOCH))
        epoch += epoch_formed(store, store.get(POOL_ID).decode(), epoch)
        store.set(report, json.dumps({"epoch": epoch, "line": problem}))
        raise PoolUnavailable(problem)
    store.delete_key(report)  # what this machine reported before no longer holds
    del store
    cmd = torchrun_command(args.workers, [
        "--master-addr", args.master_addr, "--master-port", str(args.master_port), "--node-rank", str(args.node_rank),
        "--data-dir", str(args.data_dir), "--nnodes", str(args.nnodes), "--workers", str(args.workers)],
        max_restarts=args.max_restarts)
    os.environ.setdefault("OMP_NUM_THREADS", str(cpu_threads_per_rank(args.workers)))
    os.execv(cmd[0], cmd)


def _mismatch(args: NodeArgs, settings: PoolSettings) -> str | None:
    for name, mine, theirs in (("--nnodes", args.nnodes, settings.nnodes), ("--workers", args.workers,
                                                                            settings.workers)):
        if mine != theirs:
            return f"{name} {mine} here, but the server runs with {name} {theirs}: give every machine the same"
    return None
