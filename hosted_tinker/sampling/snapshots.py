"""Frozen adapter snapshots for sampling.

A sampling session serves an adapter *as it was* when saved, while its model keeps training.
Each snapshot is a sampler checkpoint on disk (so sessions survive restarts and eviction never
loses one); the ones in use take slots in the `MultiLoRALinear` layers under their own id, as
frozen tensors, least recently used evicted beyond `capacity` and reloaded on demand.

A snapshot is known by the checkpoint's content, not by its directory: a sampler checkpoint
re-saved under the same name (same directory, new weights) gets a new id, so it is loaded and
served, and the old weights' snapshot is evicted as soon as no running request uses it.
"""

from __future__ import annotations

import json
import os
from collections import OrderedDict
from pathlib import Path

import torch

from ..checkpoints.format import ADAPTER_WEIGHTS, MANIFEST, read_checkpoint
from ..runtime.multi_lora import LoRAWeights, MultiLoRALinear, attach_adapter, detach_adapter


def content_identity(checkpoint_dir: Path) -> str:
    """What changes whenever the checkpoint's weights do: the manifest's creation time and
    weights checksum; for a plain PEFT directory (no manifest), the weights file's inode, size
    and modification time (a re-save writes a new file)."""
    try:
        manifest = json.loads((checkpoint_dir / MANIFEST).read_text())
        return f"{manifest['created_at']!r}/{manifest['files'][ADAPTER_WEIGHTS]['sha256']}"
    except (OSError, ValueError, KeyError, TypeError):
        pass
    try:
        st = os.stat(checkpoint_dir / ADAPTER_WEIGHTS)
    except OSError:
        return "missing"  # read_checkpoint reports what is wrong
    return f"{st.st_ino}/{st.st_size}/{st.st_mtime_ns}"


class SnapshotCache:
    def __init__(self, layers: dict[str, MultiLoRALinear], device: torch.device, capacity: int = 64):
        self.layers = layers
        self.device = device
        self.capacity = capacity
        # adapter id -> (checkpoint directory, its weights per module path)
        self._loaded: OrderedDict[str, tuple[Path, dict[str, LoRAWeights]]] = OrderedDict()
        self.loads = 0

    @staticmethod
    def adapter_id(checkpoint_dir: Path) -> str:
        return f"snapshot:{checkpoint_dir}#{content_identity(checkpoint_dir)}"

    def ensure(self, checkpoint_dir: Path, keep: set[str] = frozenset()) -> str:
        """Load the snapshot if needed (cycle thread only); return its adapter id.

        `keep`: ids that running requests still use; they are not evicted now (an older version
        of a re-saved checkpoint among them goes at the next call for that directory).
        """
        aid = self.adapter_id(checkpoint_dir)
        if aid not in self._loaded:
            self._load(aid, checkpoint_dir)
        self._loaded.move_to_end(aid)
        for old, (old_dir, _) in list(self._loaded.items()):
            # Other versions of this directory are stale: no new request can ask for them.
            if old != aid and old_dir == checkpoint_dir and old not in keep:
                self._evict(old)
        for old in list(self._loaded):
            if len(self._loaded) <= self.capacity:
                break
            if old != aid and old not in keep:
                self._evict(old)
        return aid

    def _load(self, aid: str, checkpoint_dir: Path) -> None:
        ckpt = read_checkpoint(checkpoint_dir, with_optimizer=False)
        paths = sorted({k.rsplit(".lora_", 1)[0] for k in ckpt.tensors})
        unknown = [p for p in paths if p not in self.layers]
        if unknown:
            raise ValueError(f"adapter does not fit this base model (no projection {unknown[0]!r})")
        scaling = ckpt.config.scaling
        weights = {p: LoRAWeights(A=ckpt.tensors[f"{p}.lora_A.weight"].to(self.device),
                                  B=ckpt.tensors[f"{p}.lora_B.weight"].to(self.device), scaling=scaling)
                   for p in paths}
        attach_adapter(self.layers, aid, weights)
        self._loaded[aid] = (checkpoint_dir, weights)
        self.loads += 1

    def _evict(self, aid: str) -> None:
        _, weights = self._loaded.pop(aid)
        detach_adapter(self.layers, aid, weights, torch.device("cpu"))

    def __len__(self) -> int:
        return len(self._loaded)
