"""`ServedModel` and `ModelRegistry`: the base models this server serves, and each one's parts.

A served base model has everything of its own: a runtime holding its adapters, a scheduler
queue, a worker, a sampling backend, and the device loop that drives them on its devices. The
registry finds one by the `base_model` name a request carries; a training model, a sampling
session and a checkpoint each belong to the base model they were made on (their records say
which), and every request about them goes to that model's parts. Nothing falls back to another
model: a name that is not served is refused, naming the ones that are.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import torch

from .config import ServerConfig
from .device_loop import DeviceLoop
from .errors import UserError
from .model_runtime import ModelRuntime
from .runtime.trainer import TrainingRuntime
from .sampling.backend import SamplingBackend
from .sampling.service import SamplingService
from .scheduler import ClockCycleScheduler
from .worker import TrainingWorker


@dataclass
class ServedModel:
    name: str  # the base_model id clients send
    tokenizer: Any  # a transformers tokenizer
    eos_token_ids: set[int]  # tokens that end a generation by default
    runtime: ModelRuntime
    scheduler: ClockCycleScheduler
    worker: TrainingWorker
    sampling_backend: SamplingBackend
    sampler: SamplingService
    loop: DeviceLoop


def make_runtime(name: str, model: torch.nn.Module, device: torch.device, config: ServerConfig) -> ModelRuntime:
    """The runtime that trains `name`'s adapters (the one place its implementation is chosen)."""
    return TrainingRuntime(model, name, device=device, max_tokens_per_micro_batch=config.max_tokens_per_micro_batch,
                           max_live_adapters=config.max_live_adapters)


class ModelRegistry:
    def __init__(self, models: list[ServedModel]):
        if not models:
            raise ValueError("a server serves at least one base model")
        self._models = {m.name: m for m in models}

    def get(self, base_model: str) -> ServedModel:
        model = self._models.get(base_model)
        if model is None:
            raise UserError(f"base model {base_model!r} is not served here; this server serves "
                            + ", ".join(repr(n) for n in self._models))
        return model

    @property
    def names(self) -> list[str]:
        return list(self._models)

    def has_training_model(self, model_id: str) -> bool:
        """Whether a served model holds this training model now (it can take work)."""
        return any(m.scheduler.has_model(model_id) for m in self._models.values())

    def __iter__(self) -> Iterator[ServedModel]:
        return iter(self._models.values())

    def __len__(self) -> int:
        return len(self._models)
