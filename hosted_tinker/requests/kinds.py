"""The training requests' vocabulary: every kind, its payload and its result, declared once.

    kind                       payload      result
    create_model               LoRAConfig   CreateModelResult
    forward, forward_backward  FBWork       FBOutcome (answered as protobuf)
    optim_step                 AdamParams   OptimStepResult
    save_weights               SaveSpec     SaveWeightsResult
    save_weights_for_sampler   SaveSpec     SamplerWeightsResult
    save_weights_external      SaveSpec     ExternalWeightsResult
    load_weights               LoadSpec     LoadWeightsResult
    unload_model               None         UnloadModelResult

The services build payloads, the scheduler orders requests by kind, the worker runs them and
answers with the kind's result; a failed request answers with a `Failure`. Each result's
`to_wire()` is the body its future answers with, exactly what the SDK reads. This module sits
on the ground floor and imports nothing that runs on the device, so the API and the services
speak to the worker through these types alone.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from enum import StrEnum
from functools import cached_property
from pathlib import Path
from typing import ClassVar, Protocol, Union

import numpy as np

from ..errors import UserError
from ..models.vision import Pixels
from ..wire.codec import encode_forward_backward_output


class RequestKind(StrEnum):
    """A training request's kind; its value is the string the store and the wire carry."""

    CREATE_MODEL = "create_model"
    FORWARD = "forward"
    FORWARD_BACKWARD = "forward_backward"
    OPTIM_STEP = "optim_step"
    SAVE_WEIGHTS = "save_weights"
    SAVE_WEIGHTS_FOR_SAMPLER = "save_weights_for_sampler"
    SAVE_WEIGHTS_EXTERNAL = "save_weights_external"
    LOAD_WEIGHTS = "load_weights"
    UNLOAD_MODEL = "unload_model"


MAX_TTL_S = 10 * 365 * 24 * 3600  # a longer checkpoint TTL is a mistake (and a time `datetime` may not print)

# Tinker does not document its LoRA alpha; we use a fixed alpha of 32 (scaling = 32 / rank),
# the value used in Thinking Machines' "LoRA Without Regret" write-up, and we write it into
# every exported adapter_config.json so PEFT and vLLM reproduce our outputs exactly.
DEFAULT_LORA_ALPHA = 32.0


# -- payloads ------------------------------------------------------------------------------------

class Adaptable(Protocol):
    """A projection that may carry a LoRA: its role (`projections.ROLES`) is all a config asks."""

    role: str


@dataclass(frozen=True)
class LoRAConfig:
    rank: int = 32
    seed: int = 0
    train_mlp: bool = True
    train_attn: bool = True
    train_unembed: bool = True
    alpha: float = DEFAULT_LORA_ALPHA
    # Leaf projection names to adapt (e.g. ("q_proj", "v_proj")), on top of the train_* flags.
    # None = every projection of the enabled roles. Set for adapters made elsewhere (PEFT), whose
    # target_modules are often a subset of a role.
    target_modules: tuple[str, ...] | None = None

    def __post_init__(self) -> None:
        if self.target_modules is not None:  # a JSON manifest gives a list
            object.__setattr__(self, "target_modules", tuple(sorted(self.target_modules)))

    @property
    def scaling(self) -> float:
        return self.alpha / self.rank

    @property
    def roles(self) -> dict[str, bool]:
        """Which roles of projection (`projections.ROLES`) the train_* flags ask for."""
        return {"attn": self.train_attn, "mlp": self.train_mlp, "unembed": self.train_unembed}

    def adapts(self, path: str, layer: Adaptable) -> bool:
        """Whether the projection at LoRA path `path` gets a LoRA under this config."""
        if self.target_modules is not None and path.rsplit(".", 1)[-1] not in self.target_modules:
            return False
        return self.roles[layer.role]

    def to_dict(self) -> dict:
        return asdict(self)


@dataclass(frozen=True)
class AdamParams:
    learning_rate: float = 1e-4
    beta1: float = 0.9
    beta2: float = 0.95
    eps: float = 1e-12
    weight_decay: float = 0.0
    grad_clip_norm: float = 0.0


def targets_per_position(inputs: dict[str, np.ndarray]) -> int:
    """K of a datum's (N, K) `target_tokens`; 0 for (N,) targets."""
    targets = inputs["target_tokens"]
    return int(targets.shape[1]) if targets.ndim == 2 else 0


@dataclass
class DatumWork:
    tokens: np.ndarray  # int64 [N]
    inputs: dict[str, np.ndarray]  # loss_fn_inputs, already validated
    pixels: Pixels | None = None  # a vision-language model's images, their tokens already in `tokens`


@dataclass
class FBWork:
    """One forward / forward_backward request of one model (already validated)."""

    model_id: str
    data: list[DatumWork]
    loss_fn: str
    loss_config: dict[str, float]
    forward_only: bool

    @property
    def targets_k(self) -> int:
        """K of the request's (N, K) target_tokens, 0 for (N,) ones (one form per request: the API
        checks it). A pool rank's share may hold no datum: 0."""
        return targets_per_position(self.data[0].inputs) if self.data else 0

    @cached_property
    def images(self) -> list[Pixels]:
        """Its datums' images, in datum order (none for text; a part of a request in parts has its own)."""
        return [d.pixels for d in self.data if d.pixels is not None]


@dataclass
class SaveSpec:
    kind: str  # "weights" (training state, with optimizer) | "sampler_weights" | "external_weights" (adapter only)
    name: str
    owner: str
    overwrite: bool = False
    ttl_seconds: int | None = None
    user_metadata: dict | None = None
    sampling_session_id: str | None = None  # set for the ephemeral save_weights_and_get_sampling_client
    age_recipients: list = field(default_factory=list)  # pyrage recipients: encrypt the files to them (external)

    def __post_init__(self) -> None:
        if self.ttl_seconds is not None and not 1 <= self.ttl_seconds <= MAX_TTL_S:
            raise UserError(f"ttl_seconds must be between 1 and {MAX_TTL_S} (10 years), or unset to never expire; "
                            f"got {self.ttl_seconds}")


@dataclass
class LoadSpec:
    checkpoint_dir: Path
    with_optimizer: bool
    path: str  # the checkpoint's tinker:// path, echoed in the result
    max_rank: int  # the server's --max-lora-rank, checked against the files as read


Payload = Union[LoRAConfig, FBWork, AdamParams, SaveSpec, LoadSpec, None]


# -- results -------------------------------------------------------------------------------------

@dataclass
class FBOutcome:
    """The result of forward and forward_backward."""

    outputs: list[dict[str, np.ndarray]]  # per datum: logprobs, elementwise_loss
    metrics: dict[str, float]

    def to_wire(self) -> bytes:
        return encode_forward_backward_output(self.outputs, self.metrics)


def set_fields(result) -> dict:
    """A dataclass's fields as JSON for the SDK, leaving out the unset (None) ones."""
    return {k: v for k, v in asdict(result).items() if v is not None}


@dataclass(frozen=True)
class _JSONResult:
    """A result the SDK reads as JSON: {"type": <its kind>, <its fields but the unset ones>}.
    Each subclass names its request kind in its class line: ``class X(_JSONResult, kind=...)``."""

    kind: ClassVar[RequestKind]

    def __init_subclass__(cls, kind: RequestKind, **kwargs) -> None:
        super().__init_subclass__(**kwargs)
        cls.kind = kind

    def to_wire(self) -> dict:
        return {"type": self.kind.value, **set_fields(self)}


@dataclass(frozen=True)
class CreateModelResult(_JSONResult, kind=RequestKind.CREATE_MODEL):
    model_id: str


@dataclass(frozen=True)
class OptimStepResult(_JSONResult, kind=RequestKind.OPTIM_STEP):
    metrics: dict[str, float]


@dataclass(frozen=True)
class SaveWeightsResult(_JSONResult, kind=RequestKind.SAVE_WEIGHTS):
    path: str


@dataclass(frozen=True)
class SamplerWeightsResult(_JSONResult, kind=RequestKind.SAVE_WEIGHTS_FOR_SAMPLER):
    """The saved weights' path, or for the ephemeral form the sampling session that serves them."""

    path: str | None = None
    sampling_session_id: str | None = None


@dataclass(frozen=True)
class ExternalWeightsResult(_JSONResult, kind=RequestKind.SAVE_WEIGHTS_EXTERNAL):
    size_bytes: int
    path: str


@dataclass(frozen=True)
class LoadWeightsResult(_JSONResult, kind=RequestKind.LOAD_WEIGHTS):
    path: str
    model_id: str


@dataclass(frozen=True)
class UnloadModelResult(_JSONResult, kind=RequestKind.UNLOAD_MODEL):
    model_id: str


TailResult = Union[CreateModelResult, SaveWeightsResult, SamplerWeightsResult, ExternalWeightsResult,
                   LoadWeightsResult, UnloadModelResult]


@dataclass(frozen=True)
class FutureRef:
    """What the SDK gets back for queued work: the id to poll with retrieve_future."""

    request_id: str
    model_id: str | None = None

    def to_wire(self) -> dict:
        return set_fields(self)
