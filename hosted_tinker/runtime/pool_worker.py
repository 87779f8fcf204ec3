"""A rank of the worker pool other than rank 0: the process torchrun starts (pool_launch.py).

It reads the pool's settings from rank 0's store, loads the base model, publishes the address it
advertises (logged too), joins the current epoch's process group and then does what rank 0 says
(`FollowerRuntime.serve`) until told to stop. When the group fails (rank 0 or another rank died)
it exits with status 1: on rank 0's machine rank 0 starts the next epoch's processes itself; on
other machines torchrun restarts this one, which -- before it loads the model, so that rank 0
knows at once that it is not back -- asks rank 0 for a new epoch, and joins it.
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


def _ask_to_rejoin_if_late(store: dist.Store, pool_id: str, rank: int) -> int | None:
    """If torchrun restarted this rank after the current epoch formed without it: ask rank 0 for a
    new one and return the epoch it asked after; None while the current epoch is still forming.
    Asked at once, before the model loads: rank 0 then knows this rank is not back before it sends
    the pool a pass, and waits for it."""
    from .pool_launch import EPOCH, REJOIN, epoch_formed

    epoch = int(store.get(EPOCH))
    if not epoch_formed(store, pool_id, epoch):
        return None
    store.add(REJOIN, 1)
    log.info("rank %d restarted after epoch %d formed without it: asked rank 0 for a new epoch", rank, epoch)
    return epoch


def _epoch_to_join(store: dist.Store, pool_id: str, rank: int, asked_after: int | None) -> int:
    """After the model loaded: the epoch forming now, or the first one rank 0 opens after
    `asked_after` (asking now if the current one formed while this rank loaded)."""
    from .pool_launch import EPOCH, REJOIN_WAIT_S

    if asked_after is None:
        asked_after = _ask_to_rejoin_if_late(store, pool_id, rank)
        if asked_after is None:
            return int(store.get(EPOCH))
    deadline = time.monotonic() + REJOIN_WAIT_S
    while (epoch := int(store.get(EPOCH))) == asked_after:
        if time.monotonic() > deadline:
            raise TimeoutError(f"rank 0 opened no new epoch in {REJOIN_WAIT_S:.0f}s")
        time.sleep(0.2)
    return epoch


def main(argv: list[str] | None = None) -> int:
    from ..observability.logs import configure_logging
    from .pool_launch import POOL_ID, REJOIN_WAIT_S, SETTINGS, PoolSettings

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
    asked_after = None if args.epoch is not None else _ask_to_rejoin_if_late(store, pool_id, rank)
    device = settings.device_of(args.node_rank, local_rank)
    if device.type == "cuda":
        torch.cuda.set_device(device)
    elif settings.threads:
        torch.set_num_threads(settings.threads)
    model = _load_model(settings, args.data_dir, device)
    epoch = args.epoch if args.epoch is not None else _epoch_to_join(store, pool_id, rank, asked_after)
    return _serve(store, f"{pool_id}/epoch{epoch}/", epoch, settings, rank, device, model)


def _load_model(settings, data_dir: Path, device: torch.device):
    from ..models.loading import load_base_model, pick_dtype

    # A sharded base is loaded on the CPU; fully_shard moves each rank's shards to its device.
    model, _ = load_base_model(settings.base_model, data_dir, torch.device("cpu") if settings.shard_base else device,
                               pick_dtype(settings.dtype, device))
    return model


def _serve(store: dist.Store, prefix: str, epoch: int, settings, rank: int, device: torch.device, model) -> int:
    """Say where this rank can be reached and that it is ready, join the epoch's group, then do what
    rank 0 says until it says stop (0) or the group fails (1)."""
    from .. import faults
    from .distributed import FollowerRuntime
    from .pool_address import advertised_address
    from .pool_launch import ADDRESS, READY
    from .rank_group import PoolBroken, RankGroup
    from .recompute import RecomputeChoice

    address = advertised_address()
    log.info("rank %d advertises %s to the worker pool", rank, address)
    store.set(f"{prefix}{ADDRESS}{rank}", address.to_json())
    store.add(prefix + READY, 1)
    faults.gate("pool.rank_before_join")
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
