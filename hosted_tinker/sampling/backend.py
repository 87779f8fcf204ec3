"""`SamplingBackend`: where sample jobs run, behind one small interface.

The API side (`SamplingService`) builds `SampleJob`s and hands them to a backend; the training
side tells the backend when a model's weights get a new version. Two kinds of backend fit:

- one that shares the device loop's accelerator: the built-in `EngineBackend`. It asks for a
  round (`wants_round`) and the `DeviceLoop` gives it one after each training cycle;
- one that samples on its own thread or process (a vLLM sidecar): it never asks for a round,
  and calls each job's callbacks from its own thread.

The contract for every job handed to `submit`: exactly one of `on_done` / `on_error` is called
once, later (after `on_token` for each token, if set), whatever happens: finished, failed,
cancelled or shut down. Callbacks must be short: they hand results to other threads.

A backend reports its own counters and gauges (`metrics()`, read when /metrics is scraped):
api/metrics.py renders them with the served model's label, whatever the backend is. Which
backend a model gets is chosen in one place, backends.py.
"""

from __future__ import annotations

import itertools
import logging
from abc import ABC, abstractmethod
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from ..runtime.model_runtime import ModelRuntime
from .engine import SamplingEngine
from .jobs import SampleJob
from .snapshots import SnapshotCache

log = logging.getLogger(__name__)

CURRENT_PREFIX = "current:"


def current_source(model_id: str) -> str:
    """The snapshot source of training model `model_id`'s current weights (`SnapshotCache`)."""
    return CURRENT_PREFIX + model_id


def samples_current_weights(job: SampleJob) -> bool:
    """Whether `job` samples a training model's current weights on the built-in engine (its
    `adapter_id` came from `EngineBackend.current_weights_ref`)."""
    return job.adapter_id is not None and job.adapter_id.startswith(CURRENT_PREFIX)


@dataclass(frozen=True)
class Series:
    """One value a backend reports at scrape time: a Prometheus counter (its name gets `_total`)
    or gauge, labelled with the served model (api/metrics.py)."""

    name: str
    help: str
    value: float
    counter: bool = False  # False: a gauge


class SamplingBackend(ABC):
    @abstractmethod
    def submit(self, job: SampleJob) -> None:
        """Queue a job (any thread)."""

    def submit_all(self, jobs: list[SampleJob]) -> None:
        """Queue the jobs of one request (any thread)."""
        for job in jobs:
            self.submit(job)

    def refusal(self, job: SampleJob) -> str | None:
        """Why `job` could never run on this backend, however long it waited (the API refuses it with a
        400 instead of queueing it), or None (any thread)."""
        return None

    @abstractmethod
    def cancel(self, job: SampleJob) -> None:
        """Stop a job whose client went away (any thread): it sets `job.cancelled` and stops the
        job soon; unless it finished first, its `on_error` is called (once)."""

    @abstractmethod
    def adapter_updated(self, model_id: str, saved_to: Path | None = None) -> None:
        """`model_id`'s weights have a new version (device loop thread, after its create_model,
        optim_step, load_weights or a save). `saved_to`: a checkpoint directory that now holds them;
        from now on a job naming that directory must get these weights, not what was there before.
        Must not raise: a backend that cannot take the new version fails the jobs that need it."""

    def adapter_removed(self, model_id: str) -> None:  # noqa: B027 (a no-op unless the backend keeps adapters)
        """`model_id` was unloaded (device loop thread): what the backend holds of it can go."""

    def current_weights_ref(self, model_id: str) -> str | None:
        """The `SampleJob.adapter_id` for the jobs of one request that sample training model
        `model_id`'s current weights (as of its last completed optim_step, create or load), or None
        when the model is not loaded here (then a request naming it gets its latest sampler
        checkpoint). Ask once per request: its jobs sample one version, even across a step."""
        return None

    def session_opened(self, adapter_dir: str) -> None:  # noqa: B027 (a no-op unless the backend preloads)
        """A sampling session now samples the checkpoint in `adapter_dir` (any thread; must be quick)."""

    @abstractmethod
    def shutdown(self) -> None:
        """Stop; every job not finished gets `on_error`. Called once, after the device loop stopped."""

    def metrics(self) -> list[Series]:
        """This backend's counters and gauges now (any thread: a snapshot), in the order /metrics lists them."""
        return []

    # -- for backends that share the device loop's accelerator; others keep these defaults ---------
    def wants_round(self) -> bool:
        """Whether the device loop should give this backend a round now."""
        return False

    def run_round(self, *, should_yield: Callable[[], bool], min_seconds: float, max_seconds: float) -> None:
        """Use the device for at most `max_seconds`; after `min_seconds`, return as soon as
        `should_yield()` (training is waiting). Called on the device loop's thread only."""
        raise NotImplementedError(f"{type(self).__name__} samples on its own; it takes no device rounds")


class EngineBackend(SamplingBackend):
    """The built-in `SamplingEngine`, on the device loop's thread and the training model's layers.

    A training model's current weights are sampled from a copy of its adapter as of one version
    (a `SnapshotCache` version of `current_source(model_id)`), made when the first request needing
    that version is admitted, never before: training's own slot changes at every step, under the
    rows still decoding. A request's jobs share a ref (`current_weights_ref`) bound to the version
    its first admitted job got, until none of them is queued or running; a version that is
    superseded (the model stepped) and no longer used is dropped.
    """

    def __init__(self, engine: SamplingEngine, snapshots: SnapshotCache, wake: Callable[[], None],
                 runtime: ModelRuntime):
        self.engine = engine
        self.snapshots = snapshots
        self._wake = wake
        self.runtime = runtime
        # model id -> its weights' version: bumped (device loop thread) at every new version, read by
        # `current_weights_ref` (API threads) to know the model is loaded
        self._versions: dict[str, int] = {}
        self._requests = itertools.count()
        self._bound: dict[str, str] = {}  # a request's current-weights ref -> the snapshot id its jobs sample

    def submit(self, job: SampleJob) -> None:
        self.engine.submit(job)
        self._wake()

    def submit_all(self, jobs: list[SampleJob]) -> None:
        # All at once: a request's binding to one version lasts while any of its jobs is queued.
        self.engine.submit_all(jobs)
        self._wake()

    def refusal(self, job: SampleJob) -> str | None:
        return self.engine.refusal(job)

    def cancel(self, job: SampleJob) -> None:
        job.cancelled = True  # the engine drops it at admission or before its next decode step
        self._wake()

    def current_weights_ref(self, model_id: str) -> str | None:
        if model_id not in self._versions:
            return None
        return f"{current_source(model_id)}@{next(self._requests)}"

    def adapter_updated(self, model_id: str, saved_to: Path | None = None) -> None:
        if saved_to is not None:  # a save: a snapshot of that directory holds what was there before
            self.snapshots.supersede(str(saved_to), keep=self._in_use())
            return
        self._versions[model_id] = self._versions.get(model_id, 0) + 1
        self.snapshots.supersede(current_source(model_id), keep=self._in_use())

    def adapter_removed(self, model_id: str) -> None:  # noqa: B027 (a no-op unless the backend keeps adapters)
        self._versions.pop(model_id, None)
        self.snapshots.supersede(current_source(model_id), keep=self._in_use())

    def shutdown(self) -> None:
        self.engine.fail_all("the server is shutting down; resubmit this request")

    def metrics(self) -> list[Series]:
        e = self.engine
        return [
            Series("hosted_tinker_sample_requests", "sample requests answered", e.requests_done, counter=True),
            Series("hosted_tinker_sampled_tokens", "tokens generated by sampling", e.tokens_generated, counter=True),
            Series("hosted_tinker_sampling_active_sequences", "sequences being generated now", e.active_rows),
            Series("hosted_tinker_sampling_kv_budget_tokens", "KV-cache tokens the built-in sampler's running "
                   "requests may reserve together (max_sampling_kv_tokens)", e.kv_budget_tokens),
            Series("hosted_tinker_sampling_kv_reserved_tokens", "KV-cache tokens reserved now by running sample "
                   "requests (their worst case), never above the budget", e.reserved_kv_tokens),
            Series("hosted_tinker_sampling_kv_peak_reserved_tokens", "the most KV-cache tokens running sample "
                   "requests ever reserved together since start-up", e.peak_reserved_kv_tokens),
            Series("hosted_tinker_sampling_waiting_jobs", "sample jobs queued for the built-in sampler, not yet "
                   "running (waiting for KV-cache budget or their turn) or paused", e.waiting_jobs),
            Series("hosted_tinker_sampling_requests_cancelled", "sample requests dropped unfinished because nobody "
                   "waited for them any more (client gone)", e.requests_cancelled, counter=True),
            Series("hosted_tinker_sampling_requests_preempted", "times a running sample request was paused (its KV "
                   "cache swapped out) for an older one that needed its room", e.requests_preempted, counter=True),
            Series("hosted_tinker_sampler_weight_syncs", "sampler adapter snapshots loaded onto the device (weights "
                   "synced for sampling)", self.snapshots.loads, counter=True),
            Series("hosted_tinker_sampler_snapshots", "sampler adapter snapshots resident on the device",
                   len(self.snapshots)),
        ]

    def wants_round(self) -> bool:
        return self.engine.has_work()

    def run_round(self, *, should_yield: Callable[[], bool], min_seconds: float, max_seconds: float) -> None:
        if not self.engine.has_work():
            return
        try:
            self.engine.run(should_yield, max_seconds, self._resolve, min_seconds=min_seconds)
        except Exception as e:  # the engine confines known failures to their jobs; this is a bug
            log.exception("a sampling round failed; failing every sampling request in flight")
            self.engine.fail_all(f"sampling failed on the server: {type(e).__name__}: {e}")
        # Requests that ended let go of their versions; superseded versions nobody uses go.
        refs = self.engine.requested_adapter_ids()
        self._bound = {ref: aid for ref, aid in self._bound.items() if ref in refs}
        self.snapshots.sweep(keep=self._in_use())

    def _in_use(self) -> set[str]:
        return self.engine.active_adapter_ids() | set(self._bound.values())

    def _resolve(self, job: SampleJob) -> str | None:
        """The adapter id in the layers that `job` samples (loading or copying it there if needed)."""
        ref = job.adapter_id
        if ref is None:
            return None
        if not ref.startswith(CURRENT_PREFIX):
            return self.snapshots.ensure(Path(ref), keep=self._in_use())
        aid = self._bound.get(ref)
        if aid is None:
            model_id = ref[len(CURRENT_PREFIX):].rpartition("@")[0]
            if model_id not in self._versions:
                raise LookupError(f"model {model_id!r} is not loaded any more")
            adapter = self.runtime.adapter(model_id)
            aid = self.snapshots.ensure_weights(current_source(model_id), str(self._versions[model_id]),
                                                adapter.named_tensors(), adapter.config.scaling,
                                                keep=self._in_use())
            self._bound[ref] = aid
        return aid
