"""Checkpoint files: a standard PEFT adapter, plus optimizer state and a manifest for training state.

Layout of one checkpoint folder:

    adapter_config.json          PEFT LoraConfig (r, lora_alpha, target_modules, rank_pattern, ...)
    adapter_model.safetensors    PEFT key names: base_model.model.<path>.lora_{A,B}.weight
    optimizer.safetensors        AdamW moments + step per tensor (training state only)
    manifest.json                base model, LoRA config, step, creation time, sizes, sha256

PEFT and vLLM load the first two as they are. A fused projection (Phi3's qkv_proj, GPT-2's c_attn)
is trained as one LoRA per component (Tinker's layout) and saved as PEFT's one LoRA on the fused
module, of rank components x rank (`to_peft`): what the cookbook's `build_lora_adapter` makes of
Tinker's component LoRAs, and what its `build_hf_model` and PEFT merge exactly. Reading takes that
form (`from_peft`) and Tinker's own, the components' LoRAs beside the fused module
(`from_tinker_layout`). Every folder is written under a temporary name and renamed into place, so a
reader (or a restart after kill -9) never sees half of one.

A folder may come from someone else (an import), so reading one trusts nothing in it: its files
are read as untrusted.py reads them (the four names above only, plain files, headers checked
before data), and every manifest field is checked for type and range before use. Error messages
name files, never the server's paths.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import re
import shutil
import time
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

import torch
from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

from .. import faults
from .untrusted import (  # the file names and CheckpointError are read from here by the package's importers
    ADAPTER_CONFIG as ADAPTER_CONFIG, ADAPTER_WEIGHTS as ADAPTER_WEIGHTS, CHECKPOINT_FILES as CHECKPOINT_FILES,
    MANIFEST as MANIFEST, OPTIMIZER_STATE as OPTIMIZER_STATE, CheckpointError as CheckpointError, load_tensors,
    open_plain, present, read_json_object as read_json_object, read_small,
)
from ..runtime.adapters import LoRAConfig
from ..runtime.multi_lora import FusedPart, MultiLoRALinear
from ..runtime.projections import served_names, tinker_name

PEFT_PREFIX = "base_model.model."
MANIFEST_FORMAT = "hosted-tinker-lora/1"
# The last moment `datetime` can print (9999-12-31T23:59:59Z): a time past it breaks every listing.
LATEST_TIME = 253402300799.0
_MODULE_NAME_RE = re.compile(r"[A-Za-z_][A-Za-z0-9_]{0,63}")
_SHA256_RE = re.compile(r"[0-9a-f]{64}")


# -- the manifest ---------------------------------------------------------------------------------

class _Strict(BaseModel):
    # strict: a JSON 1 is not a bool, "4" is not an int; unknown fields are dropped, never stored.
    model_config = ConfigDict(strict=True, extra="ignore", frozen=True)


class FileEntry(_Strict):
    bytes: int = Field(ge=0, le=1 << 50)
    sha256: str

    @field_validator("sha256")
    @classmethod
    def _hex(cls, v: str) -> str:
        if not _SHA256_RE.fullmatch(v):
            raise ValueError("not a sha256 hex digest")
        return v


class ManifestLoRA(_Strict):
    """`LoRAConfig`, as a manifest stores it."""
    rank: int = Field(ge=1, le=1 << 16)  # a sanity bound; the server's --max-lora-rank applies on load
    seed: int = Field(ge=-(1 << 63), le=(1 << 64) - 1)  # what torch.Generator.manual_seed takes
    train_mlp: bool
    train_attn: bool
    train_unembed: bool
    alpha: float = Field(gt=0, le=1e6, allow_inf_nan=False)
    target_modules: tuple[str, ...] | None = Field(None, max_length=64)

    @field_validator("target_modules")
    @classmethod
    def _module_names(cls, v):
        if v is not None and not all(_MODULE_NAME_RE.fullmatch(m) for m in v):
            raise ValueError("target_modules must be projection names such as 'q_proj'")
        return v

    def config(self) -> LoRAConfig:
        return LoRAConfig(**self.model_dump())


class ImportedFrom(_Strict):
    base_model_name_or_path: str | None = Field(None, max_length=1000)


class Manifest(_Strict):
    format: Literal["hosted-tinker-lora/1"]
    base_model: str = Field(max_length=1000)
    lora_config: ManifestLoRA
    step: int = Field(ge=0, le=1 << 53)
    has_optimizer: bool
    created_at: float = Field(ge=0, le=LATEST_TIME, allow_inf_nan=False)
    files: dict[str, FileEntry]
    imported_from: ImportedFrom | None = None

    @model_validator(mode="after")
    def _files(self) -> "Manifest":
        unknown = sorted(set(self.files) - {ADAPTER_CONFIG, ADAPTER_WEIGHTS, OPTIMIZER_STATE})
        if unknown:
            raise ValueError(f"lists {unknown[0][:64]!r}, which is not a checkpoint file")
        if ADAPTER_CONFIG not in self.files or ADAPTER_WEIGHTS not in self.files:
            raise ValueError(f"must list {ADAPTER_CONFIG} and {ADAPTER_WEIGHTS}")
        if self.has_optimizer != (OPTIMIZER_STATE in self.files):
            raise ValueError(f"has_optimizer must say whether {OPTIMIZER_STATE} is listed")
        return self

    def to_json(self) -> str:
        return json.dumps(self.model_dump(mode="json", exclude_none=True), indent=2)


def parse_manifest(raw: bytes | str) -> Manifest:
    try:
        return Manifest.model_validate_json(raw)
    except ValidationError as e:
        err = e.errors()[0]
        where = ".".join(str(p) for p in err["loc"]) or "the file"
        raise CheckpointError(f"{MANIFEST} is not valid ({where}: {err['msg']})") from None


# -- reading files that may be hostile (untrusted.py) -------------------------------------------------

def file_digest(folder: Path, name: str) -> FileEntry:
    """Size and sha256 of one checkpoint file, reading no more than its size."""
    f, size = open_plain(folder, name)
    h = hashlib.sha256()
    with f:
        left = size
        while left > 0:
            block = f.read(min(1 << 20, left))
            if not block:
                raise CheckpointError(f"{name} shrank while being read")
            h.update(block)
            left -= len(block)
    return FileEntry(bytes=size, sha256=h.hexdigest())


def read_manifest(folder: Path) -> Manifest:
    return parse_manifest(read_small(folder, MANIFEST))


# -- writing ----------------------------------------------------------------------------------------

def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def write_atomically(final_dir: Path, write, *, overwrite: bool = False) -> None:
    """Run `write(tmp_dir)` then rename tmp_dir to final_dir (replacing it if `overwrite`)."""
    final_dir.parent.mkdir(parents=True, exist_ok=True)
    tmp = final_dir.parent / f".tmp-{final_dir.name}-{uuid.uuid4().hex[:8]}"
    tmp.mkdir()
    try:
        write(tmp)
        for f in tmp.iterdir():
            with open(f, "rb+") as fh:
                os.fsync(fh.fileno())
        faults.crash_point("checkpoint.before_rename")
        if final_dir.exists():
            if not overwrite:
                raise CheckpointError(f"checkpoint {final_dir.name!r} already exists")
            old = final_dir.parent / f".old-{final_dir.name}-{uuid.uuid4().hex[:8]}"
            os.rename(final_dir, old)
            faults.crash_point("checkpoint.between_renames")
            os.rename(tmp, final_dir)
            faults.crash_point("checkpoint.before_old_removed")
            shutil.rmtree(old, ignore_errors=True)
        else:
            os.rename(tmp, final_dir)
        _fsync_dir(final_dir.parent)
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)


def peft_adapter_config(config: LoRAConfig, base_model: str, module_paths: list[str],
                        fused: dict[str, int] | None = None) -> dict:
    """PEFT's adapter_config.json; `fused`: {fused module path: components}, whose LoRA has rank
    components x rank and alpha components x alpha (so the same scaling, alpha / rank)."""
    leaves = sorted({p.rsplit(".", 1)[-1] for p in module_paths})
    counts = {path.rsplit(".", 1)[-1]: k for path, k in (fused or {}).items()}
    return {
        "peft_type": "LORA",
        "task_type": "CAUSAL_LM",
        "base_model_name_or_path": base_model,
        "r": config.rank,
        "lora_alpha": config.alpha,
        "lora_dropout": 0.0,
        "target_modules": leaves,
        "bias": "none",
        "fan_in_fan_out": False,
        "inference_mode": True,
        "init_lora_weights": True,
        "use_rslora": False,
        "use_dora": False,
        "modules_to_save": None,
        "rank_pattern": {leaf: k * config.rank for leaf, k in counts.items()},
        "alpha_pattern": {leaf: k * config.alpha for leaf, k in counts.items()},
    }


def to_peft(tensors: dict[str, torch.Tensor], parts: dict[str, FusedPart]) -> tuple[dict[str, torch.Tensor], dict[str, int]]:
    """PEFT's form of an adapter's tensors ('<path>.lora_{A,B}.weight'; `parts`: the LoRA paths
    that are components of a fused projection). The components of a fused projection become one
    LoRA on it: A is theirs stacked [components x rank, in], B is block-diagonal [fused out,
    components x rank], each component's B in its output rows and its own rank columns -- the
    cookbook's `_merge_fused_projections`. Returns (tensors, {fused path: components})."""
    out: dict[str, torch.Tensor] = {}
    fused: dict[str, list[tuple[FusedPart, torch.Tensor, torch.Tensor]]] = {}
    for name, t in tensors.items():
        path = name.rsplit(".lora_", 1)[0]
        part = parts.get(path)
        if part is None:
            out[name] = t
        elif name.endswith(".lora_A.weight"):
            fused.setdefault(part.path, []).append((part, t, tensors[f"{path}.lora_B.weight"]))
    for path, comps in fused.items():
        comps.sort(key=lambda c: c[0].index)
        rank = comps[0][1].shape[0]
        B = torch.zeros(comps[0][0].fused_out, rank * len(comps), dtype=comps[0][2].dtype, device=comps[0][2].device)
        for part, _, b in comps:
            B[list(part.rows), part.index * rank:(part.index + 1) * rank] = b
        out[f"{path}.lora_A.weight"] = torch.cat([a for _, a, _ in comps])
        out[f"{path}.lora_B.weight"] = B
    return out, {path: len(comps) for path, comps in fused.items()}


def _file_key(name: str) -> str:
    """The key a checkpoint file holds the tensor `name` (a served model's LoRA path) under."""
    return PEFT_PREFIX + tinker_name(name)


def tinker_component_path(path: str) -> str:
    """Where Tinker's checkpoints keep the LoRA of a fused projection's component (LoRA path
    "...linear_attn.in_proj_qkv.in_proj_q"): beside the fused module, "...linear_attn.in_proj_q",
    as the cookbook's Qwen3.5 profile and `fused_projection_map` read it."""
    fused, _, component = path.rpartition(".")
    return f"{fused.rpartition('.')[0]}.{component}"


def from_tinker_layout(tensors: dict[str, torch.Tensor], layers: dict[str, MultiLoRALinear],
                       rank: int) -> dict[str, torch.Tensor]:
    """`tensors` with the components of fused projections that Tinker's layout keeps beside the fused
    module (`tinker_component_path`) moved to their LoRA paths. Such a projection must have every
    component, each a plain rank-`rank` LoRA, and no LoRA on the fused module itself."""
    out = dict(tensors)
    groups: dict[str, list[tuple[str, MultiLoRALinear]]] = {}
    for path, layer in layers.items():
        if layer.part is not None:
            groups.setdefault(layer.part.path, []).append((path, layer))
    for fused, components in groups.items():
        split = {path: tinker_component_path(path) for path, _ in components}
        found = [f"{src}.lora_{ab}.weight" for src in split.values() for ab in "AB" if f"{src}.lora_{ab}.weight" in out]
        if not found or any(src in layers for src in split.values()):
            continue
        if f"{fused}.lora_A.weight" in out or f"{fused}.lora_B.weight" in out:
            raise CheckpointError(f"{_file_key(found[0])} and {_file_key(fused + '.lora_A.weight')}: the fused "
                                  "projection has LoRAs in both layouts (its components', Tinker's, and one on the "
                                  "whole module, PEFT's); a checkpoint holds one of them")
        for path, layer in components:
            for ab, want in (("A", (rank, layer.in_features)), ("B", (layer.out_features, rank))):
                key = f"{split[path]}.lora_{ab}.weight"
                if key not in out:
                    raise CheckpointError(
                        f"{_file_key(key)} is missing: in Tinker's layout the fused {fused.rpartition('.')[2]} "
                        f"needs a LoRA for each of its components ({', '.join(p.rpartition('.')[2] for p in split)})")
                if tuple(out[key].shape) != want:
                    raise CheckpointError(f"{_file_key(key)}: shape {list(out[key].shape)}, where a rank-{rank} "
                                          f"LoRA of this component is {list(want)}")
                out[f"{path}.lora_{ab}.weight"] = out.pop(key)
    return out


def from_peft(tensors: dict[str, torch.Tensor], layers: dict[str, MultiLoRALinear], rank: int) -> dict[str, torch.Tensor]:
    """The inverse of `to_peft` for the served model's `layers`: a fused module's LoRA back into its
    components' LoRAs. One that couples the components (B not block-diagonal, or of another rank)
    is refused: this server trains them as separate LoRAs, as Tinker does."""
    out = dict(tensors)
    for path, layer in layers.items():
        part = layer.part
        if part is None or f"{part.path}.lora_A.weight" not in tensors:
            continue
        A, B = tensors[f"{part.path}.lora_A.weight"], tensors.get(f"{part.path}.lora_B.weight")
        if B is None:
            raise CheckpointError(f"{_file_key(part.path)}.lora_B.weight is missing beside its lora_A")
        k = part.count
        if A.ndim != 2 or B.ndim != 2 or A.shape[0] != k * rank or B.shape != (part.fused_out, k * rank):
            raise CheckpointError(
                f"{part.path}: a LoRA of shapes {list(A.shape)} / {list(B.shape)} on a fused projection of {k} "
                f"components; this server trains each component as its own rank-{rank} LoRA (Tinker's layout) and "
                f"loads them as one of rank {k * rank} with a block-diagonal B, as it saves them")
        rows = list(part.rows)
        cols = slice(part.index * rank, (part.index + 1) * rank)
        out[f"{path}.lora_A.weight"] = A[cols].clone()
        out[f"{path}.lora_B.weight"] = B[rows, cols].clone()
        out.pop(f"{part.path}.lora_A.weight", None)
        out.pop(f"{part.path}.lora_B.weight", None)
    for layer in layers.values():  # every component read: what is left of B must be zero
        part = layer.part
        if part is None or part.index or f"{part.path}.lora_B.weight" not in tensors:
            continue
        B = tensors[f"{part.path}.lora_B.weight"].clone()
        for other in layers.values():
            if other.part is not None and other.part.path == part.path:
                B[list(other.part.rows), other.part.index * rank:(other.part.index + 1) * rank] = 0
        if B.count_nonzero():
            raise CheckpointError(f"{part.path}: its LoRA B is not block-diagonal: it couples the fused projection's "
                                  "components, which this server trains as separate LoRAs (Tinker's layout)")
    return out


def describe(folder: Path, names: list[str], *, base_model: str, config: LoRAConfig, step: int,
             imported_from: ImportedFrom | None = None) -> Manifest:
    """The manifest of the files `names` in `folder`, written now."""
    return Manifest(format=MANIFEST_FORMAT, base_model=base_model, lora_config=ManifestLoRA(**config.to_dict()),
                    step=step, has_optimizer=OPTIMIZER_STATE in names, created_at=time.time(),
                    files={n: file_digest(folder, n) for n in names}, imported_from=imported_from)


# -- reading ----------------------------------------------------------------------------------------

@dataclass
class LoadedCheckpoint:
    config: LoRAConfig
    base_model: str
    step: int
    tensors: dict[str, torch.Tensor]  # '<path>.lora_A.weight' -> tensor (no PEFT prefix)
    optimizer: dict[str, torch.Tensor] | None
    tinker_layout: bool = False  # its fused projections' LoRAs were in Tinker's layout (`from_tinker_layout`)


def _verify(folder: Path, manifest: Manifest) -> None:
    """Every listed file matches its size and checksum; no data file goes unlisted."""
    for name in (ADAPTER_CONFIG, ADAPTER_WEIGHTS, OPTIMIZER_STATE):
        if name not in manifest.files and present(folder, name):
            raise CheckpointError(f"{name} is not listed in {MANIFEST}, the checkpoint is corrupt")
    for name, want in manifest.files.items():
        if file_digest(folder, name) != want:
            raise CheckpointError(f"{name}: checksum mismatch, the checkpoint is corrupt")


def _config_of_peft(peft_cfg: dict, paths: list[str], layers: dict[str, MultiLoRALinear]) -> tuple[LoRAConfig, str]:
    """The LoRA config of an adapter made elsewhere (PEFT), from its adapter_config.json and files."""
    rank, alpha = peft_cfg.get("r"), peft_cfg.get("lora_alpha", peft_cfg.get("r"))
    if type(rank) is not int or not 1 <= rank <= 1 << 16:
        raise CheckpointError(f"{ADAPTER_CONFIG}: r must be a positive integer")
    if type(alpha) not in (int, float) or not (math.isfinite(alpha) and 0 < alpha <= 1e6):
        raise CheckpointError(f"{ADAPTER_CONFIG}: lora_alpha must be a positive number")
    base_model = peft_cfg.get("base_model_name_or_path") or ""
    if not isinstance(base_model, str) or len(base_model) > 1000:
        raise CheckpointError(f"{ADAPTER_CONFIG}: base_model_name_or_path must be a string")
    if peft_cfg.get("use_dora") or peft_cfg.get("use_rslora"):
        raise CheckpointError("DoRA and rsLoRA adapters are not supported")
    kinds = {layers[p].role for p in paths if p in layers}  # one that is not: `check_fits` names it
    leaves = tuple(sorted({p.rsplit(".", 1)[-1] for p in paths}))
    if not all(_MODULE_NAME_RE.fullmatch(m) for m in leaves):
        raise CheckpointError(f"{ADAPTER_WEIGHTS}: tensor names are not LoRA projection names")
    return LoRAConfig(rank=rank, seed=0, train_attn="attn" in kinds, train_mlp="mlp" in kinds,
                      train_unembed="unembed" in kinds, alpha=float(alpha), target_modules=leaves), base_model


def lora_values(layers: dict[str, MultiLoRALinear], rank: int) -> int:
    """The most values a rank-`rank` LoRA of the served model's `layers` can hold in a file: each
    projection's A and B (every expert's), a fused projection's B as PEFT's block-diagonal one."""
    return sum(math.prod(layer.lora_lead) * rank * (layer.in_features
                                                    + layer.out_features * (layer.part.count if layer.part else 1))
               for layer in layers.values())


def _agrees(peft_cfg: dict, lora: ManifestLoRA) -> None:
    """adapter_config.json says what the manifest says (PEFT and vLLM read the one, this server the
    other: a checkpoint that contradicts itself would sample differently on each)."""
    r, alpha = peft_cfg.get("r"), peft_cfg.get("lora_alpha")
    if r != lora.rank or alpha != lora.alpha:
        raise CheckpointError(f"{ADAPTER_CONFIG} says r={str(r)[:20]}, lora_alpha={str(alpha)[:20]} and {MANIFEST} "
                              f"rank {lora.rank}, alpha {lora.alpha}: the checkpoint contradicts itself")


def read_checkpoint(ckpt_dir: Path, *, with_optimizer: bool,
                    layers: dict[str, MultiLoRALinear] | None = None) -> LoadedCheckpoint:
    """Read a checkpoint written by `adapter_io.save_adapter`, or a plain PEFT adapter folder, for the served
    model's `layers` (its tensors under their LoRA paths: `from_peft`); None only checks the files."""
    if not (present(ckpt_dir, ADAPTER_WEIGHTS) and present(ckpt_dir, ADAPTER_CONFIG)):
        raise CheckpointError(f"not a LoRA adapter (needs {ADAPTER_CONFIG} and {ADAPTER_WEIGHTS})")
    # Verify checksums before parsing anything they cover (adapter_config.json included).
    manifest = read_manifest(ckpt_dir) if present(ckpt_dir, MANIFEST) else None
    if manifest is not None:
        _verify(ckpt_dir, manifest)
    peft_cfg = read_json_object(ckpt_dir, ADAPTER_CONFIG)
    if manifest is not None:
        _agrees(peft_cfg, manifest.lora_config)
    rank = manifest.lora_config.rank if manifest is not None else peft_cfg.get("r")
    bound = lora_values(layers, rank) if layers is not None and type(rank) is int and 1 <= rank <= 1 << 16 else None
    holds = f"a rank-{rank} LoRA of the served model"
    tensors: dict[str, torch.Tensor] = {}
    for key, value in load_tensors(ckpt_dir, ADAPTER_WEIGHTS, max_values=bound, holds=holds).items():
        name = key[len(PEFT_PREFIX):] if key.startswith(PEFT_PREFIX) else key
        # PEFT writes adapter-named keys ("lora_A.default.weight") in some versions' in-memory
        # state dicts; the saved form drops the adapter name, but accept both.
        name = name.replace(".lora_A.default.weight", ".lora_A.weight").replace(
            ".lora_B.default.weight", ".lora_B.weight")
        tensors[name] = value.to(torch.float32)
    if layers is not None:
        tensors = served_names(tensors, layers)
    tinker_layout = False
    if layers is not None and type(rank) is int:  # a bad r is named below
        # A fused projection's LoRA as Tinker keeps it (one per component), or as PEFT does (one on the module)
        split = from_tinker_layout(tensors, layers, rank)
        tinker_layout = split.keys() != tensors.keys()
        tensors = from_peft(split, layers, rank)
    if manifest is not None:
        config, base_model, step = manifest.lora_config.config(), manifest.base_model, manifest.step
    else:  # an adapter made elsewhere (PEFT): derive the config from its files
        config, base_model = _config_of_peft(peft_cfg, sorted({k.rsplit(".lora_", 1)[0] for k in tensors}),
                                             layers or {})
        step = 0
    optimizer = None
    if with_optimizer:
        if not present(ckpt_dir, OPTIMIZER_STATE):
            raise CheckpointError("the checkpoint has no optimizer state (saved for sampling, not with "
                                  "save_state); load it without the optimizer")
        optimizer = load_tensors(ckpt_dir, OPTIMIZER_STATE, max_values=None if bound is None else 3 * bound,
                                 holds=f"the AdamW state of {holds}")
    return LoadedCheckpoint(config=config, base_model=base_model, step=step, tensors=tensors,
                            optimizer=optimizer, tinker_layout=tinker_layout)
