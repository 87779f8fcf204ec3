"""Frozen adapter snapshots for sampling.

A sampling session serves an adapter *as it was* when saved, while its model keeps training.
Each snapshot is a sampler checkpoint on disk (so sessions survive restarts and eviction never
loses one); the ones in use are loaded into the `MultiLoRALinear` layers under their own id,
as frozen tensors, least recently used evicted beyond `capacity` and reloaded on demand.
"""

from __future__ import annotations

from collections import OrderedDict
from pathlib import Path

import torch

from ..checkpoints.format import read_checkpoint
from ..runtime.multi_lora import LoRAWeights, MultiLoRALinear


class SnapshotCache:
    def __init__(self, layers: dict[str, MultiLoRALinear], device: torch.device, capacity: int = 64):
        self.layers = layers
        self.device = device
        self.capacity = capacity
        self._loaded: OrderedDict[str, list[str]] = OrderedDict()  # adapter id -> module paths
        self.loads = 0

    @staticmethod
    def adapter_id(checkpoint_dir: Path) -> str:
        return f"snapshot:{checkpoint_dir}"

    def ensure(self, checkpoint_dir: Path, keep: set[str] = frozenset()) -> str:
        """Load the snapshot if needed (cycle thread only); return its adapter id."""
        aid = self.adapter_id(checkpoint_dir)
        if aid in self._loaded:
            self._loaded.move_to_end(aid)
            return aid
        ckpt = read_checkpoint(checkpoint_dir, with_optimizer=False)
        paths = sorted({k.rsplit(".lora_", 1)[0] for k in ckpt.tensors})
        unknown = [p for p in paths if p not in self.layers]
        if unknown:
            raise ValueError(f"adapter does not fit this base model (no projection {unknown[0]!r})")
        scaling = ckpt.config.scaling
        for p in paths:
            self.layers[p].adapters[aid] = LoRAWeights(
                A=ckpt.tensors[f"{p}.lora_A.weight"].to(self.device),
                B=ckpt.tensors[f"{p}.lora_B.weight"].to(self.device), scaling=scaling)
        self._loaded[aid] = paths
        self.loads += 1
        for old in list(self._loaded):
            if len(self._loaded) <= self.capacity:
                break
            if old != aid and old not in keep:
                self._evict(old)
        return aid

    def _evict(self, aid: str) -> None:
        for p in self._loaded.pop(aid):
            self.layers[p].adapters.pop(aid, None)

    def __len__(self) -> int:
        return len(self._loaded)
