"""`RankGroup`: one generation of the worker pool's torch.distributed process group.

Every rank of a pool joins the group of the current *epoch* through the pool's TCPStore (kept
by rank 0, which outlives the others); when a rank dies the group is torn down and the next
epoch forms a new one, under its own key prefix of the same store. Everything that crosses
between ranks goes through the group's collectives: commands and results as pickled objects
(`scatter`, `gather`, `all_gather`: torch's `*_object_list` functions, on a gloo group), tensors
with `broadcast` and `reduce` (gloo on CPU, NCCL on GPU).

Any collective that fails -- a peer's socket closed (a kill -9 is seen within milliseconds on
one machine) or the group's timeout passed (a machine that vanished) -- raises `PoolBroken`; a
group that raised once is never used again.
"""

from __future__ import annotations

import datetime
import logging
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import torch
import torch.distributed as dist

log = logging.getLogger(__name__)


class PoolBroken(RuntimeError):
    """A collective of the pool failed: a rank died, or did not answer within the timeout."""


class RankGroup:
    def __init__(self, rank: int, world: int, device: torch.device, control: Any):
        self.rank = rank
        self.world = world
        self.device = device  # where tensor collectives run: NCCL needs the rank's GPU
        self._control = control  # gloo group for pickled objects (the whole world on CPU)
        self._mesh = None
        self.broken = False

    @classmethod
    def join(cls, store: dist.Store, prefix: str, rank: int, world: int, device: torch.device,
             timeout_s: float) -> "RankGroup":
        """Form (all ranks at once) the process group of one epoch; blocks until every rank joined."""
        timeout = datetime.timedelta(seconds=timeout_s)
        backend = "nccl" if device.type == "cuda" else "gloo"
        try:
            dist.init_process_group(backend, store=dist.PrefixStore(prefix, store), rank=rank, world_size=world,
                                    timeout=timeout, device_id=device if device.type == "cuda" else None)
            # Objects are pickled into CPU tensors: on GPU they get a gloo group of their own, as NCCL
            # would copy every command to the device and back.
            control = dist.new_group(backend="gloo", timeout=timeout) if backend != "gloo" else dist.group.WORLD
        except RuntimeError as e:  # a rank that never came, or died while the group formed
            if dist.is_initialized():
                dist.destroy_process_group()
            raise PoolBroken(f"the worker pool's ranks did not all join ({type(e).__name__}: "
                             f"{' '.join(str(e).split())[:300]})") from e
        return cls(rank, world, device, control)

    def leave(self) -> None:
        """Tear the group down (also after a failure: a group is never reused)."""
        self.broken = True
        try:
            dist.destroy_process_group()
        except Exception:  # a group whose peers died may complain; it is gone either way
            log.debug("destroying the pool's process group failed", exc_info=True)

    def mesh(self):
        """The 1-D device mesh over the group, for FSDP2 (runtime/sharding.py)."""
        if self._mesh is None:
            from torch.distributed.device_mesh import DeviceMesh

            self._mesh = DeviceMesh.from_group(dist.group.WORLD, self.device.type)
        return self._mesh

    @contextmanager
    def _collective(self, what: str) -> Iterator[None]:
        if self.broken:
            raise PoolBroken(f"{what}: the worker pool's process group already failed")
        try:
            yield
        except RuntimeError as e:  # DistBackendError, DistStoreError, gloo's "Connection closed by peer" ...
            self.broken = True
            raise PoolBroken(f"{what} failed: {' '.join(str(e).split())[:300]}") from e

    # -- objects: commands, outcomes ------------------------------------------------------------
    def scatter(self, per_rank: list | None) -> Any:
        """Rank 0 hands each rank its own object (`per_rank[r]`); every rank returns its own."""
        out = [None]
        with self._collective("sending a command to the pool"):
            dist.scatter_object_list(out, per_rank if self.rank == 0 else None, src=0, group=self._control)
        return out[0]

    def gather(self, obj: Any) -> list | None:
        """Every rank's object, in rank order, on rank 0 (None elsewhere)."""
        out = [None] * self.world if self.rank == 0 else None
        with self._collective("collecting results from the pool"):
            dist.gather_object(obj, out, dst=0, group=self._control)
        return out

    def all_gather(self, obj: Any) -> list:
        out = [None] * self.world
        with self._collective("agreeing with the pool"):
            dist.all_gather_object(out, obj, group=self._control)
        return out

    # -- tensors -------------------------------------------------------------------------------
    def broadcast(self, tensor: torch.Tensor) -> None:
        """Rank 0's `tensor` into every rank's (in place)."""
        with self._collective("broadcasting to the pool"):
            dist.broadcast(tensor, src=0)

    def reduce(self, tensor: torch.Tensor) -> None:
        """The sum of every rank's `tensor` into rank 0's (in place)."""
        with self._collective("reducing gradients over the pool"):
            dist.reduce(tensor, dst=0, op=dist.ReduceOp.SUM)
