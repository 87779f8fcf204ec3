"""REST endpoints for runs and checkpoints: what `tinker.RestClient` and the `tinker` CLI call.

Every checkpoint has an owner (the API key's owner id). Another key gets 404 for it, as if it
did not exist, unless it is published: a published checkpoint can be read (listed, described,
downloaded, loaded) by anyone, and changed (TTL, publish, delete) by its owner only. An expired
checkpoint is gone for every purpose at once, before the sweeper removes its files.

Beyond the SDK, two endpoints move files in and out without it:

- `GET  .../checkpoints/{kind}/{name}/archive`: the checkpoint directory as a tar (authenticated);
- `POST /api/v1/checkpoints/import?name=...`: a tar of an adapter directory (a PEFT adapter made
  anywhere, or a checkpoint archived from a hosted-tinker server) becomes
  `tinker://<run>/weights/<name>`, loadable with `create_training_client_from_state`.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import tempfile
import time
import uuid
from datetime import datetime, timezone
from pathlib import Path

from fastapi import APIRouter, Depends, FastAPI, HTTPException, Query, Request
from fastapi.concurrency import run_in_threadpool
from fastapi.responses import StreamingResponse
from pydantic import BaseModel, ConfigDict

from ..access import Access
from ..checkpoint_admin import (
    CHECKPOINT_LOCK, KIND_TYPES, UrlSigner, checkpoint_files, delete_checkpoint, extract_checkpoint_tar,
    is_expired, open_checkpoint_files, prepare_import, recover, sweep_expired, tar_length, tar_stream, write_import,
)
from ..runtime.checkpoints import ADAPTER_CONFIG, MANIFEST, CheckpointError
from ..server import Server
from .deps import accessible_scope, get_access, get_server, require_owner
from .schemas import INT64_MAX, str_dict
from .training import check_name, parse_tinker_path

router = APIRouter()

SIGNED_URL_TTL_S = 3600          # download URLs from external_weights_urls live this long
EXPIRY_SWEEP_S = 2.0             # how often expired checkpoints are removed (files and records)
MAX_TTL_S = 10 * 365 * 24 * 3600
_RUN_RE = re.compile(r"[A-Za-z0-9][A-Za-z0-9._:@-]{0,199}")


# -- lifecycle (called from app.py) ----------------------------------------------------------------------

def on_startup(app: FastAPI, server: Server) -> None:
    """Repair checkpoint records and directories after an unclean stop; load the URL signing key."""
    recover(server.store, server.worker.checkpoint_root)
    shutil.rmtree(Path(server.config.data_dir) / "uploads", ignore_errors=True)  # imports cut short
    app.state.url_signer = UrlSigner(Path(server.config.data_dir) / "url_signing.key")


async def sweep_expired_forever(server: Server) -> None:
    import asyncio
    import logging

    while True:
        await asyncio.sleep(EXPIRY_SWEEP_S)
        try:
            await asyncio.to_thread(sweep_expired, server.store)
        except Exception:  # a disk error must not end the sweeping for good
            logging.getLogger(__name__).exception("expired checkpoint sweep failed")


# -- identifiers and access ------------------------------------------------------------------------------

def check_run_id(run_id: str) -> str:
    if not _RUN_RE.fullmatch(run_id) or ".." in run_id:
        raise HTTPException(400, f"invalid training run id {run_id!r}")
    return run_id


def checkpoint_ref(run_id: str, kind: str, name: str) -> str:
    """Validate the parts of a checkpoint address; return its checkpoint_id ('<kind>/<name>')."""
    check_run_id(run_id)
    if kind not in KIND_TYPES:
        raise HTTPException(400, f"invalid checkpoint kind {kind!r}: expected one of {sorted(KIND_TYPES)}")
    check_name(name)
    return f"{kind}/{name}"


# -- JSON shapes (tinker.types) --------------------------------------------------------------------------

def iso(ts: float | None) -> str | None:
    return None if ts is None else datetime.fromtimestamp(ts, tz=timezone.utc).isoformat()


def checkpoint_json(row) -> dict:
    path = f"tinker://{row['model_id']}/{row['checkpoint_id']}"
    return {
        "checkpoint_id": row["checkpoint_id"],
        "checkpoint_type": row["kind"],
        "time": iso(row["created_at"]),
        "tinker_path": path,
        "training_run_id": row["model_id"],
        "size_bytes": row["size_bytes"],
        "public": bool(row["public"]),
        "user_metadata": str_dict(row["user_metadata"]),
        "expires_at": iso(row["expires_at"]),
    }


def run_json(server: Server, row, is_owner: bool) -> dict:
    lora = json.loads(row["lora_config"])
    latest: dict[str, object] = {}
    for c in server.store.live_checkpoints(row["model_id"], public_only=not is_owner):  # oldest first
        latest[c["kind"]] = c
    return {
        "training_run_id": row["model_id"],
        "base_model": row["base_model"],
        "model_owner": row["owner"],
        "is_lora": True,
        "corrupted": False,
        "lora_rank": lora.get("rank"),
        "last_request_time": iso(row["last_request_at"]),
        "last_checkpoint": checkpoint_json(latest["training"]) if "training" in latest else None,
        "last_sampler_checkpoint": checkpoint_json(latest["sampler"]) if "sampler" in latest else None,
        "user_metadata": str_dict(row["user_metadata"]) if is_owner else None,
    }


# -- training runs ---------------------------------------------------------------------------------------

@router.get("/api/v1/training_runs")
def list_training_runs(limit: int = Query(20, ge=0, le=10000), offset: int = Query(0, ge=0, le=INT64_MAX),
                       accessible: bool = Depends(accessible_scope), project_id: str | None = None,
                       owner: str = Depends(require_owner), server: Server = Depends(get_server)):
    rows, total = server.store.list_runs(owner, accessible=accessible, project_id=project_id,
                                         limit=limit, offset=offset)
    return {"training_runs": [run_json(server, r, r["owner"] == owner) for r in rows],
            "cursor": {"offset": offset, "limit": limit, "total_count": total}}


@router.get("/api/v1/training_runs/{run_id}")
def get_training_run(run_id: str, accessible: bool = Depends(accessible_scope), owner: str = Depends(require_owner),
                     server: Server = Depends(get_server), access: Access = Depends(get_access)):
    row, is_owner = access.run(owner, check_run_id(run_id), accessible=accessible)
    return run_json(server, row, is_owner)


@router.get("/api/v1/training_runs/{run_id}/checkpoints")
def list_run_checkpoints(run_id: str, owner: str = Depends(require_owner), server: Server = Depends(get_server),
                         access: Access = Depends(get_access)):
    row, is_owner = access.run(owner, check_run_id(run_id), accessible=True)
    rows = server.store.live_checkpoints(run_id, public_only=not is_owner)
    return {"checkpoints": [checkpoint_json(r) for r in rows]}


@router.get("/api/v1/checkpoints")
def list_user_checkpoints(limit: int = Query(100, ge=0, le=10000), offset: int = Query(0, ge=0, le=INT64_MAX),
                          owner: str = Depends(require_owner), server: Server = Depends(get_server)):
    rows, total = server.store.owner_checkpoints(owner, limit, offset)
    return {"checkpoints": [checkpoint_json(r) for r in rows],
            "cursor": {"offset": offset, "limit": limit, "total_count": total}}


# -- one checkpoint --------------------------------------------------------------------------------------

_ONE = "/api/v1/training_runs/{run_id}/checkpoints/{kind}/{name}"


@router.delete(_ONE)
def delete_one(run_id: str, kind: str, name: str, owner: str = Depends(require_owner),
               server: Server = Depends(get_server), access: Access = Depends(get_access)):
    row = access.checkpoint(owner, run_id, checkpoint_ref(run_id, kind, name), write=True)
    delete_checkpoint(server.store, row)
    return {"deleted": f"tinker://{run_id}/{kind}/{name}"}


@router.post(_ONE + "/publish")
def publish(run_id: str, kind: str, name: str, owner: str = Depends(require_owner),
            server: Server = Depends(get_server), access: Access = Depends(get_access)):
    return _set_public(server, access, owner, run_id, kind, name, True)


@router.delete(_ONE + "/publish")
def unpublish(run_id: str, kind: str, name: str, owner: str = Depends(require_owner),
              server: Server = Depends(get_server), access: Access = Depends(get_access)):
    return _set_public(server, access, owner, run_id, kind, name, False)


def _set_public(server: Server, access: Access, owner: str, run_id: str, kind: str, name: str, public: bool) -> dict:
    row = access.checkpoint(owner, run_id, checkpoint_ref(run_id, kind, name), write=True)
    if bool(row["public"]) == public:
        # 400, not 409: the SDK retries a 409 for minutes.
        raise HTTPException(400, f"checkpoint tinker://{run_id}/{kind}/{name} is already "
                                 f"{'public' if public else 'private'}")
    server.store.set_checkpoint_public(run_id, row["checkpoint_id"], public)
    return {"tinker_path": f"tinker://{run_id}/{kind}/{name}", "public": public}


class TtlBody(BaseModel):
    model_config = ConfigDict(extra="ignore")
    ttl_seconds: int | None = None


@router.put(_ONE + "/ttl")
def set_ttl(run_id: str, kind: str, name: str, body: TtlBody, owner: str = Depends(require_owner),
            server: Server = Depends(get_server), access: Access = Depends(get_access)):
    """ttl_seconds from now (1 s to 10 years; the expiry sweep removes it then), or null for never."""
    row = access.checkpoint(owner, run_id, checkpoint_ref(run_id, kind, name), write=True)
    if body.ttl_seconds is not None and not 1 <= body.ttl_seconds <= MAX_TTL_S:
        raise HTTPException(400, f"ttl_seconds must be between 1 and {MAX_TTL_S} (10 years), or null to "
                                 f"never expire; got {body.ttl_seconds}")
    expires = None if body.ttl_seconds is None else time.time() + body.ttl_seconds
    server.store.set_checkpoint_expiry(run_id, row["checkpoint_id"], expires)
    return {"tinker_path": f"tinker://{run_id}/{kind}/{name}", "expires_at": iso(expires)}


@router.get(_ONE + "/external_weights_urls")
def external_weights_urls(run_id: str, kind: str, name: str, request: Request,
                          owner: str = Depends(require_owner), access: Access = Depends(get_access)):
    checkpoint_ref(run_id, kind, name)
    if kind != "external_weights":
        raise HTTPException(400, f"download URLs exist for external weights only (tinker://<run>/external_weights/"
                                 f"<name>, from save_weights_external); got tinker://{run_id}/{kind}/{name}")
    row = access.checkpoint(owner, run_id, checkpoint_ref(run_id, kind, name))
    expires = int(time.time()) + SIGNED_URL_TTL_S
    signer: UrlSigner = request.app.state.url_signer
    base = str(request.base_url).rstrip("/")
    urls = {}
    with CHECKPOINT_LOCK:  # not in the middle of an overwrite's two renames
        files = checkpoint_files(Path(row["dir"]))
    for f in files:
        target = f"{run_id}/{kind}/{name}/{f.name}"
        urls[f.name] = (f"{base}/api/v1/signed_files/{target}?expires={expires}"
                        f"&signature={signer.signature(target, expires)}")
    return {"urls": urls, "expires": iso(expires)}


@router.get("/api/v1/signed_files/{run_id}/{kind}/{name}/{filename}")
def signed_file(run_id: str, kind: str, name: str, filename: str, request: Request,
                server: Server = Depends(get_server)):
    """A file of a checkpoint through a signed URL: no API key; the signature is the permission."""
    checkpoint_id = checkpoint_ref(run_id, kind, name)
    try:
        expires = int(request.query_params.get("expires", ""))
    except ValueError:
        raise HTTPException(403, "invalid download URL: no valid expiry") from None
    signer: UrlSigner = request.app.state.url_signer
    if not signer.valid(f"{run_id}/{kind}/{name}/{filename}", expires, request.query_params.get("signature", "")):
        raise HTTPException(403, "invalid download URL: the signature does not match")
    if time.time() > expires:
        raise HTTPException(410, f"this download URL expired at {iso(expires)}; ask external_weights_urls for new ones")
    row = server.store.get_checkpoint(run_id, checkpoint_id)
    if row is None or is_expired(row):
        raise HTTPException(404, f"checkpoint tinker://{run_id}/{checkpoint_id} no longer exists")
    with CHECKPOINT_LOCK:  # open it while no overwrite is between its renames; then it reads to the end
        found = [f for f in checkpoint_files(Path(row["dir"])) if f.name == filename]
        if not found:
            raise HTTPException(404, f"checkpoint tinker://{run_id}/{checkpoint_id} has no file {filename!r}")
        handle = open(found[0], "rb")
    size = os.fstat(handle.fileno()).st_size

    def body():
        with handle:
            while block := handle.read(1 << 20):
                yield block

    return StreamingResponse(body(), media_type="application/octet-stream", headers={
        "Content-Length": str(size), "Content-Disposition": f'attachment; filename="{filename}"'})


@router.get(_ONE + "/archive")
def archive(run_id: str, kind: str, name: str, owner: str = Depends(require_owner),
            access: Access = Depends(get_access)):
    """The checkpoint directory as a flat tar: `curl -H "X-API-Key: $KEY" URL | tar -x -C DIR`."""
    row = access.checkpoint(owner, run_id, checkpoint_ref(run_id, kind, name))
    files = open_checkpoint_files(Path(row["dir"]))
    return StreamingResponse(tar_stream(files), media_type="application/x-tar", headers={
        "Content-Length": str(tar_length(files)),
        "Content-Disposition": f'attachment; filename="{run_id}_{kind}_{name}.tar"'.replace(":", "-")})


class WeightsInfoBody(BaseModel):
    model_config = ConfigDict(extra="ignore")
    tinker_path: str


@router.post("/api/v1/weights_info")
def weights_info(body: WeightsInfoBody, owner: str = Depends(require_owner), server: Server = Depends(get_server),
                 access: Access = Depends(get_access)):
    run_id, kind, name = parse_tinker_path(body.tinker_path)
    row = access.checkpoint(owner, run_id, checkpoint_ref(run_id, kind, name))
    with CHECKPOINT_LOCK:
        try:
            manifest = json.loads((Path(row["dir"]) / MANIFEST).read_text())
            lora, base_model = manifest["lora_config"], manifest["base_model"]
        except (OSError, ValueError, KeyError):  # a bare PEFT directory: its adapter_config says enough
            peft_cfg = json.loads((Path(row["dir"]) / ADAPTER_CONFIG).read_text())
            lora, base_model = {"rank": peft_cfg.get("r")}, server.config.base_model
    model = server.store.get_model(run_id)
    return {
        "base_model": base_model,
        "is_lora": True,
        "lora_rank": lora.get("rank"),
        "train_unembed": lora.get("train_unembed"),
        "train_mlp": lora.get("train_mlp"),
        "train_attn": lora.get("train_attn"),
        "optimizer_config": json.loads(model["optimizer_config"]) if model is not None else {"type": "adamw"},
    }


# -- import ----------------------------------------------------------------------------------------------

@router.post("/api/v1/checkpoints/import")
async def import_checkpoint(request: Request, name: str, training_run_id: str | None = None,
                            overwrite: bool = False, owner: str = Depends(require_owner),
                            server: Server = Depends(get_server)):
    """Body: a tar (or tar.gz) of an adapter directory. Answers with its new tinker:// path.

    The adapter must fit the served base model exactly (every targeted projection, every shape);
    it becomes a training checkpoint `tinker://<run>/weights/<name>` of a new imported run (or of
    `training_run_id`, an existing run of the caller's or a new id).
    """
    check_name(name)
    run_id = check_run_id(training_run_id) if training_run_id else f"import-{uuid.uuid4().hex[:12]}"
    existing_run = await run_in_threadpool(server.store.get_model, run_id)  # SQLite: off the event loop
    if existing_run is not None and existing_run["owner"] != owner:
        raise HTTPException(404, f"training run {run_id!r} not found")
    uploads = Path(server.config.data_dir) / "uploads"
    uploads.mkdir(parents=True, exist_ok=True)
    work = Path(tempfile.mkdtemp(prefix="import-", dir=uploads))
    try:
        archive_path = work / "upload.tar"
        received = 0
        with open(archive_path, "wb") as f:
            async for chunk in request.stream():  # bounded by max_request_bytes (api/limits.py)
                received += len(chunk)
                f.write(chunk)
        if received == 0:
            raise HTTPException(400, "empty upload: send the adapter directory as a tar archive in the body")
        return await run_in_threadpool(_import, server, owner, run_id, name, overwrite, archive_path, work / "files")
    finally:
        shutil.rmtree(work, ignore_errors=True)


def _import(server: Server, owner: str, run_id: str, name: str, overwrite: bool, archive_path: Path,
            src: Path) -> dict:
    src.mkdir()
    try:
        extract_checkpoint_tar(archive_path, src)
        ckpt, manifest = prepare_import(src, base_model=server.config.base_model, layers=server.runtime.layers)
    except CheckpointError as e:
        raise HTTPException(400, f"cannot import this adapter: {e}") from None
    checkpoint_id = f"weights/{name}"
    out = server.worker.checkpoint_dir(run_id, "weights", name)
    with CHECKPOINT_LOCK:
        existing = server.store.get_checkpoint(run_id, checkpoint_id)
        if existing is not None and not is_expired(existing) and not overwrite:
            raise HTTPException(400, f"checkpoint tinker://{run_id}/{checkpoint_id} already exists; "
                                     "import with overwrite=true to replace it")
        run = server.store.get_model(run_id)
        if run is None:
            server.store.create_model(run_id, "", owner, server.config.base_model, ckpt.config.to_dict(),
                                      {"type": "adamw"}, {"source": "import"})
            server.store.set_model_status(run_id, "imported")
        elif run["owner"] != owner:
            raise HTTPException(404, f"training run {run_id!r} not found")
        size = write_import(src, out, manifest)
        server.store.upsert_checkpoint(run_id, checkpoint_id, "training", owner, str(out), size, None, {})
    path = f"tinker://{run_id}/{checkpoint_id}"
    return {"tinker_path": path, "training_run_id": run_id, "checkpoint_id": checkpoint_id, "size_bytes": size,
            "lora_rank": ckpt.config.rank, "has_optimizer": bool(manifest.get("has_optimizer"))}
