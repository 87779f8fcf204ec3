"""`ServedModel` and `ModelRegistry`: the base models this server serves, and each one's parts.

A served base model has everything of its own: a runtime holding its adapters, a scheduler
queue, a worker, a sampling backend, and the device loop that drives them on its devices. The
registry finds one by the `base_model` name a request carries; a training model, a sampling
session and a checkpoint each belong to the base model they were made on (their records say
which), and every request about them goes to that model's parts. Nothing falls back to another
model: a name that is not served is refused, naming the ones that are.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from ..config.settings import ServerConfig
from ..training.device_loop import DeviceLoop
from ..errors import UserError
from ..models.loading import load_base_model, pick_dtype
from ..runtime.model_runtime import ModelRuntime
from ..runtime.cpu_threads import apply_threads
from ..runtime.recompute import RecomputeChoice, choose_recompute
from ..runtime.kernel_choices import default_micro_batch_tokens
from ..runtime.trainer import TrainingRuntime
from ..sampling.backend import SamplingBackend
from ..sampling.kv_budget import KVBudget
from ..sampling.service import SamplingService
from ..training.scheduler import ClockCycleScheduler
from ..models.vision import ImageEncoder
from ..training.worker import TrainingWorker


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
    kv_budget: KVBudget  # the built-in sampler's KV-cache budget, and how it was chosen
    images: ImageEncoder | None = None  # a vision-language model's image processor; None: text only


def make_runtime(name: str, device: torch.device, config: ServerConfig, data_dir: Path) -> tuple[ModelRuntime, Any]:
    """Load base model `name` and the runtime that trains its adapters (the one place its
    implementation is chosen): a `TrainingRuntime` on `device`, or -- with more than one rank
    (--workers, --nnodes) -- a `PoolRuntime` whose rank 0 is this process (runtime/distributed.py,
    docs/scale.md). Returns (runtime, tokenizer)."""
    dtype = pick_dtype(config.dtype, device)
    if config.workers * config.nnodes == 1:
        if config.cpu_threads != "auto":  # `serve` resolved auto; a Server made inside another process keeps its count
            apply_threads(int(config.cpu_threads))  # runtime/cpu_threads.py
        model, tokenizer = load_base_model(name, data_dir, device, dtype)
        return TrainingRuntime(model, name, device=device, max_tokens_per_micro_batch=config.max_tokens_per_micro_batch,
                               max_live_adapters=config.max_live_adapters,
                               recompute=recompute_choice(config, model, device),
                               cuda_graphs=config.cuda_graphs == "on"), tokenizer
    from ..runtime.distributed import PoolRuntime
    from ..runtime.pool_launch import PoolSettings, RankPool, cpu_threads_per_rank

    settings = PoolSettings(
        base_model=name, dtype=config.dtype, device_type=device.type, workers=config.workers, nnodes=config.nnodes,
        shard_base=config.shard_base, max_tokens_per_micro_batch=config.max_tokens_per_micro_batch,
        max_live_adapters=config.max_live_adapters, timeout_s=config.pool_timeout_s,
        threads=cpu_threads_per_rank(config.workers) if device.type == "cpu" else 0,
        log_level=config.log_level, log_format=config.log_format, interface=config.pool_interface)
    if device.type == "cpu":
        torch.set_num_threads(settings.threads)
    else:  # rank 0 is the first GPU (preflight: the device was given as cuda or auto)
        device = torch.device("cuda", 0)
        torch.cuda.set_device(device)
    # A sharded base is loaded on the CPU: fully_shard moves each rank's shards to its device.
    cpu = torch.device("cpu")
    model, tokenizer = load_base_model(name, data_dir, cpu if config.shard_base else device, dtype)
    recompute = recompute_choice(config, model, device)
    settings = dataclasses.replace(settings, recompute=recompute.on)
    pool = RankPool(settings, master_addr=config.master_addr, master_port=config.master_port, device=device,
                    data_dir=data_dir)
    try:
        pool.start()
        runtime = PoolRuntime(model, name, device=device, pool=pool,
                              reload_base=lambda: load_base_model(name, data_dir, cpu, dtype)[0],
                              max_tokens_per_micro_batch=config.max_tokens_per_micro_batch,
                              max_live_adapters=config.max_live_adapters, recompute=recompute)
    except BaseException:
        pool.close()
        raise
    return runtime, tokenizer


def recompute_choice(config: ServerConfig, model: torch.nn.Module, device: torch.device) -> RecomputeChoice:
    """--activation-checkpointing for `model`, loaded on `device` (runtime/recompute.py)."""
    tokens = config.max_tokens_per_micro_batch or default_micro_batch_tokens(model, device)
    return choose_recompute(config.activation_checkpointing, model, device, tokens)


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
