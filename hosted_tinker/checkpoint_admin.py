"""Checkpoint housekeeping around the files `runtime/checkpoints.py` writes.

Deletion, TTL expiry, crash recovery at start-up, signed download URLs, tar archives, and
importing adapters made elsewhere. The SQLite record is what *lists* a checkpoint; its directory
(`<data-dir>/checkpoints/<run>/<kind>/<name>`) is its content. The two change together under
`CHECKPOINT_LOCK` (the worker's saves, REST deletes, the expiry sweeper, imports), and `recover()`
makes them agree again after a kill -9 at any point of a save, an overwrite, or a delete:

| crash point                                   | on disk                        | recovery                 |
|-----------------------------------------------|--------------------------------|--------------------------|
| while writing the temporary directory         | `.tmp-<name>-*`                | removed: the old state   |
| overwrite, between its two renames            | `.old-<name>-*`, no `<name>`   | renamed back: old state  |
| after the rename, before the record           | `<name>` without a record      | removed: the old state   |
| overwrite, after the rename, before the record| `<name>` newer than its record | record refreshed: new    |
| delete, after the record went                 | `<name>` or `.trash-*`         | removed                  |

A save that had not resolved its future when the server died is failed at restart ("resubmit"),
so landing on the old state is what the client was told.
"""

from __future__ import annotations

import hashlib
import hmac
import json
import logging
import os
import secrets
import shutil
import sqlite3
import tarfile
import threading
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path
from typing import Iterator

from .runtime.checkpoints import (
    ADAPTER_CONFIG, ADAPTER_WEIGHTS, MANIFEST, OPTIMIZER_STATE, CheckpointError, LoadedCheckpoint, _sha256,
    read_checkpoint, write_atomically,
)
from .runtime.multi_lora import MultiLoRALinear
from .store import Store

log = logging.getLogger(__name__)

# tinker:// path segment -> the SDK's checkpoint_type
KIND_TYPES = {"weights": "training", "sampler_weights": "sampler", "external_weights": "external"}
CHECKPOINT_FILES = (ADAPTER_CONFIG, ADAPTER_WEIGHTS, MANIFEST, OPTIMIZER_STATE)

# Held while a checkpoint's record and directory change together (never while waiting on I/O
# that is not that change).
CHECKPOINT_LOCK = threading.RLock()


def is_expired(row: sqlite3.Row | None, now: float | None = None) -> bool:
    return row is not None and row["expires_at"] is not None and row["expires_at"] <= (now or time.time())


def dir_size(path: Path) -> int:
    return sum(f.stat().st_size for f in path.iterdir() if f.is_file())


def checkpoint_files(path: Path) -> list[Path]:
    """The plain files of a checkpoint directory, by name (what downloads and archives carry)."""
    return sorted((f for f in path.iterdir() if f.is_file() and not f.is_symlink() and not f.name.startswith(".")),
                  key=lambda f: f.name)


def _to_trash(path: Path) -> Path | None:
    """Rename a directory out of the way (atomic: it is gone from its name at once)."""
    if not path.exists():
        return None
    trash = path.parent / f".trash-{path.name}-{uuid.uuid4().hex[:8]}"
    os.rename(path, trash)
    return trash


def delete_checkpoint(store: Store, row: sqlite3.Row, *, expired_before: float | None = None) -> bool:
    """Remove a checkpoint's record, then its files. False if the record was already gone (or,
    with `expired_before`, no longer expired: a new save replaced it)."""
    with CHECKPOINT_LOCK:
        if not store.delete_checkpoint_if(row["model_id"], row["checkpoint_id"], expired_before=expired_before):
            return False
        trash = _to_trash(Path(row["dir"]))
    if trash is not None:
        shutil.rmtree(trash, ignore_errors=True)
    return True


def sweep_expired(store: Store, now: float | None = None) -> int:
    """Delete every checkpoint whose TTL has passed: its record and its files."""
    now = now or time.time()
    removed = 0
    for row in store.expired_checkpoints(now):
        if delete_checkpoint(store, row, expired_before=now):
            removed += 1
            log.info("checkpoint tinker://%s/%s expired and was removed", row["model_id"], row["checkpoint_id"])
    return removed


# -- crash recovery --------------------------------------------------------------------------------

@dataclass
class RecoveryReport:
    restored: list[str] = field(default_factory=list)         # overwrites rolled back to the old state
    removed_partial: list[str] = field(default_factory=list)  # .tmp-/.trash- leftovers
    removed_orphans: list[str] = field(default_factory=list)  # directories without a record
    removed_records: list[str] = field(default_factory=list)  # records without a directory
    refreshed: list[str] = field(default_factory=list)        # records updated to their newer files

    def __bool__(self) -> bool:
        return any((self.restored, self.removed_partial, self.removed_orphans, self.removed_records, self.refreshed))


def _base_name(hidden: str, prefix: str) -> str:
    return hidden[len(prefix):].rsplit("-", 1)[0]


def _recover_kind_dir(kind_dir: Path, report: RecoveryReport) -> None:
    entries = list(kind_dir.iterdir())
    finals = {e.name for e in entries if not e.name.startswith(".")}
    olds = sorted((e for e in entries if e.name.startswith(".old-")), key=lambda e: e.stat().st_mtime, reverse=True)
    for old in olds:
        name = _base_name(old.name, ".old-")
        if name not in finals:  # killed between the two renames of an overwrite: put the old one back
            os.rename(old, kind_dir / name)
            finals.add(name)
            report.restored.append(str(kind_dir / name))
        else:
            shutil.rmtree(old, ignore_errors=True)
    for e in entries:
        if e.name.startswith((".tmp-", ".trash-")) and e.exists():
            shutil.rmtree(e, ignore_errors=True)
            report.removed_partial.append(str(e))


def _manifest_time(path: Path) -> float | None:
    try:
        return float(json.loads((path / MANIFEST).read_text())["created_at"])
    except (OSError, ValueError, KeyError, TypeError):
        return None


def recover(store: Store, root: Path) -> RecoveryReport:
    """Make records and directories agree after a crash (run before serving)."""
    report = RecoveryReport()
    run_dirs = [d for d in root.iterdir() if d.is_dir()] if root.is_dir() else []
    for run_dir in run_dirs:
        for kind_dir in run_dir.iterdir():
            if kind_dir.is_dir() and kind_dir.name in KIND_TYPES:
                _recover_kind_dir(kind_dir, report)
    known: set[Path] = set()
    for row in store.all_checkpoints():
        expected = root / row["model_id"] / row["checkpoint_id"]
        path = expected if expected.is_dir() else Path(row["dir"])
        known.add(expected)
        tag = f"tinker://{row['model_id']}/{row['checkpoint_id']}"
        if not ((path / ADAPTER_WEIGHTS).is_file() and (path / ADAPTER_CONFIG).is_file()):
            store.delete_checkpoint_if(row["model_id"], row["checkpoint_id"])
            report.removed_records.append(tag)
            continue
        written = _manifest_time(path)
        if written is not None and written > row["created_at"]:  # an overwrite renamed in, record not updated
            store.set_checkpoint_files(row["model_id"], row["checkpoint_id"], dir_size(path), written)
            report.refreshed.append(tag)
    # Directories no record lists. Only in runs the database knows: a lost or replaced database
    # must never turn into deleted checkpoints.
    for run_dir in run_dirs:
        if store.get_model(run_dir.name) is None:
            continue
        for kind_dir in run_dir.iterdir():
            if not (kind_dir.is_dir() and kind_dir.name in KIND_TYPES):
                continue
            for d in kind_dir.iterdir():
                if not d.name.startswith(".") and d.is_dir() and d not in known:
                    shutil.rmtree(d, ignore_errors=True)
                    report.removed_orphans.append(str(d))
    if report:
        log.warning("checkpoint recovery after an unclean stop: %s", report)
    return report


# -- signed download URLs ---------------------------------------------------------------------------

class UrlSigner:
    """HMAC-SHA256 over (path, expiry) with a secret kept in the data directory (mode 0600), so
    URLs stay valid across restarts and cannot be forged without the file."""

    def __init__(self, key_path: Path):
        self.key = self._load_or_create(key_path)

    @staticmethod
    def _load_or_create(path: Path) -> bytes:
        path.parent.mkdir(parents=True, exist_ok=True)
        for _ in range(2):
            try:
                key = bytes.fromhex(path.read_text().strip())
                if len(key) >= 32:
                    return key
            except (FileNotFoundError, ValueError):
                pass
            tmp = path.parent / f".{path.name}.{uuid.uuid4().hex[:8]}"
            fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
            with os.fdopen(fd, "w") as f:
                f.write(secrets.token_hex(32))
                f.flush()
                os.fsync(f.fileno())
            os.replace(tmp, path)
        raise RuntimeError(f"cannot read or create the URL signing key {path}")

    def signature(self, path: str, expires: int) -> str:
        return hmac.new(self.key, f"{path}\n{expires}".encode(), hashlib.sha256).hexdigest()

    def valid(self, path: str, expires: int, signature: str) -> bool:
        return hmac.compare_digest(self.signature(path, expires), signature)


# -- tar archives -----------------------------------------------------------------------------------

def _tar_header(name: str, size: int, mtime: float) -> bytes:
    info = tarfile.TarInfo(name)
    info.size, info.mtime, info.mode, info.type = size, int(mtime), 0o644, tarfile.REGTYPE
    return info.tobuf(format=tarfile.USTAR_FORMAT)


@dataclass
class OpenFile:
    name: str
    handle: object
    size: int
    mtime: float


def open_checkpoint_files(path: Path) -> list[OpenFile]:
    """Open every file of a checkpoint at once, under the lock: one consistent version of it,
    readable to the end even if the checkpoint is overwritten or deleted meanwhile."""
    with CHECKPOINT_LOCK:
        out = []
        for f in checkpoint_files(path):
            fh = open(f, "rb")
            st = os.fstat(fh.fileno())
            out.append(OpenFile(f.name, fh, st.st_size, st.st_mtime))
        return out


def tar_length(files: list[OpenFile]) -> int:
    return sum(512 + f.size + (-f.size) % 512 for f in files) + 1024


def tar_stream(files: list[OpenFile], chunk: int = 1 << 20) -> Iterator[bytes]:
    """A flat, plain (ustar) tar of `files`, streamed without building it in memory or on disk."""
    try:
        for f in files:
            yield _tar_header(f.name, f.size, f.mtime)
            sent = 0
            while sent < f.size:
                block = f.handle.read(min(chunk, f.size - sent))
                if not block:
                    raise IOError(f"{f.name} shrank while being sent")
                sent += len(block)
                yield block
            yield b"\0" * ((-f.size) % 512)
        yield b"\0" * 1024
    finally:
        for f in files:
            f.handle.close()


def extract_checkpoint_tar(archive: Path, dest: Path) -> list[str]:
    """Extract the checkpoint files of a tar (optionally gzipped) into `dest`, safely.

    Members may sit at the top level or in one directory (`tar -C parent -cf x.tar adapter/`).
    Only regular files named like checkpoint files are taken; links, devices, absolute or `..`
    paths are refused, and other files (README.md, training_args.bin) are skipped.
    """
    taken: list[str] = []
    try:
        tar = tarfile.open(archive, mode="r:*")
    except tarfile.TarError as e:
        raise CheckpointError(f"the upload is not a tar archive ({e})") from None
    with tar:
        for m in tar:
            parts = [p for p in m.name.split("/") if p not in ("", ".")]
            if m.name.startswith("/") or ".." in parts:
                raise CheckpointError(f"archive member {m.name!r} has an unsafe path")
            if m.isdir():
                continue
            if not m.isfile():
                raise CheckpointError(f"archive member {m.name!r} is not a regular file (links are not accepted)")
            if len(parts) > 2:
                continue
            name = parts[-1]
            if name == "adapter_model.bin":
                raise CheckpointError("adapter_model.bin (pickle) is not accepted; save the adapter with "
                                      "safe_serialization=True to get adapter_model.safetensors")
            if name not in CHECKPOINT_FILES:
                continue
            if name in taken:
                raise CheckpointError(f"archive holds {name} twice")
            src = tar.extractfile(m)
            with open(dest / name, "wb") as out:
                shutil.copyfileobj(src, out, 1 << 20)
            taken.append(name)
    return taken


# -- import -------------------------------------------------------------------------------------------

def check_fits(ckpt: LoadedCheckpoint, layers: dict[str, MultiLoRALinear]) -> None:
    """Refuse an adapter the served model cannot load exactly (before it is ever listed)."""
    present = sorted({k.rsplit(".lora_", 1)[0] for k in ckpt.tensors})
    unknown = [p for p in present if p not in layers]
    if unknown:
        raise CheckpointError(f"the adapter does not fit the served base model: it adapts {unknown[0]!r}, "
                              "which is not a linear projection of this model")
    expected = [p for p in sorted(layers) if ckpt.config.adapts(p)]
    missing = [p for p in expected if p not in present]
    if missing:
        raise CheckpointError(f"the adapter leaves out {missing[0]!r} among the projections it targets; adapters "
                              "restricted to some layers (layers_to_transform) are not supported")
    r = ckpt.config.rank
    for p in present:
        a, b = ckpt.tensors.get(f"{p}.lora_A.weight"), ckpt.tensors.get(f"{p}.lora_B.weight")
        if a is None or b is None or len(ckpt.tensors) != 2 * len(present):
            raise CheckpointError(f"the adapter has tensors other than lora_A/lora_B weights (at {p!r}); "
                                  "only plain LoRA (no bias, no modules_to_save, no embedding LoRA) is supported")
        layer = layers[p]
        if tuple(a.shape) != (r, layer.in_features) or tuple(b.shape) != (layer.out_features, r):
            raise CheckpointError(f"{p}: LoRA shapes {list(a.shape)} / {list(b.shape)} do not fit this model "
                                  f"(rank {r} needs [{r}, {layer.in_features}] / [{layer.out_features}, {r}])")


def _peft_config_problems(cfg: dict) -> str | None:
    if cfg.get("peft_type", "LORA") != "LORA":
        return f"peft_type {cfg.get('peft_type')!r} is not LORA"
    for key in ("use_dora", "use_rslora"):
        if cfg.get(key):
            return f"{key} adapters are not supported"
    for key in ("rank_pattern", "alpha_pattern"):
        if cfg.get(key):
            return f"{key} (per-module ranks or alphas) is not supported"
    if cfg.get("modules_to_save"):
        return "modules_to_save is not supported (only LoRA factors are)"
    if cfg.get("bias", "none") != "none":
        return f"bias={cfg.get('bias')!r} is not supported"
    if cfg.get("layers_to_transform") is not None:
        return "layers_to_transform is not supported"
    return None


def prepare_import(src: Path, *, base_model: str, layers: dict[str, MultiLoRALinear]) -> tuple[LoadedCheckpoint, dict]:
    """Validate the adapter in `src` for the served model; return it as read and its manifest.

    A hosted-tinker checkpoint (with manifest.json, maybe optimizer.safetensors) keeps its manifest
    once its checksums verify; a plain PEFT adapter gets a manifest describing it.
    """
    if not (src / ADAPTER_CONFIG).is_file() or not (src / ADAPTER_WEIGHTS).is_file():
        raise CheckpointError(f"an adapter needs {ADAPTER_CONFIG} and {ADAPTER_WEIGHTS}")
    has_manifest = (src / MANIFEST).is_file()
    if (src / OPTIMIZER_STATE).is_file() and not has_manifest:
        raise CheckpointError(f"{OPTIMIZER_STATE} without the {MANIFEST} that describes it")
    if not has_manifest:
        try:
            peft_cfg = json.loads((src / ADAPTER_CONFIG).read_text())
        except ValueError as e:
            raise CheckpointError(f"{ADAPTER_CONFIG} is not valid JSON ({e})") from None
        problem = _peft_config_problems(peft_cfg) if isinstance(peft_cfg, dict) else "not a JSON object"
        if problem:
            raise CheckpointError(f"unsupported adapter: {problem}")
    try:
        ckpt = read_checkpoint(src, with_optimizer=(src / OPTIMIZER_STATE).is_file())
    except CheckpointError:
        raise
    except Exception as e:  # a safetensors header that does not parse, a manifest of the wrong shape, ...
        raise CheckpointError(f"the adapter files cannot be read: {type(e).__name__}: {e}") from None
    if has_manifest and ckpt.base_model != base_model:
        raise CheckpointError(f"the checkpoint was trained on {ckpt.base_model!r}; this server serves {base_model!r}")
    check_fits(ckpt, layers)
    if has_manifest:
        return ckpt, json.loads((src / MANIFEST).read_text())
    files = [ADAPTER_WEIGHTS, ADAPTER_CONFIG]
    return ckpt, {
        "format": "hosted-tinker-lora/1",
        "base_model": base_model,
        "lora_config": ckpt.config.to_dict(),
        "step": 0,
        "has_optimizer": False,
        "created_at": time.time(),
        "files": {f: {"bytes": (src / f).stat().st_size, "sha256": _sha256(src / f)} for f in files},
        "imported_from": {"base_model_name_or_path": ckpt.base_model or None},
    }


def write_import(src: Path, out_dir: Path, manifest: dict) -> int:
    """Copy a prepared import into place atomically (replacing what is there); return its bytes."""
    def write(tmp: Path) -> None:
        for name in CHECKPOINT_FILES:
            if name != MANIFEST and (src / name).is_file():
                shutil.copyfile(src / name, tmp / name)
        (tmp / MANIFEST).write_text(json.dumps(manifest, indent=2))

    write_atomically(out_dir, write, overwrite=True)
    return dir_size(out_dir)
