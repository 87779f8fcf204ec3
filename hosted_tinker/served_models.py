"""`ServedModel` and `ModelRegistry`: the base models this server serves, and each one's parts.

A served base model has everything of its own: a runtime holding its adapters, a scheduler
queue, a worker, a sampling backend, and the device loop that drives them on its devices. The
registry finds one by the `base_model` name a request carries. One model is served today;
serving several is adding entries.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from .device_loop import DeviceLoop
from .errors import UserError
from .model_runtime import ModelRuntime
from .sampling.backend import SamplingBackend
from .sampling.service import SamplingService
from .scheduler import ClockCycleScheduler
from .worker import TrainingWorker

if TYPE_CHECKING:
    import torch

    from .config import ServerConfig


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


def build_runtime(config: ServerConfig, data_dir: Path, device: torch.device) -> tuple[ModelRuntime, Any]:
    """Load `config.base_model` and the runtime that trains it: a `TrainingRuntime` in this process,
    or -- with more than one rank (--workers, --nnodes) -- a `PoolRuntime` whose rank 0 is this
    process (runtime/distributed.py). Returns (runtime, tokenizer)."""
    from .model_loading import load_base_model, pick_dtype

    dtype = pick_dtype(config.dtype, device)
    if config.workers * config.nnodes == 1:
        from .runtime.trainer import TrainingRuntime

        model, tokenizer = load_base_model(config.base_model, data_dir, device, dtype)
        return TrainingRuntime(model, config.base_model, device=device,
                               max_tokens_per_micro_batch=config.max_tokens_per_micro_batch,
                               max_live_adapters=config.max_live_adapters), tokenizer
    import torch

    from .runtime.distributed import PoolRuntime
    from .runtime.pool_launch import PoolSettings, RankPool, cpu_threads_per_rank

    settings = PoolSettings(
        base_model=config.base_model, dtype=config.dtype, device_type=device.type, workers=config.workers,
        nnodes=config.nnodes, shard_base=config.shard_base, max_tokens_per_micro_batch=config.max_tokens_per_micro_batch,
        max_live_adapters=config.max_live_adapters, timeout_s=config.pool_timeout_s,
        threads=cpu_threads_per_rank(config.workers) if device.type == "cpu" else 0,
        log_level=config.log_level, log_format=config.log_format)
    if device.type == "cpu":
        torch.set_num_threads(settings.threads)
    # A sharded base is loaded on the CPU: fully_shard moves each rank's shards to its device.
    load_on = torch.device("cpu") if config.shard_base else device
    model, tokenizer = load_base_model(config.base_model, data_dir, load_on, dtype)
    pool = RankPool(settings, master_addr=config.master_addr, master_port=config.master_port, device=device,
                    data_dir=data_dir)
    try:
        pool.start()
        runtime = PoolRuntime(model, config.base_model, device=device, pool=pool,
                              reload_base=lambda: load_base_model(config.base_model, data_dir, torch.device("cpu"),
                                                                  dtype)[0],
                              max_tokens_per_micro_batch=config.max_tokens_per_micro_batch,
                              max_live_adapters=config.max_live_adapters)
    except BaseException:
        pool.close()
        raise
    return runtime, tokenizer


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
