"""Reading a checkpoint folder's files when they may be hostile (an import, a folder tampered with).

Only the four checkpoint file names are ever opened, each only if it is a plain regular file (no
link, no device, no FIFO); reads stop at the file's size; JSON files are small; a tensor file's
header is checked before any of its data is read: floating-point tensors only, and no more values
than the reader says the checkpoint can hold (a rank-r LoRA of the served model has a known size,
so a file that claims more is refused in milliseconds, not after gigabytes were read and
converted). Error messages name files and tensors, never the server's paths.
"""

from __future__ import annotations

import json
import math
import os
import stat
from pathlib import Path
from typing import BinaryIO

import torch
from safetensors import safe_open
from safetensors.torch import load_file

MANIFEST = "manifest.json"
ADAPTER_WEIGHTS = "adapter_model.safetensors"
ADAPTER_CONFIG = "adapter_config.json"
OPTIMIZER_STATE = "optimizer.safetensors"
CHECKPOINT_FILES = (ADAPTER_CONFIG, ADAPTER_WEIGHTS, MANIFEST, OPTIMIZER_STATE)  # nothing else is ever read
# adapter_config.json and manifest.json are about 1 KB; anything near this bound is not one.
MAX_JSON_BYTES = 1 << 20
FLOATING = {"F16", "BF16", "F32", "F64"}  # safetensors' names of the dtypes a LoRA or its moments may have


class CheckpointError(ValueError):
    """A checkpoint that cannot be used (missing, corrupt, hostile, or for another base model)."""


def present(folder: Path, name: str) -> bool:
    return os.path.lexists(folder / name)


def open_plain(folder: Path, name: str) -> tuple[BinaryIO, int]:
    """(file, size) of checkpoint file `name`: a plain regular file directly in `folder`."""
    if name not in CHECKPOINT_FILES:
        raise CheckpointError(f"{name[:64]!r} is not a checkpoint file")
    try:
        # O_NOFOLLOW: a link is refused, not followed. O_NONBLOCK: opening a FIFO does not wait.
        fd = os.open(folder / name, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK)
    except FileNotFoundError:
        raise CheckpointError(f"{name} is missing") from None
    except OSError as e:  # ELOOP for a link; the message must not carry the server's path
        raise CheckpointError(f"{name} cannot be opened ({e.strerror})") from None
    st = os.fstat(fd)
    if not stat.S_ISREG(st.st_mode):
        os.close(fd)
        raise CheckpointError(f"{name} is not a regular file")
    return os.fdopen(fd, "rb"), st.st_size


def read_small(folder: Path, name: str) -> bytes:
    f, size = open_plain(folder, name)
    with f:
        if size > MAX_JSON_BYTES:
            raise CheckpointError(f"{name} is {size} bytes; a checkpoint's JSON files are at most {MAX_JSON_BYTES}")
        return f.read(size)


def read_json_object(folder: Path, name: str) -> dict:
    raw = read_small(folder, name)
    try:
        value = json.loads(raw)
    except (ValueError, RecursionError) as e:  # JSONDecodeError / UnicodeDecodeError / nesting
        raise CheckpointError(f"{name}: not valid JSON, the checkpoint is corrupt ({type(e).__name__})") from None
    if not isinstance(value, dict):
        raise CheckpointError(f"{name}: not a JSON object")
    return value


def load_tensors(folder: Path, name: str, *, max_values: int | None = None,
                 holds: str = "") -> dict[str, torch.Tensor]:
    """The tensors of `name`, once its header says they are floating point and (with `max_values`)
    hold no more values than that; `holds` says what that bound is, for the refusal."""
    f, _ = open_plain(folder, name)  # a regular file, not a link: safe to hand to safetensors by path
    f.close()
    try:
        with safe_open(str(folder / name), framework="pt") as header:
            values = 0
            for key in header.keys():
                piece = header.get_slice(key)
                if piece.get_dtype() not in FLOATING:
                    raise CheckpointError(f"{name}: {key[:200]} is of dtype {piece.get_dtype()}; a LoRA and its "
                                          "optimizer state are floating point")
                values += math.prod(piece.get_shape())
        if max_values is not None and values > max_values:
            raise CheckpointError(f"{name} holds {values} values; {holds} holds at most {max_values}")
        return load_file(str(folder / name))
    except CheckpointError:
        raise
    except OSError as e:
        raise CheckpointError(f"{name} cannot be read ({e.strerror})") from None
    except Exception as e:  # safetensors' own error: a header that does not parse, offsets past the end
        raise CheckpointError(f"{name} is not a valid safetensors file ({e})") from None
