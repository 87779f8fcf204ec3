"""`TailRequests`: the requests a cycle runs after its compute and optimizer steps, one by one.

create_model, unload_model, save_weights (with the optimizer state), save_weights_for_sampler
(a path, or a sampling session on that exact snapshot), the external save, and load_weights, in
per-model order. Each is answered, then the sampling backend hears of the model's new weights
(`new_weights`; `removed` after an unload), so that a backend's failure cannot turn a done
request into a failed one.
"""

from __future__ import annotations

import logging
from pathlib import Path

from ..checkpoints.adapter_io import check_fits, load_checkpoint, read_checkpoint_for, save_checkpoint
from ..checkpoints.catalog import CheckpointCatalog, CheckpointExists
from ..checkpoints.encryption import save_encrypted
from ..checkpoints.format import CheckpointError
from ..checkpoints.paths import TinkerPath
from .cycle_plan import Request
from ..errors import UserError
from ..requests.futures import FutureStore
from ..runtime.model_runtime import ModelRuntime
from .request_failures import answer_or_fail
from ..requests.kinds import (
    CreateModelResult, ExternalWeightsResult, LoadSpec, LoadWeightsResult, LoRAConfig, RequestKind,
    SamplerWeightsResult, SaveSpec, SaveWeightsResult, TailResult, UnloadModelResult,
)
from ..runtime.projections import refusal
from ..sampling.backend import SamplingBackend
from ..store.tables import Store

log = logging.getLogger(__name__)

# Tail requests that read a loaded model's adapter (a load_weights may also create one).
NEEDS_ADAPTER = frozenset({RequestKind.SAVE_WEIGHTS, RequestKind.SAVE_WEIGHTS_FOR_SAMPLER,
                           RequestKind.SAVE_WEIGHTS_EXTERNAL})


class TailRequests:
    def __init__(self, runtime: ModelRuntime, futures: FutureStore, store: Store, checkpoints: CheckpointCatalog,
                 sampling: SamplingBackend):
        self.runtime = runtime
        self.futures = futures
        self.store = store
        self.checkpoints = checkpoints
        self.sampling = sampling  # told when a model's weights change

    def run(self, req: Request) -> None:
        """Run and answer one tail request (failing it as the user's or the server's fault)."""
        answer_or_fail(self.futures, req, self._answer)

    def _answer(self, req: Request) -> None:
        if req.kind in NEEDS_ADAPTER and req.model_id not in self.runtime.adapters:
            raise UserError(f"model {req.model_id!r} is not loaded")
        self.futures.resolve(req.request_id, self._run(req).to_wire())
        if req.kind in (RequestKind.CREATE_MODEL, RequestKind.LOAD_WEIGHTS):
            self.new_weights(req.model_id)
        elif req.kind == RequestKind.UNLOAD_MODEL:
            self.removed(req.model_id)
        elif req.kind in NEEDS_ADAPTER:
            spec: SaveSpec = req.payload
            self.new_weights(req.model_id, self.checkpoints.folder(TinkerPath(req.model_id, spec.kind, spec.name)))

    def _run(self, req: Request) -> TailResult:
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

    def new_weights(self, model_id: str, saved_to: Path | None = None) -> None:
        """Tell the sampling backend about a model's new weights, after its request was answered
        (so a backend's failure cannot turn an applied step into a failed request)."""
        try:
            self.sampling.adapter_updated(model_id, saved_to)
        except Exception:
            log.exception("the sampling backend failed to take model %s's new weights", model_id)

    def removed(self, model_id: str) -> None:
        try:
            self.sampling.adapter_removed(model_id)
        except Exception:
            log.exception("the sampling backend failed to let go of model %s", model_id)

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
