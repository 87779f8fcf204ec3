"""`hosted-tinker export` and `hosted-tinker import`: checkpoints out and in as plain files.

Export, from a running server (`--base-url`/`$TINKER_BASE_URL` and `--api-key`/`$TINKER_API_KEY`;
the caller's own or published checkpoints) or straight from a server's `--data-dir` (the server
may be running or not):

    hosted-tinker export tinker://RUN/weights/NAME --out DIR            # the adapter's files
    hosted-tinker export tinker://RUN/weights/NAME --out DIR --merged   # full model, LoRA merged in

Import, into a running server (the adapter is checked against the served model first):

    hosted-tinker import DIR --name NAME                                # prints tinker://import-.../weights/NAME

An exported adapter directory holds `adapter_config.json` + `adapter_model.safetensors` in Tinker's
layout (what `tinker_cookbook.weights` reads; for a text model without MoE experts also a PEFT
adapter: PEFT maps neither a vision-language model's text-model names nor 3-D expert LoRAs), plus
`manifest.json` and, for training state, `optimizer.safetensors`; importing it elsewhere keeps the
optimizer state. `--merged` merges every LoRA as the server applies it (checkpoints/merge.py), or
refuses the adapter by name.
"""

from __future__ import annotations

import json
import os
import shutil
import sqlite3
import tempfile
import time
from pathlib import Path
from typing import Callable

import httpx

from .format import (
    ADAPTER_CONFIG, ADAPTER_WEIGHTS, CHECKPOINT_FILES, MANIFEST, CheckpointError, read_checkpoint,
)
from .paths import InvalidPath, TinkerPath
from .transfer import extract_checkpoint_tar
from ..store.tables import db_path
from ..store.records import CheckpointRecord, from_row

TIMEOUT = httpx.Timeout(600.0, connect=10.0)
# progress(bytes done, bytes in all or None if unknown): how far a download, copy or upload is.
Progress = Callable[[int, int | None], None]
CHUNK = 1 << 20


class ExportError(RuntimeError):
    """A user-facing failure of export or import (printed without a traceback)."""


def _remote(base_url: str | None, api_key: str | None) -> tuple[str, dict]:
    base_url = base_url or os.environ.get("TINKER_BASE_URL")
    api_key = api_key or os.environ.get("TINKER_API_KEY")
    if not base_url:
        raise ExportError("no server given: pass --base-url (or set TINKER_BASE_URL), or --data-dir to read a "
                          "server's data directory directly")
    if not api_key:
        raise ExportError("no API key: pass --api-key or set TINKER_API_KEY")
    return base_url.rstrip("/"), {"X-API-Key": api_key}


def _detail(r: httpx.Response) -> str:
    try:
        return str(r.json().get("detail", r.text))
    except ValueError:
        return r.text or r.reason_phrase


def _fetch_remote(path: TinkerPath, dest: Path, base_url: str | None, api_key: str | None,
                  progress: Progress) -> None:
    url, headers = _remote(base_url, api_key)
    archive = dest / ".download.tar"
    with httpx.Client(timeout=TIMEOUT) as http:
        with http.stream("GET", f"{url}/api/v1/training_runs/{path.run}/checkpoints/{path.kind}/{path.name}/archive",
                         headers=headers) as r:
            if r.status_code != 200:
                r.read()
                raise ExportError(f"{path}: the server answered {r.status_code}: {_detail(r)}")
            total = int(r.headers["content-length"]) if "content-length" in r.headers else None
            with open(archive, "wb") as f:
                for block in r.iter_bytes(CHUNK):
                    f.write(block)
                    progress(f.tell(), total)
    try:
        extract_checkpoint_tar(archive, dest, max_bytes=None)  # a plain tar: as large as the checkpoint is
    except CheckpointError as e:
        raise ExportError(f"{path}: the server's archive cannot be read: {e}") from None
    finally:
        archive.unlink()


def _fetch_local(path: TinkerPath, dest: Path, data_dir: Path, progress: Progress) -> None:
    db = db_path(data_dir)
    if not db.is_file():
        raise ExportError(f"{data_dir} is not a hosted-tinker data directory (no {db.name})")
    with sqlite3.connect(f"file:{db}?mode=ro", uri=True) as conn:
        conn.row_factory = sqlite3.Row
        row = conn.execute("SELECT * FROM checkpoints WHERE model_id=? AND checkpoint_id=?",
                           (path.run, path.checkpoint_id)).fetchone()
    record = None if row is None else from_row(CheckpointRecord, row)
    if record is None or (record.expires_at is not None and record.expires_at <= time.time()):
        raise ExportError(f"checkpoint {path} not found in {data_dir}")
    src = data_dir / "checkpoints" / path.run / path.kind / path.name
    for attempt in range(3):  # a save may replace the directory while we copy: verify, retry
        for f in dest.iterdir():
            f.unlink()
        try:
            files = [src / name for name in CHECKPOINT_FILES if (src / name).is_file()]
            total, done = sum(f.stat().st_size for f in files), 0
            for f in files:
                shutil.copyfile(f, dest / f.name)
                done += f.stat().st_size
                progress(done, total)
            read_checkpoint(dest, with_optimizer=False, layers=None)  # verifies the manifest checksums
            return
        except (OSError, CheckpointError) as e:
            if attempt == 2:
                raise ExportError(f"cannot copy {path} out of {data_dir}: {e}") from None
            time.sleep(0.2)


def _prepare_out(out: Path, force: bool) -> None:
    if out.exists() and any(out.iterdir()):
        if not force:
            raise ExportError(f"{out} exists and is not empty (use --force to replace its contents)")
        shutil.rmtree(out)
    out.mkdir(parents=True, exist_ok=True)


def export_checkpoint(tinker_path: str, out: Path, *, data_dir: Path | None = None, base_url: str | None = None,
                      api_key: str | None = None, merged: bool = False, base_model: str | None = None,
                      dtype: str = "float32", force: bool = False, progress: Progress = lambda done, total: None
                      ) -> Path:
    """Write the checkpoint's adapter directory (or, `merged`, the full merged model) into `out`;
    `progress` is told how many bytes of the checkpoint have arrived."""
    try:
        path = TinkerPath.parse(tinker_path)
    except InvalidPath as e:
        raise ExportError(str(e)) from None
    out = Path(out)
    _prepare_out(out, force)
    target = Path(tempfile.mkdtemp(prefix="adapter-", dir=out.parent)) if merged else out
    try:
        if data_dir is not None:
            _fetch_local(path, target, Path(data_dir), progress)
        else:
            _fetch_remote(path, target, base_url, api_key, progress)
        if not (target / ADAPTER_CONFIG).is_file() or not (target / ADAPTER_WEIGHTS).is_file():
            raise ExportError(f"{path} holds no LoRA adapter")
        if merged:
            manifest = json.loads((target / MANIFEST).read_text()) if (target / MANIFEST).is_file() else {}
            name = base_model or manifest.get("base_model") or json.loads(
                (target / ADAPTER_CONFIG).read_text()).get("base_model_name_or_path")
            if not name:
                raise ExportError("the checkpoint does not name its base model; pass --base-model")
            merge_adapter(target, out, base_model=name, model_dir=Path(data_dir) if data_dir else None, dtype=dtype)
    except BaseException:
        shutil.rmtree(out, ignore_errors=True)  # it was empty before: leave no half export
        raise
    finally:
        if merged:
            shutil.rmtree(target, ignore_errors=True)
    return out


def merge_adapter(adapter_dir: Path, out: Path, *, base_model: str, model_dir: Path | None,
                  dtype: str = "float32") -> None:
    """Load the base model like the server does, merge every LoRA weight in as the server applies
    it (checkpoints/merge.py), save safetensors with the tokenizer (and a vision-language model's
    image processor, as the server reads it); a checkpoint that does not fit is refused."""
    import torch

    from .merge import merge_lora
    from ..models.loading import load_base_model, pick_dtype, resolve_model_source

    device = torch.device("cpu")
    with tempfile.TemporaryDirectory() as scratch:
        models = model_dir or Path(scratch)
        model, tokenizer = load_base_model(base_model, models, device, pick_dtype(dtype, device))
        try:
            merge_lora(model, adapter_dir)
        except CheckpointError as e:
            raise ExportError(f"cannot merge the adapter into {base_model}: {e}") from None
        model.save_pretrained(str(out))
        tokenizer.save_pretrained(str(out))
        if getattr(model.config, "vision_config", None) is not None:
            from transformers import AutoImageProcessor

            source = resolve_model_source(base_model, models)
            AutoImageProcessor.from_pretrained(source, backend="pil").save_pretrained(str(out))


def _tar_dir(src: Path, archive: Path) -> list[str]:
    import tarfile

    names = [n for n in CHECKPOINT_FILES if (src / n).is_file()]
    if ADAPTER_CONFIG not in names or ADAPTER_WEIGHTS not in names:
        if (src / "adapter_model.bin").is_file():
            raise ExportError(f"{src} holds adapter_model.bin (pickle); save the adapter with safetensors")
        raise ExportError(f"{src} is not an adapter directory: it needs {ADAPTER_CONFIG} and {ADAPTER_WEIGHTS}")
    with tarfile.open(archive, "w") as tar:
        for n in names:
            tar.add(src / n, arcname=n, recursive=False)
    return names


def import_adapter(src: Path, *, name: str, base_url: str | None = None, api_key: str | None = None,
                   training_run_id: str | None = None, overwrite: bool = False,
                   progress: Progress = lambda done, total: None) -> dict:
    """Upload an adapter directory to a running server; return its answer (with `tinker_path`).
    `progress` is told how many bytes have been sent."""
    url, headers = _remote(base_url, api_key)
    src = Path(src)
    if not src.is_dir():
        raise ExportError(f"{src} is not a directory")
    with tempfile.TemporaryDirectory() as tmp:
        archive = Path(tmp) / "adapter.tar"
        _tar_dir(src, archive)
        params: dict[str, str] = {"name": name}
        if training_run_id:
            params["training_run_id"] = training_run_id
        if overwrite:
            params["overwrite"] = "true"
        size = archive.stat().st_size

        def body():
            with open(archive, "rb") as f:
                while block := f.read(CHUNK):
                    yield block
                    progress(f.tell(), size)

        with httpx.Client(timeout=TIMEOUT) as http:
            r = http.post(f"{url}/api/v1/checkpoints/import", params=params, content=body(),
                          headers={**headers, "Content-Type": "application/x-tar", "Content-Length": str(size)})
    if r.status_code != 200:
        raise ExportError(f"the server refused the import ({r.status_code}): {_detail(r)}")
    return r.json()
