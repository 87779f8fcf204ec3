"""`make_backend`: the one place a served model's sampling backend is chosen and built.

The built-in engine (`EngineBackend`) always, on the model's device and layers; with `--vllm` /
`--vllm-url`, a `VLLMBackend` around it that samples on a vLLM sidecar (launched with the same
weights, or attached) and hands the jobs vLLM refuses to the built-in one.

A new backend is its own module (a `SamplingBackend`, reporting its scrape-time series through
`metrics()` and its requests through the `SamplingObserver`) and a branch here: nothing else
asks which backend a model has.
"""

from __future__ import annotations

import functools
import logging
import os
from collections.abc import Callable
from pathlib import Path
from typing import Any, Protocol

import torch

from ..config.settings import ServerConfig
from ..models.loading import model_directory, pick_dtype
from ..runtime.model_runtime import ModelRuntime
from .backend import EngineBackend, SamplingBackend
from .engine import SamplingEngine
from .jobs import SampleJob, SampleResult
from .kv_budget import KVBudget
from .snapshots import SnapshotCache
from .vllm_adapters import AdapterVersions, cpu_launch_refusal, fused_layout, layout_refusal
from .vllm_export import EXPERTS_TARGET, VLLM_EXPERT_LAYOUTS
from .vllm_backend import VLLMSamplingBackend
from .vllm_server_backend import VLLMBackend
from .vllm_sidecar import VLLMLaunch, VLLMSidecar, vllm_child_devices, vllm_python

log = logging.getLogger(__name__)


class SamplingObserver(Protocol):
    """Hears of each finished sample request (api/metrics.py), on the backend's threads, so it must
    be quick. `base_model`: the served model whose backend ran it."""

    def observe_sample(self, base_model: str, job: SampleJob, generated_tokens: int) -> None: ...

    def observe_vllm_request(self, base_model: str, job: SampleJob, result: SampleResult | None,
                             seconds: float) -> None: ...


def make_backend(name: str, config: ServerConfig, runtime: ModelRuntime, tokenizer: Any, device: torch.device,
                 kv_budget: KVBudget, wake: Callable[[], None], data_dir: Path,
                 observer: SamplingObserver) -> SamplingBackend:
    """The sampling backend of base model `name`, loaded in `runtime` on `device`; `wake` rings its device loop."""
    builtin = EngineBackend(
        SamplingEngine(runtime.model, runtime.routing, tokenizer, device, kv_budget_tokens=kv_budget.tokens,
                       kv_share_per_key=config.max_sampling_kv_share_per_key, cuda_graphs=config.cuda_graphs == "on",
                       # beside vLLM it samples only what vLLM refuses: its cache grows as those need it
                       preallocate=not config.samples_on_vllm,
                       on_request_done=functools.partial(observer.observe_sample, name)),
        SnapshotCache(runtime.layers, device, capacity=config.max_sampler_snapshots), wake, runtime)
    if not config.samples_on_vllm:
        return builtin
    unlaunchable = None if device.type != "cpu" or config.vllm_url else cpu_launch_refusal(
        runtime.projections, takes_images=runtime.image_token_id is not None)
    if unlaunchable is not None:
        log.warning("not starting vLLM for %s, the built-in engine samples it: %s", name, unlaunchable)
        return builtin
    return _vllm_backend(name, config, runtime, builtin, device, data_dir, observer)  # one served model (preflight)


def _vllm_backend(name: str, config: ServerConfig, runtime: ModelRuntime, builtin: EngineBackend,
                  device: torch.device, data_dir: Path, observer: SamplingObserver) -> VLLMBackend:
    """Sampling base model `name` on vLLM (launched with the same weights, or attached), the jobs
    it refuses on `builtin`. vLLM starts in the background (20-90 s on a CPU, minutes for a big
    model on a GPU); sampling requests wait for it, training does not."""
    # vLLM runs where training does (launched: on the same box; attached: taken to be alike).
    architecture = type(runtime.model).__name__
    refused = layout_refusal(runtime.projections, architecture, on_cpu=device.type == "cpu")
    # MoE expert LoRA goes to vLLM per expert (vllm_export.py), for the models it takes it for.
    expert_layout = (VLLM_EXPERT_LAYOUTS.get(architecture)
                     if refused is None and any(p.kind == "experts" for p in runtime.projections) else None)
    if config.vllm_url is not None:
        sidecar = VLLMSidecar(url=config.vllm_url, served_model_name=name)
    else:
        dtype = str(pick_dtype(config.dtype, device)).removeprefix("torch.")  # vLLM runs the training dtype
        fused_modules, fused_components = fused_layout(runtime.projections)
        launch = VLLMLaunch(
            python=str(vllm_python(config)), model=str(model_directory(name, data_dir).resolve()), served_model_name=name,
            max_lora_rank=config.max_lora_rank, max_loras=config.max_live_adapters,
            max_cpu_loras=config.max_live_adapters + config.max_sampler_snapshots, max_model_len=runtime.max_context,
            lora_lm_head=config.vllm_lora_lm_head, dtype=dtype, kv_cache_bytes=config.vllm_kv_cache_bytes,
            fused_lora_modules=fused_modules, fused_components=fused_components,
            expert_lora_modules=(EXPERTS_TARGET,) if expert_layout else (),
            devices=vllm_child_devices(config.vllm_devices, os.environ.get("CUDA_VISIBLE_DEVICES")))
        sidecar = VLLMSidecar(launch=launch, log_file=data_dir / "vllm.log")
    adapters = AdapterVersions(sidecar, name, lora_lm_head=config.vllm_lora_lm_head,
                               max_snapshots=config.max_sampler_snapshots,
                               refused_layout=refused, expert_layout=expert_layout)
    backend = VLLMBackend(runtime, builtin, sidecar, adapters, VLLMSamplingBackend(sidecar, adapters),
                          on_request_done=functools.partial(observer.observe_vllm_request, name),
                          max_pins=config.max_sampler_snapshots)
    sidecar.start()
    log.info("vLLM %s; sampling requests wait for it to be ready", f"at {config.vllm_url}" if config.vllm_url else
             f"starting on port {sidecar.port} (its log: {data_dir / 'vllm.log'})")
    return backend
