"""A rank of the worker pool other than rank 0: the process torchrun starts (pool_launch.py).

It reads the pool's settings from rank 0's store, loads the base model, joins the current
epoch's process group and then does what rank 0 says (`FollowerRuntime.serve`) until told to
stop. When the group fails (rank 0 or another rank died) it exits with status 1: on rank 0's
machine rank 0 starts the next epoch's processes itself; on other machines torchrun restarts
this one, which then asks rank 0 for a new epoch and joins it.
"""

from __future__ import annotations

import argparse
import datetime
import logging
import os
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist

log = logging.getLogger("hosted_tinker.pool_worker")


def _parse(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description="one rank of a hosted-tinker worker pool (started by torchrun)")
    p.add_argument("--master-addr", required=True)
    p.add_argument("--master-port", type=int, required=True)
    p.add_argument("--node-rank", type=int, required=True)
    p.add_argument("--data-dir", type=Path, required=True)
    p.add_argument("--pool-id", help="rank 0's machine: the pool that started this rank (a newer one is not ours)")
    p.add_argument("--epoch", type=int, help="rank 0's machine: the epoch to join")
    p.add_argument("--nnodes", type=int, help="other machines: checked against the server's settings")
    p.add_argument("--workers", type=int, help="other machines: checked against the server's settings")
    return p.parse_args(argv)


def _epoch_to_join(store: dist.Store, pool_id: str) -> int:
    """The current epoch, or -- if it formed without this rank (torchrun restarted it after the
    group started) -- the next one, which this rank asks rank 0 to open."""
    from .pool_launch import EPOCH, FORMED, REJOIN, REJOIN_WAIT_S

    epoch = int(store.get(EPOCH))
    if not store.check([f"{pool_id}/epoch{epoch}/{FORMED}"]):
        return epoch
    store.add(REJOIN, 1)
    deadline = time.monotonic() + REJOIN_WAIT_S
    while int(store.get(EPOCH)) == epoch:
        if time.monotonic() > deadline:
            raise TimeoutError(f"rank 0 opened no new epoch in {REJOIN_WAIT_S:.0f}s")
        time.sleep(0.2)
    return int(store.get(EPOCH))


def main(argv: list[str] | None = None) -> int:
    from ..logs import configure_logging
    from ..model_loading import load_base_model, pick_dtype
    from .distributed import FollowerRuntime
    from .pool_launch import POOL_ID, READY, REJOIN_WAIT_S, SETTINGS, PoolSettings
    from .rank_group import PoolBroken, RankGroup
    from .recompute import RecomputeChoice

    args = _parse(argv)
    local_rank = int(os.environ["LOCAL_RANK"])  # set by torchrun
    store = dist.TCPStore(args.master_addr, args.master_port, None, False,
                          timeout=datetime.timedelta(seconds=REJOIN_WAIT_S))
    pool_id = store.get(POOL_ID).decode()
    settings = PoolSettings.from_json(store.get(SETTINGS))
    configure_logging(settings.log_level, settings.log_format)
    if args.pool_id is not None and pool_id != args.pool_id:
        log.warning("the pool at %s:%d is not the one that started this rank; exiting", args.master_addr,
                    args.master_port)
        return 1
    for name, mine, theirs in (("--nnodes", args.nnodes, settings.nnodes), ("--workers", args.workers, settings.workers)):
        if mine is not None and mine != theirs:
            log.error("%s %d here, but the server runs with %s %d: give every machine the same", name, mine, name, theirs)
            return 2
    rank = settings.rank_of(args.node_rank, local_rank)
    device = settings.device_of(args.node_rank, local_rank)
    if device.type == "cuda":
        torch.cuda.set_device(device)
    elif settings.threads:
        torch.set_num_threads(settings.threads)
    # A sharded base is loaded on the CPU; fully_shard moves each rank's shards to its device.
    model, _ = load_base_model(settings.base_model, args.data_dir,
                               torch.device("cpu") if settings.shard_base else device,
                               pick_dtype(settings.dtype, device))
    epoch = args.epoch if args.epoch is not None else _epoch_to_join(store, pool_id)
    prefix = f"{pool_id}/epoch{epoch}/"
    store.add(prefix + READY, 1)
    try:
        group = RankGroup.join(store, prefix, rank, settings.world, device, settings.timeout_s)
    except PoolBroken as e:
        log.error("rank %d could not join the worker pool (epoch %d): %s", rank, epoch, e)
        return 1
    try:
        runtime = FollowerRuntime(model, settings.base_model, device=device, group=group, shard=settings.shard_base,
                                  epoch=epoch,
                                  max_tokens_per_micro_batch=settings.max_tokens_per_micro_batch,
                                  max_live_adapters=settings.max_live_adapters,
                                  recompute=RecomputeChoice(settings.recompute, "as rank 0 chose"))
        log.info("rank %d of %d ready (epoch %d, %s%s)", rank, settings.world, epoch, device,
                 ", activation checkpointing on" if settings.recompute else "")
        runtime.serve()
    except PoolBroken as e:
        log.warning("rank %d leaves the worker pool (epoch %d): %s", rank, epoch, e)
        return 1
    finally:
        group.leave()
    log.info("rank %d stopped", rank)
    return 0


if __name__ == "__main__":
    sys.exit(main())
