"""Typed request bodies of the Tinker JSON endpoints (the SDK's `tinker.types`, server side).

Unknown fields are ignored (newer SDKs add fields); wrong types and out-of-range values are a
422 with pydantic's description of what is wrong. Every integer field, and every integer in a
list field, must fit in a signed 64-bit integer, what SQLite, numpy and torch hold: JSON integers
are unbounded, and a seq_id of 10**30 used to reach SQLite, a CSR column index of 2**70 numpy,
and come back as a 500 (OverflowError).
"""

from __future__ import annotations

import json
from typing import Annotated, Any, Literal

from pydantic import AfterValidator, BaseModel, ConfigDict, Field, field_validator

from .limits import check_stored_json

INT64_MIN, INT64_MAX = -(2**63), 2**63 - 1
# What a user may attach to an object it creates: stored in SQLite with it and sent back on reads.
STORED_FIELD_MAX_BYTES = 64 << 10


def _stored(what: str) -> AfterValidator:
    return AfterValidator(lambda value: check_stored_json(value, what, STORED_FIELD_MAX_BYTES))


UserMetadata = Annotated[dict[str, Any], _stored("user_metadata")]
StrMetadata = Annotated[dict[str, str], _stored("user_metadata")]
Tags = Annotated[list[str], _stored("tags")]
OptimizerConfig = Annotated[dict[str, Any], _stored("optimizer_config")]
# Names and short labels (project, display name, a session's finish reason), in characters.
SHORT_TEXT_MAX_CHARS = 1024
ShortText = Annotated[str, Field(max_length=SHORT_TEXT_MAX_CHARS)]
# Rows in one page of a listing (runs, checkpoints, sessions): each costs a query or more. The SDK's CLI
# pages checkpoints by 1000 and runs by 100.
PAGE_MAX_ROWS = 1000


def fits_int64(value: Any) -> Any:
    """`value`, if every integer in it (a list's too: a CSR's column indices, stop token ids) fits
    in a signed 64-bit integer; else a ValueError naming the first one that does not."""
    if isinstance(value, int) and not isinstance(value, bool) and not INT64_MIN <= value <= INT64_MAX:
        raise ValueError(f"{value} does not fit in a signed 64-bit integer")
    if isinstance(value, list):
        for item in value:
            fits_int64(item)
    return value


class Body(BaseModel):
    model_config = ConfigDict(extra="ignore", protected_namespaces=())

    @field_validator("*", mode="after")
    @classmethod
    def _fits_int64(cls, value: Any) -> Any:
        return fits_int64(value)


class ClientConfigRequest(Body):
    sdk_version: str | None = None


class CreateSessionRequest(Body):
    """POST /api/v1/create_session: what a ServiceClient says of itself and its run (project_id and
    display_name are private to the owner; tags and user_metadata too, see store/sessions.py)."""

    sdk_version: str | None = None
    project_id: ShortText | None = None
    display_name: ShortText | None = None
    tags: Tags = Field(default_factory=list)
    user_metadata: UserMetadata = Field(default_factory=dict)


class SessionHeartbeatRequest(Body):
    """POST /api/v1/session_heartbeat: the SDK's heartbeat thread keeps its session alive."""

    session_id: str


class FinishReason(Body):
    type: ShortText = "success"


class FinishSessionRequest(Body):
    reason: FinishReason | None = None
    detail: str | None = None


class LoraConfigIn(Body):
    """The SDK's LoraConfig: which parts of the model the adapter trains, at which rank."""

    rank: int = Field(32, ge=1)
    seed: int | None = None
    train_unembed: bool = True
    train_mlp: bool = True
    train_attn: bool = True


class CreateModelRequest(Body):
    """POST /api/v1/create_model: a training run of a session (model_seq_id orders it among the session's)."""

    session_id: str
    model_seq_id: int = Field(ge=0)
    base_model: str
    user_metadata: UserMetadata | None = None
    lora_config: LoraConfigIn | None = None
    optimizer_config: OptimizerConfig | None = None


class ModelRef(Body):
    """The body of the requests that name only a run (get_info, unload_model, ...)."""

    model_id: str


class AdamParamsIn(Body):
    learning_rate: float = Field(1e-4, ge=0, allow_inf_nan=False)
    beta1: float = Field(0.9, ge=0, lt=1)
    beta2: float = Field(0.95, ge=0, lt=1)
    eps: float = Field(1e-12, gt=0, allow_inf_nan=False)
    weight_decay: float = Field(0.0, ge=0, allow_inf_nan=False)
    grad_clip_norm: float = Field(0.0, ge=0, allow_inf_nan=False)


class OptimStepRequest(Body):
    model_id: str
    seq_id: int = Field(ge=1)
    adam_params: AdamParamsIn | None = None
    optimizer_params: dict[str, Any] | None = None


class SaveWeightsRequest(Body):
    model_id: str
    seq_id: int = Field(ge=1)
    path: str
    ttl_seconds: int | None = Field(None, ge=1)
    overwrite: bool = False
    user_metadata: StrMetadata | None = None


class SaveWeightsForSamplerRequest(Body):
    model_id: str
    seq_id: int = Field(ge=1)
    path: str | None = None
    sampling_session_seq_id: int | None = None
    kind: Literal["snapshot", "inflight"] = "snapshot"
    ttl_seconds: int | None = Field(None, ge=1)
    user_metadata: StrMetadata | None = None


class LoadWeightsRequest(Body):
    path: str
    optimizer: bool = False
    # mode A: load into an existing model at its next seq_id
    model_id: str | None = None
    seq_id: int | None = None
    # mode B: create a model from the checkpoint (create_training_client_from_state)
    session_id: str | None = None
    model_seq_id: int | None = Field(None, ge=0)
    base_model: str | None = None
    user_metadata: UserMetadata | None = None
    optimizer_config: OptimizerConfig | None = None
    weights_access_token: str | None = None


class RetrieveFutureRequest(Body):
    request_id: str
    allow_metadata_only: bool = False


def str_dict(text: str | None) -> dict[str, str]:
    """Stored user metadata as the SDK types it ({str: str}); other JSON values are sent as JSON text."""
    value = json.loads(text) if text else {}
    return {str(k): v if isinstance(v, str) else json.dumps(v) for k, v in (value or {}).items()}
