"""Load the base model and tokenizer: the same `from_pretrained` path for every model.

The embedded default model is first built on disk (deterministically, no download) and then
loaded exactly like `Qwen/Qwen3-8B` would be, so the code the tests exercise is the code that
serves real models.

`check_model_available` answers in milliseconds whether a model can be loaded at all (a local
directory, the Hugging Face cache, or a reachable hub), so that a missing model is one clear line
at start-up rather than a long traceback after transformers' retries.
"""

from __future__ import annotations

import json
import logging
import time
from pathlib import Path
from typing import TYPE_CHECKING

from .embedded import EMBEDDED_MODEL_NAME, ensure_embedded_model, no_progress_bars

if TYPE_CHECKING:
    import torch

log = logging.getLogger(__name__)

# torch is imported only where a tensor type is needed: the start-up checks (check_model_available)
# come before it, since importing torch takes seconds on a busy machine.
DTYPES = {"float32": "float32", "float": "float32", "bfloat16": "bfloat16", "float16": "float16", "half": "float16"}
# How long the start-up check waits for the hub to answer: a reachable hub answers in well under a
# second; an unreachable one is reported at once instead of after minutes of retries.
HUB_PROBE_TIMEOUT_S = 5.0


class ModelUnavailable(RuntimeError):
    """The base model cannot be loaded; the message says why and what to do (one line)."""


def pick_device(spec: str) -> torch.device:
    import torch

    if spec == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(spec)


def pick_dtype(spec: str, device: torch.device) -> torch.dtype:
    import torch

    if spec == "auto":
        return torch.bfloat16 if device.type == "cuda" else torch.float32
    try:
        return getattr(torch, DTYPES[spec])
    except KeyError:
        raise ValueError(f"unknown dtype {spec!r}; use auto, {', '.join(DTYPES)}") from None


def _is_path(name: str) -> bool:
    return name.startswith(("/", ".", "~")) or Path(name).expanduser().exists()


def check_model_available(name: str) -> str:
    """Where `name` will be loaded from (for the start-up log); raises `ModelUnavailable` at once if nowhere."""
    if name == EMBEDDED_MODEL_NAME:
        return "a local build (no download)"
    if _is_path(name):
        path = Path(name).expanduser()
        if not path.is_dir():
            raise ModelUnavailable(f"--base-model {name}: no such directory")
        if not (path / "config.json").is_file():
            raise ModelUnavailable(f"--base-model {name}: {path} holds no config.json, so it is not a Hugging Face "
                                   "model directory")
        return f"local directory {path.resolve()}"
    from huggingface_hub import constants, try_to_load_from_cache
    from huggingface_hub.utils import HFValidationError, validate_repo_id

    try:
        validate_repo_id(name)
    except HFValidationError:
        raise ModelUnavailable(f"--base-model {name}: neither a local directory nor a Hugging Face model id "
                               "(org/name)") from None
    if isinstance(try_to_load_from_cache(name, "config.json"), str):
        return f"the Hugging Face cache ({constants.HF_HUB_CACHE})"
    where = f"not in the Hugging Face cache ({constants.HF_HUB_CACHE})"
    fix = (f"download it where the hub is reachable (`hf download {name}`) into this cache (HF_HOME), "
           "or pass a local model directory")
    if constants.HF_HUB_OFFLINE:
        raise ModelUnavailable(f"--base-model {name}: {where} and HF_HUB_OFFLINE is set: {fix}")
    import httpx
    from huggingface_hub.utils import build_hf_headers

    try:
        answer = httpx.head(f"{constants.ENDPOINT}/api/models/{name}", headers=build_hf_headers(),
                            timeout=HUB_PROBE_TIMEOUT_S, follow_redirects=True)
    except httpx.HTTPError as e:
        raise ModelUnavailable(f"--base-model {name}: {where} and {constants.ENDPOINT} cannot be reached "
                               f"({type(e).__name__}): {fix}") from None
    if answer.status_code in (401, 403, 404):
        raise ModelUnavailable(f"--base-model {name}: {constants.ENDPOINT} answered {answer.status_code}: no such "
                               "model, or a gated one (accept its licence on the hub and set HF_TOKEN)")
    return f"a download from {constants.ENDPOINT} (not cached yet)"


def local_config(name: str) -> dict | None:
    """`name`'s config.json as this machine has it (a local directory, or the Hugging Face cache);
    None for the embedded model and a model not downloaded yet. Read as JSON: no transformers import."""
    if name == EMBEDDED_MODEL_NAME:
        return None
    if _is_path(name):
        found: str | Path | None = Path(name).expanduser() / "config.json"
    else:
        from huggingface_hub import try_to_load_from_cache

        found = try_to_load_from_cache(name, "config.json")
    if not isinstance(found, (str, Path)) or not Path(found).is_file():
        return None
    try:
        return json.loads(Path(found).read_text())
    except (OSError, ValueError):
        return None  # the model's own load says what is wrong with it


def model_directory(name: str, data_dir: Path) -> Path:
    """The local directory holding `name`'s files (built, given, or the Hugging Face cache's snapshot)."""
    if name == EMBEDDED_MODEL_NAME:
        return ensure_embedded_model(data_dir / "models")
    if _is_path(name):
        return Path(name).expanduser()
    from huggingface_hub import snapshot_download

    return Path(snapshot_download(name, local_files_only=True))


def resolve_model_source(name: str, data_dir: Path) -> str:
    """The directory or hub id `from_pretrained` should read for `name`."""
    if name == EMBEDDED_MODEL_NAME:
        return str(ensure_embedded_model(data_dir / "models"))
    return name


def _weights_bytes(source: str) -> int | None:
    path = Path(source)
    if not path.is_dir():
        return None
    return sum(f.stat().st_size for f in path.iterdir() if f.suffix in (".safetensors", ".bin"))


def load_base_model(name: str, data_dir: Path, device: torch.device, dtype: torch.dtype):
    """Return (model, tokenizer) for `name`, on `device`, frozen. Logs each stage: a big model takes minutes."""
    from transformers import AutoConfig, AutoModelForCausalLM, AutoModelForImageTextToText, AutoTokenizer

    source = resolve_model_source(name, data_dir)
    t0 = time.perf_counter()
    size = _weights_bytes(source)
    log.info("loading base model %s from %s (%s, %s%s) ...", name, source, device, dtype,
             f", {size / 2**20:.1f} MiB of weights" if size else "")
    tokenizer = AutoTokenizer.from_pretrained(source)
    log.info("loading base model: tokenizer ready (%d tokens); reading weights ...", len(tokenizer))
    # A vision-language model whole (its vision tower too), so that it takes images.
    vision = getattr(AutoConfig.from_pretrained(source), "vision_config", None) is not None
    with no_progress_bars():
        model = (AutoModelForImageTextToText if vision else AutoModelForCausalLM).from_pretrained(source, dtype=dtype)
    if device.type != "cpu":
        log.info("loading base model: weights read in %.1fs; moving them to %s ...", time.perf_counter() - t0, device)
    model.to(device)
    n_params = sum(p.numel() for p in model.parameters())
    log.info("base model %s ready: %.1fM parameters in %.1fs", name, n_params / 1e6, time.perf_counter() - t0)
    return model, tokenizer

