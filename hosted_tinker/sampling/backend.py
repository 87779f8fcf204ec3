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
"""

from __future__ import annotations

import logging
from abc import ABC, abstractmethod
from collections.abc import Callable
from pathlib import Path

from .engine import SampleJob, SamplingEngine
from .snapshots import SnapshotCache

log = logging.getLogger(__name__)


class SamplingBackend(ABC):
    @abstractmethod
    def submit(self, job: SampleJob) -> None:
        """Queue a job (any thread)."""

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

    def adapter_removed(self, model_id: str) -> None:
        """`model_id` was unloaded (device loop thread): what the backend holds of it can go."""

    def current_weights_ref(self, model_id: str) -> str | None:
        """The `SampleJob.adapter_id` that samples training model `model_id`'s current weights, or
        None when this backend samples saved checkpoints only (then a request naming the model
        gets its latest sampler checkpoint)."""
        return None

    def session_opened(self, adapter_dir: str) -> None:
        """A sampling session now samples the checkpoint in `adapter_dir` (any thread; must be quick)."""

    @abstractmethod
    def shutdown(self) -> None:
        """Stop; every job not finished gets `on_error`. Called once, after the device loop stopped."""

    # -- for backends that share the device loop's accelerator; others keep these defaults ---------
    def wants_round(self) -> bool:
        """Whether the device loop should give this backend a round now."""
        return False

    def run_round(self, *, should_yield: Callable[[], bool], min_seconds: float, max_seconds: float) -> None:
        """Use the device for at most `max_seconds`; after `min_seconds`, return as soon as
        `should_yield()` (training is waiting). Called on the device loop's thread only."""
        raise NotImplementedError(f"{type(self).__name__} samples on its own; it takes no device rounds")


class EngineBackend(SamplingBackend):
    """The built-in `SamplingEngine`, on the device loop's thread and the training model's layers."""

    def __init__(self, engine: SamplingEngine, snapshots: SnapshotCache, wake: Callable[[], None]):
        self.engine = engine
        self.snapshots = snapshots
        self._wake = wake

    def submit(self, job: SampleJob) -> None:
        self.engine.submit(job)
        self._wake()

    def cancel(self, job: SampleJob) -> None:
        job.cancelled = True  # the engine drops it at admission or before its next decode step
        self._wake()

    def adapter_updated(self, model_id: str, saved_to: Path | None = None) -> None:
        # The engine samples frozen snapshots only, never a training model's live weights, so
        # an optim_step or load changes nothing here.
        # TODO(coordinator, issue 10 "re-saved sampler"): a save to a directory that is already
        # loaded as a snapshot should retire that snapshot (SnapshotCache keys by directory,
        # sampling/snapshots.py, owned by "core"); call that here once it exists.
        return None

    def shutdown(self) -> None:
        self.engine.fail_all("the server is shutting down; resubmit this request")

    def wants_round(self) -> bool:
        return self.engine.has_work()

    def run_round(self, *, should_yield: Callable[[], bool], min_seconds: float, max_seconds: float) -> None:
        if not self.engine.has_work():
            return
        active = self.engine.active_adapter_ids()

        def resolve(job: SampleJob) -> str | None:
            if job.adapter_id is None:
                return None
            return self.snapshots.ensure(Path(job.adapter_id), keep=active)

        try:
            self.engine.run(should_yield, max_seconds, resolve, min_seconds=min_seconds)
        except Exception as e:  # the engine confines known failures to their jobs; this is a bug
            log.exception("a sampling round failed; failing every sampling request in flight")
            self.engine.fail_all(f"sampling failed on the server: {type(e).__name__}: {e}")
