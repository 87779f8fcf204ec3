"""Training endpoints and `retrieve_future`.

Every work endpoint validates what it can up front (a user's mistake is a 4xx here and never
reaches the model), records a future, hands the request to the `ClockCycleScheduler`, and
answers at once with the request id. A `(model_id, seq_id)` seen before answers with the first
request id, so the SDK's retries are applied once.
"""

from __future__ import annotations

import json
from typing import Callable

from fastapi import APIRouter, Depends, Header, HTTPException, Request
from fastapi.concurrency import run_in_threadpool
from fastapi.responses import Response
from pydantic import Field

from ..checkpoints.format import CheckpointError, read_manifest
from ..checkpoints.paths import TinkerPath, check_name
from ..runtime.adapters import AdamParams, LoRAConfig
from ..runtime.losses import LossInputError, resolve_loss_config, validate_datum
from ..runtime.trainer import DatumWork, FBWork
from ..scheduler import Request as WorkRequest
from ..server import Server
from ..wire.codec import WireError, decode_forward_backward_request
from ..worker import LoadSpec, SaveSpec
from .deps import get_server, require_owner
from .schemas import (
    Body, CreateModelRequest, LoadWeightsRequest, LoraConfigIn, ModelRef, OptimStepRequest,
    RetrieveFutureRequest, SaveWeightsForSamplerRequest, SaveWeightsRequest,
)
from .service import _owned_session

router = APIRouter()

def _active_model(server: Server, model_id: str, owner: str):
    row = server.store.get_model(model_id)
    if row is None or row["owner"] != owner:
        raise HTTPException(404, f"model {model_id!r} not found")
    if row["status"] != "active" or not server.scheduler.has_model(model_id):
        raise HTTPException(404, f"model {model_id!r} is not loaded on this server (was it unloaded, or created "
                                 "before a restart?); create a training client from its last checkpoint")
    return row


def _future(request_id: str, model_id: str | None = None) -> dict:
    out = {"request_id": request_id}
    if model_id is not None:
        out["model_id"] = model_id
    return out


def _submit(server: Server, owner: str, model_id: str, seq_id: int, kind: str,
            make_payload: Callable[[], object]) -> dict:
    """Idempotent, validated submission of one training request of an existing model."""
    existing = server.store.get_future_id(model_id, seq_id)
    if existing is not None:
        return _future(existing, model_id)
    try:
        payload = make_payload()
    except HTTPException:
        server.scheduler.skip(model_id, seq_id)
        raise
    except (LossInputError, WireError, ValueError) as e:
        server.scheduler.skip(model_id, seq_id)
        raise HTTPException(400, str(e)) from None
    if server.futures.pending(owner) >= server.config.max_pending_per_key:
        server.scheduler.skip(model_id, seq_id)
        raise HTTPException(429, f"this API key has {server.config.max_pending_per_key} unfinished requests; "
                                 "wait for some to finish", headers={"Retry-After": "1"})
    expected = server.scheduler.expected_seq(model_id)
    if expected is not None and seq_id < expected:
        raise HTTPException(400, f"seq_id {seq_id} of model {model_id!r} is below the next expected seq_id "
                                 f"{expected}; each request needs a new seq_id")
    request_id, is_new = server.futures.create(owner, kind, model_id, seq_id)
    if is_new:  # else a concurrent retry of the same seq_id got there first
        tokens = sum(len(d.tokens) for d in payload.data) if isinstance(payload, FBWork) else 0
        server.scheduler.submit(WorkRequest(request_id, kind, model_id, seq_id, payload, tokens=tokens))
        server.store.touch_model(model_id)
    return _future(request_id, model_id)


# -- models -----------------------------------------------------------------------------------------

@router.post("/api/v1/create_model")
def create_model(body: CreateModelRequest, owner: str = Depends(require_owner), server: Server = Depends(get_server)):
    _owned_session(server, body.session_id, owner)
    if body.base_model != server.config.base_model:
        raise HTTPException(400, f"base model {body.base_model!r} is not served here; this server serves "
                                 f"{server.config.base_model!r}")
    lora = body.lora_config or LoraConfigIn()
    if lora.rank > server.config.max_lora_rank:
        raise HTTPException(400, f"LoRA rank {lora.rank} is above this server's limit of {server.config.max_lora_rank}")
    if not (lora.train_mlp or lora.train_attn or lora.train_unembed):
        raise HTTPException(400, "at least one of train_mlp, train_attn, train_unembed must be true")
    opt = body.optimizer_config or {"type": "adamw"}
    if opt.get("type", "adamw") != "adamw":
        raise HTTPException(400, f"optimizer {opt.get('type')!r} is not supported; this server trains with adamw")
    config = LoRAConfig(rank=lora.rank, seed=lora.seed or 0, train_mlp=lora.train_mlp, train_attn=lora.train_attn,
                        train_unembed=lora.train_unembed)
    model_id = f"{body.session_id}:train:{body.model_seq_id}"
    return _create(server, owner, model_id, body.session_id, "create_model", config.to_dict(), opt,
                   body.user_metadata or {}, config)


def _create(server: Server, owner: str, model_id: str, session_id: str, kind: str, lora: dict, opt: dict,
            user_metadata: dict, payload) -> dict:
    row = server.store.get_model(model_id)
    if row is not None:
        if row["owner"] != owner:
            raise HTTPException(404, f"session {session_id!r} not found")
        existing = server.store.get_future_id(model_id, 0)  # a retried create: same future
        if existing is not None:
            return _future(existing, model_id)
    live = server.store.count_active_models(owner)
    if live >= server.config.max_models_per_key:
        raise HTTPException(400, f"this API key already has {live} live models (limit "
                                 f"{server.config.max_models_per_key}); unload one before creating another")
    server.store.create_model(model_id, session_id, owner, server.config.base_model, lora, opt, user_metadata)
    server.scheduler.open_model(model_id, 0)
    request_id, is_new = server.futures.create(owner, kind, model_id, 0)
    if is_new:
        server.scheduler.submit(WorkRequest(request_id, kind, model_id, 0, payload))
    return _future(request_id, model_id)


@router.post("/api/v1/get_info")
def get_info(body: ModelRef, owner: str = Depends(require_owner), server: Server = Depends(get_server)):
    row = server.store.get_model(body.model_id)
    if row is None or row["owner"] != owner:
        raise HTTPException(404, f"model {body.model_id!r} not found")
    lora = json.loads(row["lora_config"])
    archs = getattr(server.runtime.model.config, "architectures", None) or [type(server.runtime.model).__name__]
    return {
        "type": "get_info",
        "model_id": row["model_id"],
        "model_data": {"arch": archs[0], "model_name": row["base_model"], "tokenizer_id": row["base_model"]},
        "model_name": row["base_model"],
        "is_lora": True,
        "lora_rank": lora.get("rank"),
        "optimizer_config": json.loads(row["optimizer_config"]),
    }


@router.post("/api/v1/unload_model")
def unload_model(body: ModelRef, owner: str = Depends(require_owner), server: Server = Depends(get_server)):
    _active_model(server, body.model_id, owner)
    request_id, _ = server.futures.create(owner, "unload_model", body.model_id, None)
    server.scheduler.submit_after_queue(WorkRequest(request_id, "unload_model", body.model_id, -1, None))
    return _future(request_id, body.model_id)


# -- compute ----------------------------------------------------------------------------------------

@router.post("/api/v1/forward_backward")
async def forward_backward(request: Request, owner: str = Depends(require_owner),
                           content_encoding: str | None = Header(default=None),
                           server: Server = Depends(get_server)):
    ctype = request.headers.get("content-type", "")
    if "protobuf" not in ctype:
        raise HTTPException(415, "forward_backward takes a protobuf ForwardBackwardRequest "
                                 "(Content-Type: application/x-protobuf), as sent by tinker>=0.25")
    body = await request.body()
    if len(body) > server.config.max_request_bytes:
        raise HTTPException(413, f"request body of {len(body)} bytes is above the limit of {server.config.max_request_bytes}")
    try:
        call = await run_in_threadpool(decode_forward_backward_request, body, content_encoding,
                                       max_decompressed_bytes=server.config.max_request_bytes)
    except WireError as e:
        raise HTTPException(400, f"malformed forward_backward body: {e}") from None
    _active_model(server, call.model_id, owner)
    if call.seq_id < 1:
        raise HTTPException(400, f"seq_id must be >= 1, got {call.seq_id}")
    runtime = server.runtime

    def validate() -> FBWork:
        if not call.data:
            raise LossInputError("forward_backward needs at least one datum")
        if len(call.data) > server.config.max_datums_per_request:
            raise LossInputError(f"{len(call.data)} datums in one request; this server takes at most "
                                 f"{server.config.max_datums_per_request} (the SDK splits larger batches itself)")
        config = resolve_loss_config(call.loss_fn, call.loss_fn_config)
        for i, d in enumerate(call.data):
            validate_datum(i, d.tokens, d.loss_fn_inputs, call.loss_fn, runtime.vocab_size, runtime.max_context)
        return FBWork(model_id=call.model_id, data=[DatumWork(d.tokens, d.loss_fn_inputs) for d in call.data],
                      loss_fn=call.loss_fn, loss_config=config, forward_only=call.forward_only)

    kind = "forward" if call.forward_only else "forward_backward"
    return await run_in_threadpool(_submit, server, owner, call.model_id, call.seq_id, kind, validate)


@router.post("/api/v1/optim_step")
def optim_step(body: OptimStepRequest, owner: str = Depends(require_owner), server: Server = Depends(get_server)):
    _active_model(server, body.model_id, owner)

    def params() -> AdamParams:
        if body.adam_params is None:
            kind = (body.optimizer_params or {}).get("type", "unknown")
            raise HTTPException(400, f"optimizer params of type {kind!r} are not supported; send adam_params")
        return AdamParams(**body.adam_params.model_dump())

    return _submit(server, owner, body.model_id, body.seq_id, "optim_step", params)


# -- checkpoints ------------------------------------------------------------------------------------

@router.post("/api/v1/save_weights")
def save_weights(body: SaveWeightsRequest, owner: str = Depends(require_owner), server: Server = Depends(get_server)):
    _active_model(server, body.model_id, owner)
    return _submit(server, owner, body.model_id, body.seq_id, "save_weights", lambda: SaveSpec(
        kind="weights", name=check_name(body.path), owner=owner, overwrite=body.overwrite,
        ttl_seconds=body.ttl_seconds, user_metadata=body.user_metadata))


@router.post("/api/v1/save_weights_for_sampler")
def save_weights_for_sampler(body: SaveWeightsForSamplerRequest, owner: str = Depends(require_owner),
                             server: Server = Depends(get_server)):
    _active_model(server, body.model_id, owner)

    def spec() -> SaveSpec:
        if body.path is not None:
            return SaveSpec(kind="sampler_weights", name=check_name(body.path), owner=owner, overwrite=True,
                            ttl_seconds=body.ttl_seconds, user_metadata=body.user_metadata)
        if body.sampling_session_seq_id is None:
            raise HTTPException(400, "save_weights_for_sampler needs a name (path) or a sampling_session_seq_id")
        # save_weights_and_get_sampling_client: a snapshot of the weights as of this seq_id,
        # served by a new sampling session. ("inflight" is served as a snapshot too.)
        session_id = server.store.get_model(body.model_id)["session_id"]
        return SaveSpec(kind="sampler_weights", name=f"ephemeral-{body.seq_id}", owner=owner, overwrite=True,
                        ttl_seconds=body.ttl_seconds or server.config.ephemeral_sampler_ttl_s,
                        sampling_session_id=f"{session_id}:sample:{body.sampling_session_seq_id}")

    return _submit(server, owner, body.model_id, body.seq_id, "save_weights_for_sampler", spec)


class SaveWeightsExternalRequest(Body):
    model_id: str
    seq_id: int = Field(ge=1)
    path: str
    ttl_seconds: int | None = Field(None, ge=1)
    age_encryption_recipients: list[str] | None = None


@router.post("/api/v1/save_weights_external")
def save_weights_external(body: SaveWeightsExternalRequest, owner: str = Depends(require_owner),
                          server: Server = Depends(get_server)):
    """The adapter as a standard PEFT directory, downloadable through signed URLs
    (`GET .../external_weights_urls`). Saving again under the same name replaces it."""
    _active_model(server, body.model_id, owner)

    def spec() -> SaveSpec:
        if body.age_encryption_recipients:
            raise HTTPException(400, "age encryption of exported weights is not supported by this server; "
                                     "save without age_encryption_recipients")
        return SaveSpec(kind="external_weights", name=check_name(body.path), owner=owner, overwrite=True,
                        ttl_seconds=body.ttl_seconds)

    return _submit(server, owner, body.model_id, body.seq_id, "save_weights_external", spec)


def _checkpoint_for_load(server: Server, owner: str, path: str, with_optimizer: bool) -> LoadSpec:
    """The checkpoint at `path`, if this key may load it and this server can: its kind, its
    owner or publication, and its manifest's rank against --max-lora-rank (the worker checks the
    files themselves again when it loads them)."""
    where = TinkerPath.parse(path)
    if where.kind == "external_weights" or (with_optimizer and where.kind != "weights"):
        need = "a training state saved with save_state (tinker://.../weights/...)"
        raise HTTPException(400, f"cannot load {path!r} {'with optimizer' if with_optimizer else ''}: needs {need}")
    row = server.checkpoints.record(where)
    if row is None or (row["owner"] != owner and not row["public"]):
        raise HTTPException(404, f"checkpoint {path!r} not found")
    folder = server.checkpoints.folder(where)
    try:
        lora = read_manifest(folder).lora_config
    except CheckpointError as e:
        raise HTTPException(400, f"checkpoint {path!r} cannot be loaded: {e}") from None
    limit = server.config.max_lora_rank
    if lora.rank > limit:
        raise HTTPException(400, f"checkpoint {path!r} has LoRA rank {lora.rank}, above this server's limit of {limit}")
    return LoadSpec(checkpoint_dir=folder, with_optimizer=with_optimizer, path=where, max_rank=limit,
                    config=lora.config())


@router.post("/api/v1/load_weights")
def load_weights(body: LoadWeightsRequest, owner: str = Depends(require_owner), server: Server = Depends(get_server)):
    if body.model_id is not None:  # mode A: into an existing model, in its seq_id order
        _active_model(server, body.model_id, owner)
        if body.seq_id is None:
            raise HTTPException(400, "load_weights into an existing model needs seq_id")
        return _submit(server, owner, body.model_id, body.seq_id, "load_weights",
                       lambda: _checkpoint_for_load(server, owner, body.path, body.optimizer))
    if body.session_id is None or body.model_seq_id is None:
        raise HTTPException(400, "load_weights needs either model_id and seq_id, or session_id and model_seq_id")
    _owned_session(server, body.session_id, owner)
    if body.base_model is not None and body.base_model != server.config.base_model:
        raise HTTPException(400, f"base model {body.base_model!r} is not served here; this server serves "
                                 f"{server.config.base_model!r}")
    spec = _checkpoint_for_load(server, owner, body.path, body.optimizer)
    lora = spec.config.to_dict()
    model_id = f"{body.session_id}:train:{body.model_seq_id}"
    return _create(server, owner, model_id, body.session_id, "load_weights", lora,
                   body.optimizer_config or {"type": "adamw"}, body.user_metadata or {}, spec)


# -- futures ----------------------------------------------------------------------------------------

@router.post("/api/v1/retrieve_future")
async def retrieve_future(body: RetrieveFutureRequest, owner: str = Depends(require_owner),
                          server: Server = Depends(get_server)):
    rec = server.store.get_future(body.request_id)
    if rec is None or rec.owner != owner:
        raise HTTPException(404, f"unknown request_id {body.request_id!r}")
    # The owner check already read the record: a finished one is answered from it directly.
    result = server.futures.from_record(rec) or await server.futures.wait(body.request_id, server.config.long_poll_s)
    if result is None:
        return {"type": "try_again", "request_id": body.request_id, "queue_state": "active"}
    media = "application/x-protobuf" if result.is_proto else "application/json"
    return Response(content=result.payload, media_type=media)
