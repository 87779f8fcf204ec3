"""REST endpoints for runs and checkpoints: what `tinker.RestClient` and the `tinker` CLI call.

Every checkpoint has an owner (the API key's owner id). Another key gets 404 for it, as if it
did not exist, unless it is published: a published checkpoint can be read (listed, described,
downloaded, loaded) by anyone, and changed (TTL, publish, delete) by its owner only. An expired
checkpoint is gone for every purpose at once, before the sweeper removes its files.

To another key, a run and its published checkpoints show only their public fields (`run_json`,
`checkpoint_json`): what a published checkpoint is (path, type, base model, LoRA rank, size, time,
expiry) and who published it. The owner's metadata, the run's other checkpoints and when its owner
last used it stay the owner's.

Beyond the SDK, two endpoints move files in and out without it:

- `GET  .../checkpoints/{kind}/{name}/archive`: the checkpoint directory as a tar (authenticated);
- `POST /api/v1/checkpoints/import?name=...`: a tar of an adapter directory (a PEFT adapter made
  anywhere, or a checkpoint archived from a hosted-tinker server) becomes
  `tinker://<run>/weights/<name>`, loadable with `create_training_client_from_state`.
"""

from __future__ import annotations

import json
import shutil
import tempfile
import time
import uuid
from datetime import datetime, timezone
from pathlib import Path

import anyio.to_thread
from anyio import CapacityLimiter
from fastapi import APIRouter, Depends, Header, HTTPException, Query, Request
from fastapi.concurrency import run_in_threadpool
from fastapi.responses import StreamingResponse
from pydantic import BaseModel, ConfigDict, Field

from ..accounts.access import Access
from ..checkpoints.catalog import CheckpointExists, version_of
from ..checkpoints.format import ADAPTER_CONFIG, MANIFEST, CheckpointError, read_json_object, read_manifest
from ..checkpoints.paths import TinkerPath, check_run_id
from ..checkpoints.transfer import (
    SIGNED_URL_TTL_S, ArchiveTooLarge, DownloadGrant, extract_checkpoint_tar, prepare_import, tar_length, tar_stream,
    write_import,
)
from ..requests.kinds import MAX_TTL_S
from ..server.core import Server
from ..server.served_models import ServedModel
from ..services import copies
from ..services.copies import check_copy_request
from .deps import accessible_scope, get_access, get_server, require_owner
from .schemas import INT64_MAX, PAGE_MAX_ROWS, ShortText, str_dict

router = APIRouter()

# Imports run (extract, verify, copy) at most this many at a time; the others wait without
# holding a worker thread, so a burst of large imports cannot starve the other routes.
MAX_CONCURRENT_IMPORTS = 2
_import_slots = CapacityLimiter(MAX_CONCURRENT_IMPORTS)


def _checkpoint(access: Access, owner: str, path: TinkerPath, *, write: bool = False):
    """The live record of `path`, if this key may read it (or, with `write`, change it)."""
    return access.checkpoint(owner, path.run, path.checkpoint_id, write=write)


# -- JSON shapes (tinker.types) --------------------------------------------------------------------------

def iso(ts: float | None) -> str | None:
    return None if ts is None else datetime.fromtimestamp(ts, tz=timezone.utc).isoformat()


def checkpoint_json(row, is_owner: bool) -> dict:
    return {
        "checkpoint_id": row.checkpoint_id,
        "checkpoint_type": row.kind,
        "time": iso(row.created_at),
        "tinker_path": str(TinkerPath.of_record(row.model_id, row.checkpoint_id)),
        "training_run_id": row.model_id,
        "size_bytes": row.size_bytes,
        "public": row.public,
        "user_metadata": str_dict(row.user_metadata) if is_owner else None,
        "expires_at": iso(row.expires_at),
    }


def run_json(server: Server, row, is_owner: bool) -> dict:
    lora = json.loads(row.lora_config)
    shown = server.store.checkpoints.live(row.model_id, public_only=not is_owner)  # oldest first
    latest = {c.kind: c for c in shown}
    # To another key, the run was last active when its newest published checkpoint was made.
    last_active = row.last_request_at if is_owner or not shown else shown[-1].created_at
    return {
        "training_run_id": row.model_id,
        "base_model": row.base_model,
        "model_owner": row.owner,
        "is_lora": True,
        "corrupted": False,
        "lora_rank": lora.get("rank"),
        "last_request_time": iso(last_active),
        "last_checkpoint": checkpoint_json(latest["training"], is_owner) if "training" in latest else None,
        "last_sampler_checkpoint": checkpoint_json(latest["sampler"], is_owner) if "sampler" in latest else None,
        "user_metadata": str_dict(row.user_metadata) if is_owner else None,
    }


# -- training runs ---------------------------------------------------------------------------------------

@router.get("/api/v1/training_runs")
def list_training_runs(limit: int = Query(20, ge=0, le=PAGE_MAX_ROWS), offset: int = Query(0, ge=0, le=INT64_MAX),
                       accessible: bool = Depends(accessible_scope), project_id: str | None = None,
                       owner: str = Depends(require_owner), server: Server = Depends(get_server)):
    rows, total = server.store.runs.page(owner, accessible=accessible, project_id=project_id,
                                         limit=limit, offset=offset)
    return {"training_runs": [run_json(server, r, r.owner == owner) for r in rows],
            "cursor": {"offset": offset, "limit": limit, "total_count": total}}


@router.get("/api/v1/training_runs/{run_id}")
def get_training_run(run_id: str, accessible: bool = Depends(accessible_scope), owner: str = Depends(require_owner),
                     server: Server = Depends(get_server), access: Access = Depends(get_access)):
    """A run named by its id, whatever `access_scope` (it chooses what a listing holds): another key's run
    while it holds a published checkpoint, with its public fields (the CLI's `checkpoint info` asks so)."""
    row, is_owner = access.run(owner, check_run_id(run_id))
    return run_json(server, row, is_owner)


@router.get("/api/v1/training_runs/{run_id}/checkpoints")
def list_run_checkpoints(run_id: str, owner: str = Depends(require_owner), server: Server = Depends(get_server),
                         access: Access = Depends(get_access)):
    row, is_owner = access.run(owner, check_run_id(run_id))
    rows = server.store.checkpoints.live(run_id, public_only=not is_owner)
    return {"checkpoints": [checkpoint_json(r, is_owner) for r in rows]}


@router.get("/api/v1/checkpoints")
def list_user_checkpoints(limit: int = Query(100, ge=0, le=PAGE_MAX_ROWS), offset: int = Query(0, ge=0, le=INT64_MAX),
                          owner: str = Depends(require_owner), server: Server = Depends(get_server)):
    rows, total = server.store.checkpoints.live_page(owner, limit, offset)
    return {"checkpoints": [checkpoint_json(r, True) for r in rows],
            "cursor": {"offset": offset, "limit": limit, "total_count": total}}


# -- one checkpoint --------------------------------------------------------------------------------------

_ONE = "/api/v1/training_runs/{run_id}/checkpoints/{kind}/{name}"


@router.delete(_ONE)
def delete_one(run_id: str, kind: str, name: str, owner: str = Depends(require_owner),
               server: Server = Depends(get_server), access: Access = Depends(get_access)):
    path = TinkerPath(run_id, kind, name)
    row = _checkpoint(access, owner, path, write=True)
    if server.checkpoints.delete(row):
        server.audit_checkpoint("checkpoint_delete", owner, row, reason="deleted by its owner")
    return {"deleted": str(path)}


@router.post(_ONE + "/publish")
def publish(run_id: str, kind: str, name: str, owner: str = Depends(require_owner),
            server: Server = Depends(get_server), access: Access = Depends(get_access)):
    return _set_public(server, access, owner, TinkerPath(run_id, kind, name), True)


@router.delete(_ONE + "/publish")
def unpublish(run_id: str, kind: str, name: str, owner: str = Depends(require_owner),
              server: Server = Depends(get_server), access: Access = Depends(get_access)):
    return _set_public(server, access, owner, TinkerPath(run_id, kind, name), False)


def _set_public(server: Server, access: Access, owner: str, path: TinkerPath, public: bool) -> dict:
    row = _checkpoint(access, owner, path, write=True)
    if row.public == public:
        # 400, not 409: the SDK retries a 409 for minutes.
        raise HTTPException(400, f"checkpoint {path} is already {'public' if public else 'private'}")
    server.store.checkpoints.set_public(path.run, path.checkpoint_id, public)
    server.audit_checkpoint("checkpoint_publish" if public else "checkpoint_unpublish", owner, row)
    return {"tinker_path": str(path), "public": public}


class TtlBody(BaseModel):
    model_config = ConfigDict(extra="ignore")
    ttl_seconds: int | None = None


@router.put(_ONE + "/ttl")
def set_ttl(run_id: str, kind: str, name: str, body: TtlBody, owner: str = Depends(require_owner),
            server: Server = Depends(get_server), access: Access = Depends(get_access)):
    """ttl_seconds from now (1 s to 10 years; the expiry sweep removes it then), or null for never."""
    path = TinkerPath(run_id, kind, name)
    row = _checkpoint(access, owner, path, write=True)
    if body.ttl_seconds is not None and not 1 <= body.ttl_seconds <= MAX_TTL_S:
        raise HTTPException(400, f"ttl_seconds must be between 1 and {MAX_TTL_S} (10 years), or null to "
                                 f"never expire; got {body.ttl_seconds}")
    expires = None if body.ttl_seconds is None else time.time() + body.ttl_seconds
    server.store.checkpoints.set_expiry(path.run, path.checkpoint_id, expires)
    server.audit_checkpoint("checkpoint_ttl_set", owner, row, ttl_seconds=body.ttl_seconds, expires_at=iso(expires))
    return {"tinker_path": str(path), "expires_at": iso(expires)}


# -- downloads -------------------------------------------------------------------------------------------

@router.get(_ONE + "/external_weights_urls")
def external_weights_urls(run_id: str, kind: str, name: str, request: Request, owner: str = Depends(require_owner),
                          server: Server = Depends(get_server), access: Access = Depends(get_access)):
    """One signed URL per file, for this version of the checkpoint and the access the caller has
    now (its owner's, or anyone's while it is published); both are checked again on each use."""
    path = TinkerPath(run_id, kind, name)
    if kind != "external_weights":
        raise HTTPException(400, f"download URLs exist for external weights only (tinker://<run>/external_weights/"
                                 f"<name>, from save_weights_external); got {path}")
    row = access.read(owner, path.run, path.checkpoint_id, "download")
    expires = int(time.time()) + SIGNED_URL_TTL_S
    scope = "owner" if row.owner == owner else "public"
    base = str(request.base_url).rstrip("/")
    urls = {}
    for f in server.checkpoints.files(path):
        grant = DownloadGrant(path, f.name, expires, version_of(row), scope)
        urls[f.name] = (f"{base}/api/v1/signed_files/{run_id}/{kind}/{name}/{f.name}?expires={expires}"
                        f"&version={grant.version}&scope={scope}&signature={server.url_signer.signature(grant)}")
    return {"urls": urls, "expires": iso(expires)}


@router.get("/api/v1/signed_files/{run_id}/{kind}/{name}/{filename}")
def signed_file(run_id: str, kind: str, name: str, filename: str, request: Request,
                server: Server = Depends(get_server)):
    """A file of a checkpoint through a signed URL: no API key; the signature is the permission,
    for as long as the version it was signed for exists and (for a published one) is public."""
    path = TinkerPath(run_id, kind, name)
    query = request.query_params
    try:
        expires = int(query.get("expires", ""))
    except ValueError:
        raise HTTPException(403, "invalid download URL: no valid expiry") from None
    scope = query.get("scope", "")
    if scope not in ("owner", "public"):
        raise HTTPException(403, "invalid download URL: no valid scope")
    grant = DownloadGrant(path, filename, expires, query.get("version", ""), scope)
    if not server.url_signer.valid(grant, query.get("signature", "")):
        raise HTTPException(403, "invalid download URL: the signature does not match")
    if time.time() > expires:
        raise HTTPException(410, f"this download URL expired at {iso(expires)}; ask external_weights_urls for new ones")
    row = server.checkpoints.record(path)
    if row is None or grant.version != version_of(row) or (scope == "public" and not row.public):
        raise HTTPException(404, f"checkpoint {path} no longer exists as it was when this URL was made "
                                 "(deleted, saved again, or no longer published)")
    files = server.checkpoints.open_files(path, {filename})
    if not files or files[0].name != filename:
        raise HTTPException(404, f"checkpoint {path} has no file {filename!r}")
    (f,) = files

    def body():
        with f.handle:
            while block := f.handle.read(1 << 20):
                yield block

    return StreamingResponse(body(), media_type="application/octet-stream", headers={
        "Content-Length": str(f.size), "Content-Disposition": f'attachment; filename="{filename}"'})


@router.get(_ONE + "/archive")
def archive(run_id: str, kind: str, name: str, owner: str = Depends(require_owner),
            server: Server = Depends(get_server), access: Access = Depends(get_access)):
    """The checkpoint directory as a flat tar: `curl -H "X-API-Key: $KEY" URL | tar -x -C DIR`."""
    path = TinkerPath(run_id, kind, name)
    access.read(owner, path.run, path.checkpoint_id, "download")
    files = server.checkpoints.open_files(path)
    return StreamingResponse(tar_stream(files), media_type="application/x-tar", headers={
        "Content-Length": str(tar_length(files)),
        "Content-Disposition": f'attachment; filename="{run_id}_{kind}_{name}.tar"'.replace(":", "-")})


class WeightsInfoBody(BaseModel):
    model_config = ConfigDict(extra="ignore")
    tinker_path: str


@router.post("/api/v1/weights_info")
def weights_info(body: WeightsInfoBody, owner: str = Depends(require_owner), server: Server = Depends(get_server),
                 access: Access = Depends(get_access)):
    path = TinkerPath.parse(body.tinker_path)
    row = _checkpoint(access, owner, path)
    with server.checkpoints.lock:  # not in the middle of an overwrite's two renames
        try:
            manifest = read_manifest(server.checkpoints.folder(path))
        except CheckpointError as e:
            raise HTTPException(400, f"checkpoint {path} cannot be read: {e}") from None
    lora = manifest.lora_config
    model = server.store.runs.get(path.run)
    optimizer = json.loads(model.optimizer_config) if model is not None else {"type": "adamw"}
    return {
        "base_model": manifest.base_model,
        "is_lora": True,
        "lora_rank": lora.rank,
        "train_unembed": lora.train_unembed,
        "train_mlp": lora.train_mlp,
        "train_attn": lora.train_attn,
        # Its family is what loading the optimizer state needs; whatever else its owner wrote there stays theirs.
        "optimizer_config": optimizer if row.owner == owner else {"type": optimizer.get("type", "adamw")},
    }


# -- copies ---------------------------------------------------------------------------------------------

class CopyWeightsBody(BaseModel):
    model_config = ConfigDict(extra="ignore")
    source_path: str
    destination_project_id: ShortText | None = None
    session_id: ShortText | None = None
    model_seq_id: int | None = Field(None, ge=0, le=INT64_MAX)
    ttl_seconds: int | None = None
    weights_access_token: str | None = None


@router.post("/api/v1/copy_weights")
def copy_weights(body: CopyWeightsBody, owner: str = Depends(require_owner), server: Server = Depends(get_server),
                 access: Access = Depends(get_access), x_idempotency_key: str | None = Header(default=None),
                 x_tinker_weights_access_token: str | None = Header(default=None)):
    """`RestClient.copy_weights` / `ServiceClient.copy_weights`: a copy sharing the source's storage
    (services/copies.py)."""
    check_copy_request(body.ttl_seconds, body.weights_access_token or x_tinker_weights_access_token)
    return {"tinker_path": copies.copy_weights(
        server, access, owner, body.source_path, project_id=body.destination_project_id, session_id=body.session_id,
        model_seq_id=body.model_seq_id, ttl_seconds=body.ttl_seconds, idempotency_key=x_idempotency_key or None)}


# -- import ----------------------------------------------------------------------------------------------

@router.post("/api/v1/checkpoints/import")
async def import_checkpoint(request: Request, name: str, training_run_id: str | None = None,
                            overwrite: bool = False, owner: str = Depends(require_owner),
                            server: Server = Depends(get_server)):
    """Body: a tar (or tar.gz) of an adapter directory. Answers with its new tinker:// path.

    The adapter must fit the served base model exactly (every targeted projection, every shape)
    and its rank limit; it becomes a training checkpoint `tinker://<run>/weights/<name>` of a new
    imported run with a fresh id, or of `training_run_id`, an existing run of the caller's. A new run
    never takes an id the caller names: run ids live in their sessions' namespaces (`<session>:train:<n>`),
    so a chosen id could take another tenant's next model id, and "not yours" vs "absent" would tell
    which ids exist. Both are the same 404.
    """
    path = TinkerPath(training_run_id or f"import-{uuid.uuid4().hex[:12]}", "weights", name)
    if training_run_id is not None:
        existing_run = await run_in_threadpool(server.store.runs.get, path.run)  # SQLite: off the event loop
        if existing_run is None or existing_run.owner != owner:
            raise _no_such_run(path.run)
    server.uploads.mkdir(parents=True, exist_ok=True)
    work = Path(tempfile.mkdtemp(prefix="import-", dir=server.uploads))
    try:
        archive_path = work / "upload.tar"
        received = 0
        with open(archive_path, "wb") as f:
            async for chunk in request.stream():  # bounded by max_request_bytes as sent (api/limits.py)
                received += len(chunk)
                f.write(chunk)
        if received == 0:
            raise HTTPException(400, "empty upload: send the adapter directory as a tar archive in the body")
        return await anyio.to_thread.run_sync(_import, server, owner, path, overwrite, archive_path,
                                              work / "files", training_run_id is None, limiter=_import_slots)
    finally:
        shutil.rmtree(work, ignore_errors=True)


def _no_such_run(run_id: str) -> HTTPException:
    return HTTPException(404, f"training run {run_id!r} not found: import into a run of yours, or leave "
                              "training_run_id out for a new run")


def _import_target(server: Server, src: Path) -> ServedModel:
    """The served model an uploaded adapter is for: when one model is served, that one (an adapter made
    elsewhere names a path or hub id of its own: `prepare_import` checks its shapes instead); else the
    base model it names (its manifest, or a PEFT adapter_config's base_model_name_or_path)."""
    if len(server.models) == 1:
        return next(iter(server.models))
    ours = (src / MANIFEST).is_file()  # a hosted-tinker checkpoint: its manifest says
    named = read_manifest(src).base_model if ours else read_json_object(src, ADAPTER_CONFIG).get(
        "base_model_name_or_path")
    if named in server.models.names:
        return server.models.get(named)
    served = ", ".join(repr(n) for n in server.models.names)
    fix = "" if ours else f"; set base_model_name_or_path in its {ADAPTER_CONFIG} to the served model it fits"
    raise CheckpointError(f"it is for base model {str(named)[:200]!r}, which this server does not serve "
                          f"(it serves {served}){fix}")


def _import(server: Server, owner: str, path: TinkerPath, overwrite: bool, archive_path: Path, src: Path,
            new_run: bool) -> dict:
    src.mkdir()
    limit = server.config.max_request_bytes
    try:
        extract_checkpoint_tar(archive_path, src, max_bytes=limit)
        served = _import_target(server, src)
        prepared = prepare_import(src, base_model=served.name, layers=served.runtime.layers,
                                  max_rank=server.config.max_lora_rank)
    except ArchiveTooLarge as e:
        raise HTTPException(413, f"cannot import this adapter: {e} (the limit is --max-request-bytes)") from None
    except CheckpointError as e:
        raise HTTPException(400, f"cannot import this adapter: {e}") from None
    config = prepared.checkpoint.config
    with server.checkpoints.lock:  # the run and the checkpoint appear together
        run = server.store.runs.get(path.run)
        if run is None and new_run:
            server.store.runs.create(path.run, "", owner, served.name, config.to_dict(),
                                     {"type": "adamw"}, {"source": "import"})
            server.store.runs.set_status(path.run, "imported")
        elif run is None or run.owner != owner:  # deleted meanwhile, or never the caller's
            raise _no_such_run(path.run)
        elif run.base_model != served.name:
            raise HTTPException(400, f"training run {path.run!r} is of base model {run.base_model!r}; this "
                                     f"adapter is for {served.name!r}: import it into a run of its own base model")
        try:
            size = server.checkpoints.save(path, owner, write_import(src, prepared), overwrite=overwrite)
        except CheckpointExists as e:
            raise HTTPException(400, f"{e}; import with overwrite=true to replace it") from None
        server.audit_checkpoint("checkpoint_create", owner, server.checkpoints.record(path), how="import")
    return {"tinker_path": str(path), "training_run_id": path.run, "checkpoint_id": path.checkpoint_id,
            "size_bytes": size, "lora_rank": config.rank, "has_optimizer": prepared.checkpoint.optimizer is not None}
