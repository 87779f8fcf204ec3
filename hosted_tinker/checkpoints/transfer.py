"""Checkpoints in and out of the server: tar archives, signed download URLs, and imports.

What arrives here comes from anyone with an API key, so every input is bounded: an upload's
bytes *after* decompression, its number of entries and the size of each file; only regular
files with checkpoint names are taken from an archive; an imported adapter must fit the served
model and its rank limit before it is listed, and its manifest is rebuilt from checked values.
"""

from __future__ import annotations

import bz2
import gzip
import hashlib
import hmac
import lzma
import shutil
import tarfile
import zlib
from dataclasses import dataclass
from pathlib import Path
from typing import BinaryIO, Iterator, Literal, Protocol

from ..runtime.multi_lora import FusedPart, MultiLoRALinear
from ..store.secret_files import load_or_create_secret
from .adapter_io import check_fits, write_peft_files
from .catalog import OpenFile
from .format import (
    ADAPTER_CONFIG, ADAPTER_WEIGHTS, CHECKPOINT_FILES, MANIFEST, OPTIMIZER_STATE, CheckpointError, ImportedFrom,
    LoadedCheckpoint, read_json_object, describe, read_checkpoint, read_manifest, write_atomically,
)
from .paths import TinkerPath

# A checkpoint archive holds at most four files; a few directories and skipped extras
# (README.md, training_args.bin) fit easily. More entries than this is not an adapter.
MAX_ARCHIVE_ENTRIES = 64
SIGNED_URL_TTL_S = 3600  # download URLs from external_weights_urls live this long


# What a decompressor raises for data that is not what its header says.
_BAD_COMPRESSED = (OSError, EOFError, zlib.error, lzma.LZMAError)


class ArchiveTooLarge(CheckpointError):
    """An upload above the size limit once decompressed (answered with 413)."""


# -- signed download URLs ---------------------------------------------------------------------------

@dataclass(frozen=True)
class DownloadGrant:
    """What a signed URL allows: one file of one *version* of a checkpoint, until `expires`,
    because its owner asked (`scope='owner'`) or because it was published (`'public'`).
    Checked again on every use: a new version, or an unpublished one, ends the grant."""
    path: TinkerPath
    filename: str
    expires: int
    version: str
    scope: Literal["owner", "public"]

    def message(self) -> bytes:
        return "\n".join((str(self.path), self.filename, str(self.expires), self.version, self.scope)).encode()


class Grant(Protocol):
    """What a signed URL allows, as the bytes its signature covers. Each kind of grant starts its message
    differently, so that no signature of one kind is valid for another."""

    def message(self) -> bytes: ...


class UrlSigner:
    """HMAC-SHA256 over a `DownloadGrant` with a secret kept in the data directory (mode 0600),
    so URLs stay valid across restarts and cannot be forged without the file."""

    def __init__(self, key_path: Path):
        self.key = load_or_create_secret(key_path)

    def signature(self, grant: Grant) -> str:
        return hmac.new(self.key, grant.message(), hashlib.sha256).hexdigest()

    def valid(self, grant: Grant, signature: str) -> bool:
        # Compared as bytes: compare_digest raises TypeError on a str with a non-ASCII character,
        # and a URL's signature is whatever its sender wrote.
        return hmac.compare_digest(self.signature(grant).encode(), signature.encode("utf-8", "replace"))


# -- tar archives out -------------------------------------------------------------------------------

def _tar_header(name: str, size: int, mtime: float) -> bytes:
    info = tarfile.TarInfo(name)
    info.size, info.mtime, info.mode, info.type = size, int(mtime), 0o644, tarfile.REGTYPE
    return info.tobuf(format=tarfile.USTAR_FORMAT)


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


# -- tar archives in --------------------------------------------------------------------------------

class _Bounded:
    """A reader that fails once more than `limit` bytes came through it: placed after the
    decompressor, it bounds what a small compressed upload can expand to (a 1 MB gzip of
    zeros is 1 GB of tar)."""

    def __init__(self, f: BinaryIO, limit: int | None):
        self.f, self.limit, self.count = f, limit, 0

    def read(self, n: int = -1) -> bytes:
        if self.limit is not None:
            room = self.limit - self.count + 1  # one byte past the limit proves it is exceeded
            n = room if n is None or n < 0 else min(n, room)
        try:
            data = self.f.read(n)
        except _BAD_COMPRESSED as e:  # BadGzipFile, a truncated stream, ...: the upload's fault
            raise CheckpointError(f"the upload cannot be decompressed ({type(e).__name__})") from None
        self.count += len(data)
        if self.limit is not None and self.count > self.limit:
            raise ArchiveTooLarge(f"the archive is larger than {self.limit} bytes once decompressed")
        return data


def _decompressed(raw: BinaryIO) -> BinaryIO:
    head = raw.read(6)
    raw.seek(0)
    if head.startswith(b"\x1f\x8b"):
        return gzip.GzipFile(fileobj=raw, mode="rb")
    if head.startswith(b"BZh"):
        return bz2.BZ2File(raw, mode="rb")
    if head.startswith(b"\xfd7zXZ\x00"):
        return lzma.LZMAFile(raw, mode="rb")
    return raw


def extract_checkpoint_tar(archive: Path, dest: Path, *, max_bytes: int | None) -> list[str]:
    """Extract the checkpoint files of a tar (plain, gzip, bz2 or xz) into `dest`, safely.

    Members may sit at the top level or in one directory (`tar -C parent -cf x.tar adapter/`).
    Only regular files named like checkpoint files are taken; links, devices, sparse files,
    absolute or `..` paths are refused, and other files (README.md, training_args.bin) are
    skipped. The archive is read as a stream, at most `max_bytes` of it once decompressed.
    """
    taken: list[str] = []
    with open(archive, "rb") as raw:
        stream = _Bounded(_decompressed(raw), max_bytes)
        try:
            tar = tarfile.open(fileobj=stream, mode="r|")
        except tarfile.TarError as e:
            raise CheckpointError(f"the upload is not a tar archive ({type(e).__name__})") from None
        with tar:
            try:
                for count, m in enumerate(tar, 1):
                    if count > MAX_ARCHIVE_ENTRIES:
                        raise CheckpointError(f"the archive holds more than {MAX_ARCHIVE_ENTRIES} entries; "
                                              "an adapter has at most four files")
                    name = _member_name(m)
                    if name is None:
                        continue
                    if name in taken:
                        raise CheckpointError(f"archive holds {name} twice")
                    with open(dest / name, "wb") as out:
                        shutil.copyfileobj(tar.extractfile(m), out, 1 << 20)
                    taken.append(name)
            except tarfile.TarError as e:
                raise CheckpointError(f"the archive is damaged or truncated ({type(e).__name__})") from None
    return taken


def _member_name(m: tarfile.TarInfo) -> str | None:
    """The checkpoint file a member is, None to skip it; refuses what must not be extracted."""
    parts = [p for p in m.name.split("/") if p not in ("", ".")]
    shown = m.name[:200]
    if m.name.startswith("/") or ".." in parts:
        raise CheckpointError(f"archive member {shown!r} has an unsafe path")
    if m.isdir():
        return None
    if not m.isfile() or m.issparse():
        raise CheckpointError(f"archive member {shown!r} is not a regular file (links and devices are not accepted)")
    if len(parts) > 2:
        return None
    name = parts[-1]
    if name == "adapter_model.bin":
        raise CheckpointError("adapter_model.bin (pickle) is not accepted; save the adapter with "
                              "safe_serialization=True to get adapter_model.safetensors")
    return name if name in CHECKPOINT_FILES else None


# -- import -----------------------------------------------------------------------------------------

def _peft_config_problems(cfg: dict) -> str | None:
    if cfg.get("peft_type", "LORA") != "LORA":
        return f"peft_type {str(cfg.get('peft_type'))[:64]!r} is not LORA"
    for key in ("use_dora", "use_rslora"):
        if cfg.get(key):
            return f"{key} adapters are not supported"
    for key in ("rank_pattern", "alpha_pattern"):
        if cfg.get(key):
            return f"{key} (per-module ranks or alphas) is not supported"
    if cfg.get("modules_to_save"):
        return "modules_to_save is not supported (only LoRA factors are)"
    if cfg.get("bias", "none") != "none":
        return f"bias={str(cfg.get('bias'))[:64]!r} is not supported"
    if cfg.get("layers_to_transform") is not None:
        return "layers_to_transform is not supported"
    return None


@dataclass
class PreparedImport:
    checkpoint: LoadedCheckpoint
    files: list[str]  # the data files to copy (the manifest is written from `checkpoint`)
    imported_from: ImportedFrom | None
    # an adapter in Tinker's layout of fused projections is written in ours (PEFT's, which vLLM and
    # the merged export read): {LoRA path: fused part} of the served model, else None (copied)
    rewrite_parts: dict[str, FusedPart] | None = None


def prepare_import(src: Path, *, base_model: str, layers: dict[str, MultiLoRALinear],
                   max_rank: int) -> PreparedImport:
    """Validate the adapter in `src` for the served model and its rank limit.

    A hosted-tinker checkpoint (with manifest.json, maybe optimizer.safetensors) keeps its step
    and optimizer state once its checksums verify; a plain PEFT adapter starts at step 0.
    """
    present = {n for n in CHECKPOINT_FILES if (src / n).is_file()}
    if ADAPTER_CONFIG not in present or ADAPTER_WEIGHTS not in present:
        raise CheckpointError(f"an adapter needs {ADAPTER_CONFIG} and {ADAPTER_WEIGHTS}")
    has_manifest = MANIFEST in present
    if OPTIMIZER_STATE in present and not has_manifest:
        raise CheckpointError(f"{OPTIMIZER_STATE} without the {MANIFEST} that describes it")
    imported_from = None
    if has_manifest:
        imported_from = read_manifest(src).imported_from
    else:
        problem = _peft_config_problems(read_json_object(src, ADAPTER_CONFIG))
        if problem:
            raise CheckpointError(f"unsupported adapter: {problem}")
    ckpt = read_checkpoint(src, with_optimizer=OPTIMIZER_STATE in present, layers=layers)
    if has_manifest and ckpt.base_model != base_model:
        raise CheckpointError(f"the checkpoint was trained on {ckpt.base_model[:200]!r}; this server serves "
                              f"{base_model!r}")
    check_fits(ckpt, layers, max_rank=max_rank)
    if not has_manifest:
        imported_from = ImportedFrom(base_model_name_or_path=ckpt.base_model or None)
        ckpt.base_model = base_model
    parts = {p: layer.part for p, layer in layers.items() if layer.part is not None}
    return PreparedImport(ckpt, sorted(present - {MANIFEST}), imported_from, parts if ckpt.tinker_layout else None)


def write_import(src: Path, prepared: PreparedImport):
    """`write(folder)` for `CheckpointCatalog.save`: the checked files and a manifest rebuilt
    from checked values (written now: nothing of the uploaded manifest is copied unchecked)."""
    ckpt = prepared.checkpoint

    def write(tmp: Path) -> None:
        for name in prepared.files:
            shutil.copyfile(src / name, tmp / name)
        if prepared.rewrite_parts is not None:
            write_peft_files(tmp, ckpt.tensors, prepared.rewrite_parts, ckpt.config, ckpt.base_model)
        manifest = describe(tmp, prepared.files, base_model=ckpt.base_model, config=ckpt.config, step=ckpt.step,
                            imported_from=prepared.imported_from)
        (tmp / MANIFEST).write_text(manifest.to_json())

    return lambda folder: write_atomically(folder, write, overwrite=True)

