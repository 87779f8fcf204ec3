"""What rank 0 of the worker pool and the other ranks say to each other (runtime/distributed.py).

Commands from rank 0 and each rank's result travel pickled through `RankGroup.scatter` /
`gather`; adapter weights and gradients as flat tensors through `broadcast` / `reduce`.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from ..requests.kinds import FBOutcome, FBWork
from .adapters import LoRAConfig
from .trainer import PassStats


@dataclass
class Sync:
    """Adapters the other ranks must drop, and those to (re)create with these configs; the weights
    of the latter follow as one broadcast each, in this order."""

    removed: list[str] = field(default_factory=list)
    changed: list[tuple[str, LoRAConfig]] = field(default_factory=list)


@dataclass
class PassShare:
    sync: Sync
    works: list[FBWork]  # every request of the pass, with this rank's datums only
    decisions: dict[tuple[int, int], bool]  # rank 0's mix_tenants answer per (width, rows)
    pad: tuple[int, int]  # gradient / forward-only micro-batches every rank runs (sharded base)
    model_ids: list[str]  # every model of the pass (each rank pages all of them in)


@dataclass
class Mirror:
    """With a sharded base: run what rank 0 runs outside a pass, so that FSDP's collectives pair up."""

    call: str  # "forward" (a sampling step), "probe_sample", "probe_run"
    args: tuple = ()


@dataclass
class Stop:
    pass


@dataclass
class ShareResult:
    outcomes: list[FBOutcome] | None = None  # None: aborted, or failed (error)
    stats: PassStats | None = None
    error: str | None = None


def flat_tensors(tensors: list[torch.Tensor], device: torch.device) -> torch.Tensor:
    return torch.cat([t.detach().reshape(-1) for t in tensors]).to(device)


def unflatten_into(flat: torch.Tensor, tensors: list[torch.Tensor]) -> None:
    with torch.no_grad():
        for t, piece in zip(tensors, torch.split(flat, [t.numel() for t in tensors])):
            t.copy_(piece.view_as(t))
