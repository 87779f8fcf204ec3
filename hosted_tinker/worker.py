"""`TrainingWorker`: executes one clock cycle against the model runtime and answers its futures.

The scheduler decides *what* runs together; this module runs it: one fused forward/backward
over every model's compute requests, then each ready optimizer step (both launched, then read
after the cycle's one wait for the device), then checkpoint saves and loads, in per-model
order. A request that cannot be done fails with category "user" only when validation code
said so (`UserError`, `CheckpointError`); anything else is the server's fault. An exception
that escapes a cycle is the device loop's to answer (device_loop.py).

A request's failure is its own: a fused pass that raises is rerun in halves until the request
that made it raise fails alone, the others getting their own results (isolation.py); a request
that fails leaves no gradient, in one part or many (request_parts.py).
"""

from __future__ import annotations

import logging
import math
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from . import faults
from .checkpoints.catalog import CheckpointCatalog, CheckpointExists
from .checkpoints.encryption import save_encrypted
from .checkpoints.adapter_io import check_fits, load_checkpoint, read_checkpoint_for, save_checkpoint
from .checkpoints.format import CheckpointError
from .checkpoints.paths import TinkerPath
from .errors import UserError
from .futures import FutureStore
from .model_runtime import ModelRuntime
from .request_types import (
    CreateModelResult, ExternalWeightsResult, FBOutcome, FBWork, LoadSpec, LoadWeightsResult, LoRAConfig,
    OptimStepResult, RequestKind, SamplerWeightsResult, SaveSpec, SaveWeightsResult, TailResult, UnloadModelResult,
)
from .isolation import MachineFault, Quarantine, run_isolating
from .request_parts import LaunchedGradients, PartsLedger
from .runtime.adamw import PendingSteps
from .runtime.adapters import GradientSnapshot, SkippedStep
from .runtime.pass_io import PassStats, PendingPass, ReadyPass
from .runtime.projections import refusal
from .sampling.backend import SamplingBackend
from .cycle_plan import CyclePlan, Request
from .store import Store

log = logging.getLogger(__name__)

# One request's share of a launched pass: the pass, and the request's index in it (its outcome is
# read after the cycle's wait).
LaunchedOutcome = tuple[PendingPass | ReadyPass, int]

# Tail requests that read a loaded model's adapter (a load_weights may also create one).
NEEDS_ADAPTER = frozenset({RequestKind.SAVE_WEIGHTS, RequestKind.SAVE_WEIGHTS_FOR_SAMPLER,
                           RequestKind.SAVE_WEIGHTS_EXTERNAL})


class TrainingWorker:
    def __init__(self, runtime: ModelRuntime, futures: FutureStore, store: Store, checkpoints: CheckpointCatalog,
                 sampling: SamplingBackend):
        self.runtime = runtime
        self.futures = futures
        self.store = store
        self.checkpoints = checkpoints
        self.sampling = sampling  # told when a model's weights change
        self.parts = PartsLedger()  # requests in parts: their outcomes so far, their gradients before
        self.launched = LaunchedGradients()  # the cycle's other forward_backwards, until answered
        self.quarantine = Quarantine()  # keys whose request failed a pass alone: their requests run apart
        # metrics
        self.tokens_total = 0
        self.last_cycle_tokens = 0
        self.last_cycle_models = 0
        self.fused_passes = 0  # passes that carried more than one model
        self.failed_passes = 0  # passes that raised (each rerun in halves: isolation.py)
        self.isolation_reruns = 0  # the passes run to find which request failed a pass

    def run_cycle(self, plan: CyclePlan, on_compute_answered: Callable[[set[str]], None],
                  join_optim: Callable[[], None] = lambda: None) -> None:
        """Run the plan, answering each request as it completes. The passes and the optimizer
        steps are launched, then the cycle waits for the device once and reads them all (on a GPU
        the cycle's one host sync). `join_optim` runs once the passes are launched: it may add
        optim_steps that arrived meanwhile to `plan.optim`. `on_compute_answered` hears which
        models' compute results are handed out, just before the first of them is (a request that
        a client posts once it has seen its result then always finds the scheduler told: it is
        never taken for a pipelining client's)."""
        self._settle()  # requests that failed since the last cycle (a cycle that raised)
        passes: list[tuple[Request, LaunchedOutcome]] = []
        if plan.compute:
            models = {r.model_id for r in plan.compute}

            def answering() -> None:
                join_optim()
                on_compute_answered(models)

            passes = self._launch_compute(plan.compute, answering=answering)
        steps = self._launch_optim_steps(plan.optim) if plan.optim else None
        self.runtime.wait()
        with self.futures.answering(touched_models=plan.models):  # one SQLite transaction for them all
            self._answer_compute(passes)
            if steps is not None:
                self._answer_optim_steps(*steps)
        for req in plan.tail:
            self._guarded(req, self._tail_step)
        for req in plan.orphaned:
            self.futures.fail(req.request_id, f"{req.kind}: model {req.model_id!r} is not loaded (it was unloaded)",
                              "user")
        self._settle()  # e.g. a request in parts orphaned by its model's unload

    def _tail_step(self, req: Request) -> None:
        if req.kind in NEEDS_ADAPTER and req.model_id not in self.runtime.adapters:
            raise UserError(f"model {req.model_id!r} is not loaded")
        self.futures.resolve(req.request_id, self._run_tail(req).to_wire())
        if req.kind in (RequestKind.CREATE_MODEL, RequestKind.LOAD_WEIGHTS):
            self._announce(req.model_id)
        elif req.kind == RequestKind.UNLOAD_MODEL:
            self._announce_removal(req.model_id)
        elif req.kind in NEEDS_ADAPTER:
            spec: SaveSpec = req.payload
            self._announce(req.model_id, self.checkpoints.folder(TinkerPath(req.model_id, spec.kind, spec.name)))

    def _run_tail(self, req: Request) -> TailResult:
        match req.kind:
            case RequestKind.CREATE_MODEL:
                return self._create_model(req)
            case RequestKind.UNLOAD_MODEL:
                return self._unload_model(req)
            case RequestKind.SAVE_WEIGHTS:
                return SaveWeightsResult(str(self._save(req, with_optimizer=True)[0]))
            case RequestKind.SAVE_WEIGHTS_FOR_SAMPLER:
                return self._save_weights_for_sampler(req)
            case RequestKind.SAVE_WEIGHTS_EXTERNAL:
                path, size = self._save(req, with_optimizer=False)
                return ExternalWeightsResult(size_bytes=size, path=str(path))
            case RequestKind.LOAD_WEIGHTS:
                return self._load_weights(req)
        raise ValueError(f"{req.kind} is not a request the worker runs after the compute")

    def _announce(self, model_id: str, saved_to: Path | None = None) -> None:
        """Tell the sampling backend about a model's new weights, after its request was answered
        (so a backend's failure cannot turn an applied step into a failed request)."""
        try:
            self.sampling.adapter_updated(model_id, saved_to)
        except Exception:
            log.exception("the sampling backend failed to take model %s's new weights", model_id)

    def _announce_removal(self, model_id: str) -> None:
        try:
            self.sampling.adapter_removed(model_id)
        except Exception:
            log.exception("the sampling backend failed to let go of model %s", model_id)

    def _guarded(self, req: Request, fn) -> None:
        try:
            fn(req)
        except (UserError, CheckpointError) as e:  # raised by validation code: the request asked for the impossible
            self.futures.fail(req.request_id, f"{req.kind}: {e}", "user")
        except Exception as e:  # a bug or a device fault, whatever its class: retry or report it
            log.exception("%s of model %s failed", req.kind, req.model_id)
            self.futures.fail(req.request_id, f"{req.kind} failed on the server: {type(e).__name__}: {e}", "server")

    # -- compute ---------------------------------------------------------------------------------
    def _loaded(self, reqs: list[Request], prefix: str = "") -> list[Request]:
        """The requests whose model is loaded; the others fail (unloaded since they were queued)."""
        loaded = []
        for r in reqs:
            if r.model_id in self.runtime.adapters:
                loaded.append(r)
            else:
                self.futures.fail(r.request_id, f"{prefix}model {r.model_id!r} is not loaded", "user")
        return loaded

    def _launch_compute(self, reqs: list[Request], answering: Callable[[], None]
                        ) -> list[tuple[Request, LaunchedOutcome]]:
        """The cycle's passes launched (`_passes`); `answering()` runs once they are, before any
        answer. A request that failed its pass is answered here, and a failed request in parts has
        its model's gradients put back as they were before its first part, before the cycle's
        optimizer steps are launched. The others' outcomes are read after the wait (`_answer_compute`)."""
        live = [r for r in self._loaded([r for r in reqs if self.futures.is_pending(r.request_id)])
                if not self._images_failed(r)]
        if not live:
            answering()
            return []
        for r in live:
            if r.first_part:
                before = None if r.payload.forward_only else GradientSnapshot(self.runtime.adapter(r.model_id))
                self.parts.begin(r.request_id, before)
        self.last_cycle_tokens = self.last_cycle_models = 0
        results = self._passes(live)
        for r, out in zip(live, results):  # until answered: a failure from here on takes its gradients back
            if not (isinstance(out, Failed) or r.in_parts or r.payload.forward_only):
                self.launched.launched(r.request_id, r.payload, out[0].before)
        faults.check("after_forward_backward")
        faults.check_poisoned("cycle.poisoned_after_passes", (d.tokens for r in live for d in r.payload.data))
        answering()
        launched = []
        for r, out in zip(live, results):
            if isinstance(out, Failed):
                self._fail_compute(r, out)
            else:
                launched.append((r, out))
        self._settle()
        return launched

    def _answer_compute(self, launched: list[tuple[Request, LaunchedOutcome]]) -> None:
        """Each launched request's outcome, read after the cycle's wait: a part of a request in
        parts (`final=False`) adds its outcome to the request's earlier parts' (`PartsLedger`),
        and the last part answers. A part whose request already failed is dropped."""
        read: dict[int, list[FBOutcome]] = {}  # per launched pass (by id), its outcomes
        finished: list[tuple[Request, FBOutcome]] = []
        for r, (pending, j) in launched:
            if id(pending) not in read:
                read[id(pending)] = pending.outcomes()
                self._count(pending.stats)
            out = read[id(pending)][j]
            if r.in_parts:
                out = self.parts.add(r.request_id, out, last=r.final)
            if r.final:
                finished.append((r, out))
        # The dashboard's loss curves; written before the results are visible, so it never lags a client.
        self.store.losses.record([
            (r.model_id, r.seq_id, self.runtime.adapters[r.model_id].step, r.payload.forward_only, out.metrics["loss:sum"])
            for r, out in finished if math.isfinite(out.metrics.get("loss:sum", math.nan))])
        for r, out in finished:
            self._guarded(r, lambda req: self._resolve_compute(req, out))
        self._settle()

    def _resolve_compute(self, req: Request, out: FBOutcome) -> None:
        faults.check_poisoned("answer.poisoned", (d.tokens for d in req.payload.data))
        self.futures.resolve(req.request_id, out.to_wire(), is_proto=True)

    def _settle(self) -> None:
        """Put back the gradients of the requests that failed after their pass (request_parts.py)."""
        self.parts.settle(self._failed)
        self.launched.settle(self._failed, self.runtime.adapters.get, self._rerun)

    def _failed(self, request_id: str) -> bool | None:
        """None while the request is pending; then whether it failed."""
        if self.futures.is_pending(request_id):
            return None
        result = self.futures.lookup(request_id)
        return result is None or result.failed

    def _rerun(self, works: list[FBWork]) -> None:
        """A model's requests of a pass run again, their outputs unread: only their gradients count."""
        try:
            self.runtime.launch_forward_backward(works)
            self.runtime.wait()
        except Exception:  # they ran a moment ago: the device is failing
            log.exception("model %s: its answered requests could not run again after another of its pass failed; "
                          "its next optim_step lacks their gradients", works[0].model_id)

    def _passes(self, reqs: list[Request]) -> list[LaunchedOutcome | Failed]:
        """Each request's launched outcome, or the error it failed with alone: one fused pass of
        the trusted keys' requests, then one per quarantined key, each launched again in parts
        where launching raises until the request that made it raise is found (isolation.py)."""
        batches: dict[str | None, list[int]] = {}
        for i, r in enumerate(reqs):
            batches.setdefault(_key(r) if _key(r) in self.quarantine else None, []).append(i)
        results: list[LaunchedOutcome | Failed] = [None] * len(reqs)  # type: ignore[list-item]
        for key, idx in batches.items():
            report = run_isolating(self._launch_pass, [reqs[i].payload for i in idx],
                                   [reqs[i].model_id for i in idx])
            self.failed_passes += report.failed_passes
            self.isolation_reruns += report.reruns
            for j, i in enumerate(idx):
                error = report.errors[j]
                results[i] = report.outcomes[j] if error is None else Failed(error, report.reruns > 0)
            for j in report.culprits:
                self.quarantine.convict(_key(reqs[idx[j]]))
            if key is not None and not report.failed_passes:
                self.quarantine.passed(key)
        return results

    def _launch_pass(self, works: list[FBWork]) -> list[LaunchedOutcome]:
        pending = self.runtime.launch_forward_backward(works)
        return [(pending, j) for j in range(len(works))]

    def _count(self, stats: PassStats) -> None:
        self.tokens_total += stats.tokens
        self.last_cycle_tokens += stats.tokens
        self.last_cycle_models += stats.models
        self.fused_passes += stats.models > 1

    def _images_failed(self, req: Request) -> bool:
        """Whether the request's images could not be processed (image_decodes.py, before its cycle was
        planned): it fails before the pass, which it would fail."""
        error = next((p.error for p in req.payload.images if p.error is not None), None)
        if error is not None:
            self._fail_compute(req, Failed(error, others_rerun=False))
        return error is not None

    def _fail_compute(self, req: Request, failure: Failed) -> None:
        """A request that failed a pass of its own (or a pass the machine failed): its own failure."""
        error = failure.error
        user = isinstance(error, (UserError, CheckpointError))
        if not user:
            log.error("%s of model %s failed: %s: %s", req.kind, req.model_id, type(error).__name__, error,
                      exc_info=error)
        alone = ("; it failed in a pass of its own: the requests of its cycle ran again without it"
                 if failure.others_rerun and not isinstance(error, MachineFault) else "")
        self.futures.fail(req.request_id, f"{req.kind} failed{'' if user else ' on the server'}: "
                                          f"{type(error).__name__}: {error}{alone}", "user" if user else "server")

    def _launch_optim_steps(self, reqs: list[Request]) -> tuple[list[Request], PendingSteps] | None:
        """All of the cycle's optimizer steps launched as one multi-adapter AdamW step (read after
        the cycle's wait: `_answer_optim_steps`)."""
        ready = self._loaded(reqs, prefix="optim_step: ")
        if not ready:
            return None
        self.launched.stepped(r.model_id for r in ready)
        try:
            # A model appears at most once per cycle (its optim_step is its barrier).
            return ready, self.runtime.launch_optim_steps([(r.model_id, r.payload) for r in ready])
        except Exception as e:
            self._fail_optim_steps(ready, e)
            return None

    def _answer_optim_steps(self, ready: list[Request], pending: PendingSteps) -> None:
        try:
            results = pending.results()
        except Exception as e:
            self._fail_optim_steps(ready, e)
            return
        for r, result in zip(ready, results):
            self._guarded(r, lambda req: self._answer_optim_step(req, result))
        for r, result in zip(ready, results):
            if not isinstance(result, SkippedStep):
                self._announce(r.model_id)

    def _fail_optim_steps(self, ready: list[Request], e: Exception) -> None:
        log.exception("optimizer step over %d models failed", len(ready), exc_info=e)
        for r in ready:
            self.futures.fail(r.request_id, f"optim_step failed on the server: {type(e).__name__}: {e}", "server")

    def _answer_optim_step(self, req: Request, result: dict[str, float] | SkippedStep) -> None:
        if isinstance(result, SkippedStep):
            raise UserError(result.reason)
        self.futures.resolve(req.request_id, OptimStepResult(result).to_wire())

    # -- lifecycle and checkpoints ---------------------------------------------------------------
    def _create_model(self, req: Request) -> CreateModelResult:
        config: LoRAConfig = req.payload
        refused = refusal(self.runtime.projections, config.roles)
        if refused:
            raise UserError(refused)
        if not any(config.adapts(path, layer) for path, layer in self.runtime.layers.items()):
            raise UserError("the LoRA config adapts no projection of this model")
        self.runtime.create_adapter(req.model_id, config)
        return CreateModelResult(req.model_id)

    def _unload_model(self, req: Request) -> UnloadModelResult:
        self.runtime.remove_adapter(req.model_id)
        self.store.runs.set_status(req.model_id, "unloaded")
        return UnloadModelResult(req.model_id)

    def _save_weights_for_sampler(self, req: Request) -> SamplerWeightsResult:
        spec: SaveSpec = req.payload
        path, _ = self._save(req, with_optimizer=False)
        if spec.sampling_session_id is None:
            return SamplerWeightsResult(path=str(path))
        # The ephemeral form: a sampling session on this exact snapshot of the weights.
        model = self.store.runs.get(req.model_id)
        self.store.sampling_sessions.create(spec.sampling_session_id, model.session_id, spec.owner,
                                            model.base_model, str(path), str(self.checkpoints.folder(path)))
        return SamplerWeightsResult(sampling_session_id=spec.sampling_session_id)

    def _save(self, req: Request, *, with_optimizer: bool) -> tuple[TinkerPath, int]:
        """Write the model's checkpoint and its record together; (its path, its size in bytes)."""
        spec: SaveSpec = req.payload
        path = TinkerPath(req.model_id, spec.kind, spec.name)

        def write_plain(folder: Path) -> None:
            save_checkpoint(self.runtime, req.model_id, folder, with_optimizer=with_optimizer, overwrite=True)

        def write(folder: Path) -> None:
            if spec.age_recipients:
                save_encrypted(folder, write_plain, spec.age_recipients)
            else:
                write_plain(folder)

        try:
            size = self.checkpoints.save(
                path, spec.owner, write, overwrite=spec.overwrite, ttl_seconds=spec.ttl_seconds, user_metadata=spec.user_metadata)
        except CheckpointExists as e:
            raise CheckpointError(f"{e}; save with overwrite=True to replace it") from None
        return path, size

    def _load_weights(self, req: Request) -> LoadWeightsResult:
        spec: LoadSpec = req.payload
        ckpt = read_checkpoint_for(self.runtime, spec.checkpoint_dir, with_optimizer=spec.with_optimizer)
        check_fits(ckpt, self.runtime.layers, max_rank=spec.max_rank)  # the files as read now, whatever the route saw
        adapter = load_checkpoint(self.runtime, req.model_id, ckpt)
        self.store.runs.update_lora(req.model_id, adapter.config.to_dict())
        return LoadWeightsResult(path=spec.path, model_id=req.model_id)




@dataclass
class Failed:
    """A compute request's failure: its error, and whether the others of its pass were rerun without it."""

    error: BaseException
    others_rerun: bool


def _key(req: Request) -> str:
    """Whose request it is, for the quarantine: its API key's owner (its model where none is known)."""
    return req.owner or req.model_id
