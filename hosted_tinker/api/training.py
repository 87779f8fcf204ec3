"""Training routes and `retrieve_future`: HTTP in, `TrainingRequests` (services/training.py) does the work."""

from __future__ import annotations

from typing import Any

from fastapi import APIRouter, Depends, Header, HTTPException, Request
from fastapi.concurrency import run_in_threadpool
from fastapi.responses import Response
from pydantic import Field

from ..accounts.access import Access, owned
from ..checkpoints.encryption import parse_recipients
from ..checkpoints.paths import check_name
from ..requests.kinds import SaveSpec
from ..server.core import Server
from ..services.training import TrainingRequests, checkpoint_to_load
from ..store.retention import SNAPSHOT_NAME
from ..wire.codec import WireError, decode_forward_backward_request
from .deps import get_access, get_server, get_training, require_owner
from .schemas import (
    Body, CreateModelRequest, LoadWeightsRequest, LoraConfigIn, ModelRef, OptimStepRequest,
    RetrieveFutureRequest, SaveWeightsForSamplerRequest, SaveWeightsRequest,
)

router = APIRouter()

# JSON routes whose body carries a training model's seq_id.
SEQ_ID_ROUTES = frozenset({"/api/v1/optim_step", "/api/v1/save_weights", "/api/v1/save_weights_for_sampler",
                           "/api/v1/save_weights_external", "/api/v1/load_weights"})


async def close_refused_seq_id(request: Request, body: Any) -> None:
    """FastAPI refused the body of a request with a seq_id before its route ran (a 422): count that
    seq_id as done, if the body names one, so the model's next request runs at once."""
    if request.url.path not in SEQ_ID_ROUTES or not isinstance(body, dict):
        return
    model_id, seq_id = body.get("model_id"), body.get("seq_id")
    if not isinstance(model_id, str) or type(seq_id) is not int:
        return
    try:
        owner = await require_owner(request, request.headers.get("x-api-key"))
    except HTTPException:
        return
    await run_in_threadpool(request.app.state.training.refused, owner, model_id, seq_id)


# -- models -----------------------------------------------------------------------------------------

@router.post("/api/v1/create_model")
def create_model(body: CreateModelRequest, owner: str = Depends(require_owner),
                 training: TrainingRequests = Depends(get_training)):
    return training.create_model(owner, body.session_id, body.model_seq_id, body.base_model,
                                 **(body.lora_config or LoraConfigIn()).model_dump(),
                                 optimizer=body.optimizer_config or {"type": "adamw"},
                                 user_metadata=body.user_metadata or {})


@router.post("/api/v1/get_info")
def get_info(body: ModelRef, owner: str = Depends(require_owner), training: TrainingRequests = Depends(get_training)):
    return training.info(owner, body.model_id)


@router.post("/api/v1/unload_model")
def unload_model(body: ModelRef, owner: str = Depends(require_owner),
                 training: TrainingRequests = Depends(get_training)):
    return training.unload(owner, body.model_id)


# -- compute ----------------------------------------------------------------------------------------

@router.post("/api/v1/forward_backward")
async def forward_backward(request: Request, owner: str = Depends(require_owner),
                           content_encoding: str | None = Header(default=None),
                           training: TrainingRequests = Depends(get_training)):
    check_protobuf(request.headers.get("content-type", ""))
    body = await request.body()  # bounded by the body limit (api/limits.py)
    return await submit_forward_backward(training, owner, body, content_encoding)


def check_protobuf(content_type: str) -> None:
    if "protobuf" not in content_type:
        raise HTTPException(415, "forward_backward takes a protobuf ForwardBackwardRequest "
                                 "(Content-Type: application/x-protobuf), as sent by tinker>=0.25")


async def submit_forward_backward(training: TrainingRequests, owner: str, body: bytes,
                                  content_encoding: str | None) -> dict:
    """The route's work, shared with its fast path (hot_routes.py)."""
    def decode_and_submit() -> dict:
        # One trip to the thread pool, not one to decode and another to submit: the request is on
        # the critical path of every training step (a pipelining client posts optim_step after it).
        try:
            call = decode_forward_backward_request(body, content_encoding,
                                                   max_decompressed_bytes=training.config.max_request_bytes)
        except WireError as e:
            if e.request is not None:
                training.refused(owner, *e.request)
            raise HTTPException(400, f"malformed forward_backward body: {e}") from None
        return training.forward_backward(owner, call)

    return await run_in_threadpool(decode_and_submit)


@router.post("/api/v1/optim_step")
def optim_step(body: OptimStepRequest, owner: str = Depends(require_owner),
               training: TrainingRequests = Depends(get_training)):
    return submit_optim_step(training, owner, body)


def submit_optim_step(training: TrainingRequests, owner: str, body: OptimStepRequest) -> dict:
    """The route's work, shared with its fast path (hot_routes.py). Writes SQLite: off the event loop."""
    adam = body.adam_params.model_dump() if body.adam_params is not None else None
    return training.optim_step(owner, body.model_id, body.seq_id, adam, (body.optimizer_params or {}).get("type"))


# -- checkpoints ------------------------------------------------------------------------------------

@router.post("/api/v1/save_weights")
def save_weights(body: SaveWeightsRequest, owner: str = Depends(require_owner),
                 training: TrainingRequests = Depends(get_training)):
    return training.save(owner, body.model_id, body.seq_id, "save_weights", lambda: SaveSpec(
        kind="weights", name=check_name(body.path), owner=owner, overwrite=body.overwrite,
        ttl_seconds=body.ttl_seconds, user_metadata=body.user_metadata))


@router.post("/api/v1/save_weights_for_sampler")
def save_weights_for_sampler(body: SaveWeightsForSamplerRequest, owner: str = Depends(require_owner),
                             training: TrainingRequests = Depends(get_training)):
    def spec() -> SaveSpec:
        if body.path is not None and SNAPSHOT_NAME.fullmatch(body.path):
            raise HTTPException(400, f"checkpoint name {body.path!r}: names ephemeral-<number> are the server's "
                                     "(save_weights_and_get_sampling_client's snapshots); choose another")
        if body.path is not None:
            return SaveSpec(kind="sampler_weights", name=check_name(body.path), owner=owner, overwrite=True,
                            ttl_seconds=body.ttl_seconds, user_metadata=body.user_metadata)
        if body.sampling_session_seq_id is None:
            raise HTTPException(400, "save_weights_for_sampler needs a name (path) or a sampling_session_seq_id")
        return training.ephemeral_sampler_spec(owner, body.model_id, body.seq_id, body.sampling_session_seq_id,
                                               body.ttl_seconds)

    return training.save(owner, body.model_id, body.seq_id, "save_weights_for_sampler", spec)


class SaveWeightsExternalRequest(Body):
    model_id: str
    seq_id: int = Field(ge=1)
    path: str
    ttl_seconds: int | None = Field(None, ge=1)
    age_encryption_recipients: list[str] | None = None


@router.post("/api/v1/save_weights_external")
def save_weights_external(body: SaveWeightsExternalRequest, owner: str = Depends(require_owner),
                          training: TrainingRequests = Depends(get_training)):
    """The adapter as a standard PEFT directory, downloadable through signed URLs
    (`GET .../external_weights_urls`). Saving again under the same name replaces it. With
    `age_encryption_recipients`, every file is encrypted to them and named with `.age`."""
    def spec() -> SaveSpec:
        try:
            recipients = parse_recipients(body.age_encryption_recipients or [])
        except ValueError as e:
            raise HTTPException(400, str(e)) from None
        return SaveSpec(kind="external_weights", name=check_name(body.path), owner=owner, overwrite=True,
                        ttl_seconds=body.ttl_seconds, age_recipients=recipients)

    return training.save(owner, body.model_id, body.seq_id, "save_weights_external", spec)


@router.post("/api/v1/load_weights")
def load_weights(body: LoadWeightsRequest, owner: str = Depends(require_owner),
                 training: TrainingRequests = Depends(get_training), access: Access = Depends(get_access)):
    if body.model_id is not None:  # mode A: into an existing model, in its seq_id order
        return training.load(owner, body.model_id, body.seq_id, lambda: checkpoint_to_load(
            access, owner, body.path, body.optimizer, max_rank=training.config.max_lora_rank))
    if body.session_id is None or body.model_seq_id is None:
        raise HTTPException(400, "load_weights needs either model_id and seq_id, or session_id and model_seq_id")
    return training.create_from_checkpoint(owner, body.session_id, body.model_seq_id, body.base_model,
                                           lambda: checkpoint_to_load(access, owner, body.path, body.optimizer,
                                                                        max_rank=training.config.max_lora_rank),
                                           body.optimizer_config or {"type": "adamw"}, body.user_metadata or {})


# -- futures ----------------------------------------------------------------------------------------

@router.post("/api/v1/retrieve_future")
async def retrieve_future(body: RetrieveFutureRequest, owner: str = Depends(require_owner),
                          access: Access = Depends(get_access), server: Server = Depends(get_server)):
    return await answer_future(server, access, owner, body)


async def answer_future(server: Server, access: Access, owner: str, body: RetrieveFutureRequest) -> Response | dict:
    """The route's work, shared with its fast path (hot_routes.py): the result, or `try_again` after
    the long-poll window."""
    futures = server.futures
    known = futures.known(body.request_id)  # this process's requests: checked and answered from memory
    if known is not None:
        result = owned(known, owner, f"unknown request_id {body.request_id!r}").result
    else:
        rec = await run_in_threadpool(access.future, owner, body.request_id)  # SQLite: off the event loop
        result = futures.from_record(rec)  # the owner check read the record: a finished one is answered from it
    result = result or await futures.wait(body.request_id, server.config.long_poll_s)
    if result is None:
        return {"type": "try_again", "request_id": body.request_id, "queue_state": "active"}
    futures.delivered(body.request_id)
    media = "application/x-protobuf" if result.is_proto else "application/json"
    return Response(content=result.payload, media_type=media)
