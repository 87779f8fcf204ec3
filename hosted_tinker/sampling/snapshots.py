"""Frozen adapter snapshots for sampling.

A sampling session serves an adapter *as it was* when saved, while its model keeps training.
Each snapshot is a sampler checkpoint on disk (so sessions survive restarts and eviction never
loses one); the ones in use take slots in the `MultiLoRALinear` layers under their own id, as
frozen tensors, least recently used evicted beyond `capacity` and reloaded on demand.

A snapshot is known by the checkpoint's content, not by its directory: a sampler checkpoint
re-saved under the same name (same directory, new weights) gets a new id, so it is loaded and
served, and the old weights' snapshot is evicted as soon as no running request uses it.

A training model's current weights are sampled the same way (a request naming a training run on
/v1): `ensure_weights` attaches a copy of its adapter as of one step, made on the first request
that needs that step. A version is *superseded* when a newer one of its source exists (a newer
step, a re-saved checkpoint); superseded versions are evicted as soon as no request uses them.
"""

from __future__ import annotations

import json
import os
from collections import OrderedDict
from pathlib import Path

import torch

from ..checkpoints.format import ADAPTER_WEIGHTS, MANIFEST, read_checkpoint
from ..runtime.lora_slots import LoRAWeights
from ..runtime.multi_lora import MultiLoRALinear, attach_adapter, detach_adapter


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
        # adapter id -> (its source: a checkpoint directory or a training model's ref, its weights per
        # module path), least recently used first
        self._loaded: OrderedDict[str, tuple[str, dict[str, LoRAWeights]]] = OrderedDict()
        self._superseded: set[str] = set()  # loaded ids no new request can ask for
        self.loads = 0

    @staticmethod
    def adapter_id(checkpoint_dir: Path) -> str:
        return f"snapshot:{checkpoint_dir}#{content_identity(checkpoint_dir)}"

    def ensure(self, checkpoint_dir: Path, keep: set[str] = frozenset()) -> str:
        """Load the snapshot if needed (cycle thread only); return its adapter id.

        `keep`: ids that running requests still use; they are not evicted now (an older version
        of a re-saved checkpoint among them goes once they no longer are).
        """
        aid = self.adapter_id(checkpoint_dir)
        if aid not in self._loaded:
            self._attach(aid, str(checkpoint_dir), self._read(checkpoint_dir))
        return self._use(aid, keep)

    def ensure_weights(self, source: str, version: str, tensors: dict[str, torch.Tensor], scaling: float,
                       keep: set[str] = frozenset()) -> str:
        """Attach a copy of in-memory adapter `tensors` (`LoRAAdapter.named_tensors()` names) as version
        `version` of `source` if it is not attached yet (cycle thread only); return its adapter id.
        Earlier versions of `source` are superseded."""
        aid = f"{source}#{version}"
        if aid not in self._loaded:
            self._attach(aid, source, self._weights({k: t.detach() for k, t in tensors.items()}, scaling))
        return self._use(aid, keep)

    def supersede(self, source: str, keep: set[str] = frozenset()) -> None:
        """Every loaded version of `source` is out of date (its model stepped, its checkpoint was
        re-saved): evict them, those in `keep` once they are no longer used."""
        self._superseded.update(aid for aid, (src, _) in self._loaded.items() if src == source)
        self.sweep(keep)

    def sweep(self, keep: set[str] = frozenset()) -> None:
        """Evict the superseded versions that no request in `keep` uses any more."""
        for aid in [a for a in self._superseded if a not in keep]:
            self._evict(aid)

    def _use(self, aid: str, keep: set[str]) -> str:
        source = self._loaded[aid][0]
        self._loaded.move_to_end(aid)
        self._superseded.discard(aid)
        # Other versions of this source are stale: no new request can ask for them.
        self._superseded.update(old for old, (src, _) in self._loaded.items() if src == source and old != aid)
        self.sweep(keep)
        for old in list(self._loaded):
            if len(self._loaded) <= self.capacity:
                break
            if old != aid and old not in keep:
                self._evict(old)
        return aid

    def _read(self, checkpoint_dir: Path) -> dict[str, LoRAWeights]:
        ckpt = read_checkpoint(checkpoint_dir, with_optimizer=False, layers=self.layers)
        return self._weights(ckpt.tensors, ckpt.config.scaling)

    def _weights(self, tensors: dict[str, torch.Tensor], scaling: float) -> dict[str, LoRAWeights]:
        paths = sorted({k.rsplit(".lora_", 1)[0] for k in tensors})
        unknown = [p for p in paths if p not in self.layers]
        if unknown:
            raise ValueError(f"adapter does not fit this base model (no projection {unknown[0]!r})")
        return {p: LoRAWeights(A=tensors[f"{p}.lora_A.weight"].to(self.device),
                               B=tensors[f"{p}.lora_B.weight"].to(self.device), scaling=scaling)
                for p in paths}

    def _attach(self, aid: str, source: str, weights: dict[str, LoRAWeights]) -> None:
        attach_adapter(self.layers, aid, weights)  # copies the tensors into the layers' slots
        self._loaded[aid] = (source, weights)
        self.loads += 1

    def _evict(self, aid: str) -> None:
        self._superseded.discard(aid)
        _, weights = self._loaded.pop(aid)
        detach_adapter(self.layers, aid, weights, torch.device("cpu"))

    def __len__(self) -> int:
        return len(self._loaded)
