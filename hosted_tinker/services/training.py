"""`TrainingRequests`: training models, their compute, optimizer steps and checkpoint saves/loads.

Every work request validates what it can up front (a user's mistake is a 4xx here and never reaches
the model), records a future, hands the request to the `ClockCycleScheduler`, and answers at once
with the request id. A `(model_id, seq_id)` seen before answers with the first request id, so the
SDK's retries are applied once.
"""

from __future__ import annotations

import json
from dataclasses import replace
from functools import partial
from pathlib import Path
from typing import Callable

from .. import faults
from ..accounts.access import Access
from ..checkpoints.format import CheckpointError, read_manifest
from ..checkpoints.paths import TinkerPath
from ..errors import Busy, NotFound, UserError
from ..requests.kinds import (AdamParams, DatumWork, FBWork, FutureRef, LoadSpec, LoRAConfig, Payload, RequestKind,
                             SaveSpec, targets_per_position)
from ..runtime.losses import LOSSES, LossInputError, check_one_targets_shape, resolve_loss_config, validate_data
from ..runtime.projections import refusal
from ..training.cycle_plan import Request
from ..server.core import Server
from ..server.served_models import ServedModel
from ..models.vision import Pixels, no_images, total_pixels
from ..wire.codec import ForwardBackwardCall, WireDatum
from . import checkpoint_base_model, served_model
from .images import ImagePixelBudget
from .provenance import RecordNotFound, loss_inputs, named_sequences


def training_run_id(session_id: str, model_seq_id: int) -> str:
    """The id of a session's `model_seq_id`-th training run (its model id)."""
    return f"{session_id}:train:{model_seq_id}"


def future_ref(request_id: str, model_id: str | None = None) -> dict:
    """What the SDK gets back for queued work: the id to poll with retrieve_future."""
    return FutureRef(request_id, model_id).to_wire()


class TrainingRequests:
    def __init__(self, server: Server, access: Access, images: ImagePixelBudget):
        """`images`: the per-key image pixel budget this service shares with `SamplingRequests`."""
        self.server = server
        self.config = server.config
        self.store = server.store
        self.futures = server.futures
        self.access = access
        self.images = images

    # -- models ---------------------------------------------------------------------------------
    def create_model(self, owner: str, session_id: str, model_seq_id: int, base_model: str, rank: int,
                     seed: int | None, train_mlp: bool, train_attn: bool, train_unembed: bool, optimizer: dict,
                     user_metadata: dict) -> dict:
        self.access.session(owner, session_id)
        served = served_model(self.server, base_model)
        lora = LoRAConfig(rank=rank, seed=seed or 0, train_mlp=train_mlp, train_attn=train_attn,
                          train_unembed=train_unembed)
        if lora.rank > self.config.max_lora_rank:
            raise UserError(f"LoRA rank {lora.rank} is above this server's limit of {self.config.max_lora_rank} "
                            "(max_lora_rank)")
        if not (lora.train_mlp or lora.train_attn or lora.train_unembed):
            raise UserError("at least one of train_mlp, train_attn, train_unembed must be true")
        refused = refusal(served.runtime.projections, lora.roles)  # a projection asked for that cannot be adapted
        if refused:
            raise UserError(refused)
        if optimizer.get("type", "adamw") != "adamw":
            raise UserError(f"optimizer {optimizer.get('type')!r} is not supported; this server trains with adamw")
        return self._create(served, owner, training_run_id(session_id, model_seq_id), session_id, RequestKind.CREATE_MODEL,
                            lora.to_dict(), optimizer, user_metadata, lora)

    def create_from_checkpoint(self, owner: str, session_id: str, model_seq_id: int, base_model: str | None,
                               find_checkpoint: Callable[[], LoadSpec], optimizer: dict, user_metadata: dict) -> dict:
        """create_training_client_from_state: a new model whose first request loads the checkpoint.
        It is a model of the checkpoint's base model (`base_model`, if given, must be that one)."""
        self.access.session(owner, session_id)
        spec = find_checkpoint()
        try:  # the model's record holds the manifest's LoRA config, checked, until the load replaces it
            manifest = read_manifest(spec.checkpoint_dir)
        except CheckpointError as e:
            raise UserError(f"checkpoint {spec.path} cannot be loaded: {e}") from None
        if base_model is not None and base_model != manifest.base_model:
            raise UserError(f"checkpoint {spec.path} was trained on base model {manifest.base_model!r}, "
                            f"not {base_model!r}: a checkpoint loads only into its own base model")
        served = served_model(self.server, manifest.base_model)
        return self._create(served, owner, training_run_id(session_id, model_seq_id), session_id, RequestKind.LOAD_WEIGHTS,
                            manifest.lora_config.config().to_dict(), optimizer, user_metadata, spec)

    def _create(self, served: ServedModel, owner: str, model_id: str, session_id: str, kind: RequestKind, lora: dict,
                optimizer: dict, user_metadata: dict, payload: LoRAConfig | LoadSpec) -> dict:
        row = self.store.runs.get(model_id)
        if row is not None:
            if row.owner != owner:
                raise NotFound(f"session {session_id!r} not found")
            existing = self.store.futures.request_id_of(model_id, 0)  # a retried create: same future
            if existing is not None:
                return future_ref(existing, model_id)
        live = self.store.runs.count_active(owner)
        if live >= self.config.max_training_runs_per_key:
            raise UserError(f"this API key already has {live} live training runs (max_training_runs_per_key = "
                            f"{self.config.max_training_runs_per_key}); unload one before creating another")
        run_row = self.store.runs.creation(model_id, session_id, owner, served.name, lora, optimizer, user_metadata)

        def run_then_fault(c) -> None:
            run_row(c)
            faults.check("create_model.between_rows")

        # The run's row and its first request's future in one transaction: a failure between them
        # would leave a run whose creation no retry can finish (the row there, no future to return).
        request_id, is_new = self.futures.create(owner, kind, model_id, 0, with_write=run_then_fault)
        served.scheduler.open_model(model_id, 0)
        if is_new:
            served.scheduler.submit(Request(request_id, kind, model_id, 0, payload))
        return future_ref(request_id, model_id)

    def info(self, owner: str, model_id: str) -> dict:
        row = self.access.model(owner, model_id)
        lora = json.loads(row.lora_config)
        model = served_model(self.server, row.base_model).runtime.model
        archs = getattr(model.config, "architectures", None) or [type(model).__name__]
        return {
            "type": "get_info",
            "model_id": row.model_id,
            "model_data": {"arch": archs[0], "model_name": row.base_model, "tokenizer_id": row.base_model},
            "model_name": row.base_model,
            "is_lora": True,
            "lora_rank": lora.get("rank"),
            "optimizer_config": json.loads(row.optimizer_config),
        }

    def unload(self, owner: str, model_id: str) -> dict:
        served = self._owner_model(self.access.loaded_model(owner, model_id))
        request_id, _ = self.futures.create(owner, RequestKind.UNLOAD_MODEL, model_id, None)
        served.scheduler.submit_after_queue(Request(request_id, RequestKind.UNLOAD_MODEL, model_id, -1, None))
        return future_ref(request_id, model_id)

    # -- work in a model's seq_id order ---------------------------------------------------------
    def forward_backward(self, owner: str, call: ForwardBackwardCall) -> dict:
        model = self.access.loaded_model(owner, call.model_id)
        if call.seq_id < 1:
            raise UserError(f"seq_id must be >= 1, got {call.seq_id}")
        served = self._owner_model(model)
        runtime, limit = served.runtime, self.config.max_datums_per_request

        def validate() -> FBWork:
            if not call.data:
                raise LossInputError("forward_backward needs at least one datum")
            if len(call.data) > limit:
                raise LossInputError(f"{len(call.data)} datums in one request; this server takes at most {limit} "
                                     "(max_datums_per_request; the SDK splits larger batches itself)")
            config = resolve_loss_config(call.loss_fn, call.loss_fn_config)
            pixels = expand_images(served, call.data)
            self.images.check_size(total_pixels(pixels))
            validate_data([(d.tokens, d.loss_fn_inputs) for d in call.data], call.loss_fn, runtime.vocab_size,
                          runtime.max_context, self.config.max_targets_per_position)
            check_one_targets_shape([targets_per_position(d.loss_fn_inputs) for d in call.data])
            budget = served.scheduler.max_tokens_per_cycle  # a request is split between datums, never inside one
            longest = max(range(len(call.data)), key=lambda i: len(call.data[i].tokens))
            if len(call.data[longest].tokens) > budget:
                raise LossInputError(f"datum {longest} has {len(call.data[longest].tokens)} tokens, more than one clock "
                                     f"cycle's budget of {budget} (max_tokens_per_cycle): a datum is never split "
                                     "across cycles; send shorter sequences or raise the setting")
            records = {}  # a loss that trains on recorded samples finds them by the datums' provenance
            if LOSSES[call.loss_fn].needs_recorded_samples:
                names = set().union(*(named_sequences(d) for d in call.data))
                records = self.server.sample_records.for_training(owner, model.session_id, names)
            try:
                data = [DatumWork(d.tokens, loss_inputs(i, d, call.loss_fn, config, len(call.data), records), p)
                        for i, (d, p) in enumerate(zip(call.data, pixels))]
            except RecordNotFound as e:
                raise NotFound(str(e)) from None
            return FBWork(model_id=call.model_id, data=data, loss_fn=call.loss_fn, loss_config=config,
                          forward_only=call.forward_only)

        kind = RequestKind.FORWARD if call.forward_only else RequestKind.FORWARD_BACKWARD
        return self._submit(owner, served, call.model_id, call.seq_id, kind, validate)

    def optim_step(self, owner: str, model_id: str, seq_id: int, adam: dict | None, other_type: str | None) -> dict:
        """adam: AdamW's parameters; None when the client sent another optimizer (`other_type`)."""
        served = self._owner_model(self.access.loaded_model(owner, model_id))

        def params() -> AdamParams:
            if adam is None:
                raise UserError(f"optimizer params of type {other_type or 'unknown'!r} are not supported; "
                                "send adam_params")
            return AdamParams(**adam)

        return self._submit(owner, served, model_id, seq_id, RequestKind.OPTIM_STEP, params)

    def save(self, owner: str, model_id: str, seq_id: int, kind: str, make_spec: Callable[[], SaveSpec]) -> dict:
        """kind: save_weights | save_weights_for_sampler | save_weights_external."""
        served = self._owner_model(self.access.loaded_model(owner, model_id))
        return self._submit(owner, served, model_id, seq_id, RequestKind(kind), make_spec)

    def ephemeral_sampler_spec(self, owner: str, model_id: str, seq_id: int, sampling_session_seq_id: int,
                               ttl_seconds: int | None) -> SaveSpec:
        """save_weights_and_get_sampling_client: a snapshot of the weights as of this seq_id, served by a
        new sampling session. ("inflight" is served as a snapshot too.)"""
        session_id = self.store.runs.get(model_id).session_id
        return SaveSpec(kind="sampler_weights", name=f"ephemeral-{seq_id}", owner=owner, overwrite=True,
                        ttl_seconds=ttl_seconds or self.config.ephemeral_sampler_ttl_s,
                        sampling_session_id=f"{session_id}:sample:{sampling_session_seq_id}")

    def load(self, owner: str, model_id: str, seq_id: int | None, make_spec: Callable[[], LoadSpec]) -> dict:
        """load_weights into an existing model, in its seq_id order: a checkpoint of its own base model."""
        served = self._owner_model(self.access.loaded_model(owner, model_id))
        if seq_id is None:
            raise UserError("load_weights into an existing model needs seq_id")

        def checked_spec() -> LoadSpec:
            spec = make_spec()
            trained_on = checkpoint_base_model(spec.checkpoint_dir, spec.path)
            if trained_on != served.name:
                raise UserError(f"checkpoint {spec.path} was trained on base model {trained_on!r}; model "
                                f"{model_id!r} is of {served.name!r}: a checkpoint loads only into its own "
                                "base model")
            return spec

        return self._submit(owner, served, model_id, seq_id, RequestKind.LOAD_WEIGHTS, checked_spec)

    def refused(self, owner: str, model_id: str, seq_id: int) -> None:
        """A request of `model_id` at `seq_id` was refused before it was queued (its body, its schema,
        a limit): the seq_id counts as done, so the model's next request runs at once instead of
        waiting out the scheduler's gap timeout. Only the owner's refusals count: another key's
        request naming this model must not close a gap the owner's own request may still fill."""
        row = self.store.runs.get(model_id)
        if row is not None and row.owner == owner and row.base_model in self.server.models.names:
            self._owner_model(row).scheduler.skip(model_id, seq_id)

    def _owner_model(self, row) -> ServedModel:
        """The served model a training model was made on: every request about it goes there."""
        return served_model(self.server, row.base_model)

    def _submit(self, owner: str, served: ServedModel, model_id: str, seq_id: int, kind: RequestKind,
                make_payload: Callable[[], Payload]) -> dict:
        """Idempotent, validated submission of one request of an existing model of `served`."""
        scheduler = served.scheduler
        existing = self.store.futures.request_id_of(model_id, seq_id)
        if existing is not None:
            return future_ref(existing, model_id)
        try:
            payload = make_payload()
        except Exception:  # a refusal (a UserError) or a bug: either way this seq_id is never queued
            scheduler.skip(model_id, seq_id)
            raise
        expected = scheduler.expected_seq(model_id)
        if expected is not None and seq_id < expected:
            raise UserError(f"seq_id {seq_id} of model {model_id!r} is below the next expected seq_id "
                            f"{expected}; each request needs a new seq_id")
        # Unlike a refusal above, Busy leaves the seq_id open: the SDK retries this very seq_id after a 429,
        # and the model's later requests wait for it (a retry of a closed seq_id would be "below the next").
        limit = self.config.max_pending_per_key
        if self.futures.pending(owner) >= limit:
            raise Busy(f"this API key has {limit} unfinished requests (max_pending_per_key); wait for some to finish")
        # A forward_backward's or forward's images are held until the request is answered, and checked
        # only once held: a request refused above decoded none. They are processed before its pass.
        images = payload.images if isinstance(payload, FBWork) else []
        pixels = total_pixels(images)
        self.images.take(owner, pixels)
        try:
            self.images.prepare(owner, served.images, images, served.loop.wake.set)
        except Exception as e:
            self.images.give_back(owner, pixels)
            if not isinstance(e, Busy):  # like a refusal above; a Busy seq_id stays open for the SDK's retry
                scheduler.skip(model_id, seq_id)
            raise
        request_id, is_new = self.futures.create(
            owner, kind, model_id, seq_id, on_finish=partial(self.images.give_back, owner, pixels) if pixels else None)
        if not is_new:  # a concurrent retry of the same seq_id got there first
            self.images.give_back(owner, pixels)
            return future_ref(request_id, model_id)
        if isinstance(payload, FBWork):  # in parts of at most one cycle's budget (scheduler.py)
            (payload, tokens), *more = in_parts(payload, scheduler.max_tokens_per_cycle)
            scheduler.submit(Request(request_id, kind, model_id, seq_id, payload, tokens=tokens, more=more,
                                     owner=owner))
        else:
            scheduler.submit(Request(request_id, kind, model_id, seq_id, payload))
        # No SQLite write here beyond the future's own row: the run's last_request_at is written with
        # the answers of the cycle that runs the request (FutureStore.answering), one commit per cycle.
        return future_ref(request_id, model_id)


def in_parts(work: FBWork, max_tokens: int) -> list[tuple[FBWork, int]]:
    """`work`'s datums as consecutive parts of at most `max_tokens` tokens (a longer datum is a
    part of its own), each with its token count: what one clock cycle runs of a large request."""
    parts: list[tuple[FBWork, int]] = []
    data: list = []
    tokens = 0
    for d in work.data:
        if data and tokens + len(d.tokens) > max_tokens:
            parts.append((replace(work, data=data), tokens))
            data, tokens = [], 0
        data.append(d)
        tokens += len(d.tokens)
    parts.append((replace(work, data=data), tokens))
    return parts


def expand_images(served: ServedModel, data: list[WireDatum]) -> list[Pixels | None]:
    """Each datum's images sized from their headers by the served model's image processor (checked
    once the key's budget holds them, `_submit`, and processed before the request's pass): their
    placeholder tokens put into `datum.tokens` (so every later check sees the model's sequence), the
    images returned. Raises ImageError (a 400) for a text-only model, an image it cannot use, or text
    it would misread: in a request with images, no datum's text may hold the image placeholder (its
    datums share micro-batches)."""
    images = sum(len(d.images) for d in data)
    if not images:
        return [None] * len(data)
    if served.images is None:
        raise no_images(f"datum {next(i for i, d in enumerate(data) if d.images)}", served.name)
    served.images.check_count(images)
    pixels: list[Pixels | None] = []
    for i, d in enumerate(data):
        if not d.images:
            served.images.check_text(f"datum {i}", d.tokens)
            pixels.append(None)
            continue
        d.tokens, p = served.images.expand(f"datum {i}", d.tokens, d.images)
        pixels.append(p)
    return pixels


def checkpoint_to_load(access: Access, owner: str, path: str, with_optimizer: bool, *, max_rank: int,
                       purpose: str = "load") -> LoadSpec:
    """The checkpoint at `path`, to load or to sample (`purpose`, as the audit log records the read), if this
    key may and this server can: its kind, its owner or publication, and its manifest's rank against
    `max_rank` (--max-lora-rank; the worker checks the files themselves again when it loads them)."""
    where = TinkerPath.parse(path)
    if where.kind == "external_weights" or (with_optimizer and where.kind != "weights"):
        need = "a training state saved with save_state (tinker://.../weights/...)"
        raise UserError(f"cannot load {path!r} {'with optimizer' if with_optimizer else ''}: needs {need}")
    folder = Path(access.read(owner, where.run, where.checkpoint_id, purpose).dir)
    try:
        lora = read_manifest(folder).lora_config
    except CheckpointError as e:
        raise UserError(f"checkpoint {path!r} cannot be loaded: {e}") from None
    if lora.rank > max_rank:
        raise UserError(f"checkpoint {path!r} has LoRA rank {lora.rank}, above this server's limit of {max_rank}")
    return LoadSpec(checkpoint_dir=folder, with_optimizer=with_optimizer, path=str(where), max_rank=max_rank)
