"""`ServedModel` and `ModelRegistry`: the base models this server serves, and each one's parts.

A served base model has everything of its own: a runtime holding its adapters, a scheduler
queue, a worker, a sampling backend, and the device loop that drives them on its devices. The
registry finds one by the `base_model` name a request carries. One model is served today;
serving several is adding entries.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from .device_loop import DeviceLoop
from .errors import UserError
from .model_runtime import ModelRuntime
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


class ModelRegistry:
    def __init__(self, models: list[ServedModel]):
        if not models:
            raise ValueError("a server serves at least one base model")
        self._models = {m.name: m for m in models}
        self.default = models[0]

    def get(self, base_model: str) -> ServedModel:
        model = self._models.get(base_model)
        if model is None:
            raise UserError(f"base model {base_model!r} is not served here; this server serves "
                            + ", ".join(repr(n) for n in self._models))
        return model

    def __iter__(self):
        return iter(self._models.values())
