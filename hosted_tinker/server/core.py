"""`Server`: builds and owns the components, in the order a request flows through them.

HTTP route (api/) -> FutureStore (futures.py) + ClockCycleScheduler (scheduler.py)
-> DeviceLoop (device_loop.py) -> TrainingWorker (worker.py) -> ModelRuntime (runtime/trainer.py)
and, between training cycles, the sampling backend (sampling/backend.py).

Each served base model (`--base-model`, once per model) gets its own runtime, scheduler, worker,
sampling backend and device loop on its own device (`ServedModel`, served_models.py); the store,
the futures, the checkpoints and the API keys are shared. Routes find a request's model in
`Server.models` by the base model it names or its objects were made on. The sampling backend is
the built-in engine, or with `--vllm` / `--vllm-url` a vLLM sidecar that hands the jobs it
refuses to the built-in engine (sampling/vllm_server_backend.py), chosen by `make_backend`
(sampling/backends.py).
"""

from __future__ import annotations

import functools
import logging
import shutil
import threading
import time
from pathlib import Path
from typing import Callable, Protocol

from ..accounts.auth import ENV_VAR, Authenticator, KeyRing
from ..accounts.accounting import Accounting
from ..accounts.tokens import TokenSigner
from ..accounts.revoked_keys import REVOKED_KEYS_FILE, RevokedKeys
from ..checkpoints.catalog import CheckpointCatalog, ExpirySweeper
from ..checkpoints.paths import TinkerPath
from ..checkpoints.recovery import recover
from ..checkpoints.transfer import UrlSigner
from ..config.settings import ModelEntry, ServerConfig
from ..store.data_dir_lock import DataDirLock
from ..training.device_loop import DeviceLoop
from ..requests.futures import FutureStore
from ..models.image_decodes import ImageDecodes
from ..models.loading import pick_device, resolve_model_source
from ..accounts.rate_card import load_rate_card
from .retention import Retention, RetentionSettings
from ..runtime.cpu_threads import on_passing_thread
from ..sampling.backends import SamplingObserver, make_backend
from ..sampling.jobs import SampleJob, SampleResult
from ..sampling.kv_budget import choose_kv_budget
from ..sampling.records import SampleRecords
from ..sampling.service import SamplingService
from ..training.scheduler import ClockCycleScheduler, CyclePlan
from .served_models import ModelRegistry, ServedModel, make_runtime
from ..store.tables import Store, db_path
from ..store.records import CheckpointRecord
from ..observability.telemetry_log import TelemetryLog
from ..observability.trace_exports import TraceExports
from ..models.vision import ImageLimits, image_encoder
from ..training.worker import TrainingWorker

log = logging.getLogger(__name__)


def eos_token_ids(model, tokenizer) -> set[int]:
    """Every token that ends a generation by default (tokenizer eos + generation_config eos)."""
    ids: set[int] = set()
    for source in (getattr(model, "generation_config", None), model.config, tokenizer):
        value = getattr(source, "eos_token_id", None)
        if isinstance(value, int):
            ids.add(value)
        elif isinstance(value, (list, tuple)):
            ids.update(int(v) for v in value)
    return ids


class Observer(SamplingObserver, Protocol):
    """Watches the device loops (api/metrics.py) and the sampling backends; called on their threads,
    so it must be quick. `base_model`: the served model whose loop it is."""

    def observe_cycle(self, base_model: str, plan: CyclePlan, seconds: float) -> None: ...


class _Unobserved:
    def observe_cycle(self, base_model: str, plan: CyclePlan, seconds: float) -> None:
        pass

    def observe_sample(self, base_model: str, job: SampleJob, generated_tokens: int) -> None:
        pass

    def observe_vllm_request(self, base_model: str, job: SampleJob, result: SampleResult | None,
                             seconds: float) -> None:
        pass


class FanOut:
    """Several observers as one: each hears every observation, and one that raises does not keep it
    from the others (the metrics and the accounting watch the same loops)."""

    def __init__(self, *observers: Observer):
        self.observers = observers

    def _each(self, what: str, observe: Callable[[Observer], None]) -> None:
        for observer in self.observers:
            try:
                observe(observer)
            except Exception:
                log.exception("an observer failed in %s", what)

    def observe_cycle(self, base_model: str, plan: CyclePlan, seconds: float) -> None:
        self._each("observe_cycle", lambda o: o.observe_cycle(base_model, plan, seconds))

    def observe_sample(self, base_model: str, job: SampleJob, generated_tokens: int) -> None:
        self._each("observe_sample", lambda o: o.observe_sample(base_model, job, generated_tokens))

    def observe_vllm_request(self, base_model: str, job: SampleJob, result: SampleResult | None,
                             seconds: float) -> None:
        self._each("observe_vllm_request", lambda o: o.observe_vllm_request(base_model, job, result, seconds))


def serve_model(entry: ModelEntry, config: ServerConfig, futures: FutureStore, store: Store,
                checkpoints: CheckpointCatalog, data_dir: Path, observer: Observer) -> ServedModel:
    """Load one base model onto its device and build the parts that serve it, each given what it needs."""
    name, device = entry.name, pick_device(entry.device)
    # On a passing thread: the start-up compute (model build and load, fusion probe) leaves no
    # OpenMP team behind on this thread to slow every later step (runtime/cpu_threads.py).
    runtime, tokenizer = on_passing_thread(make_runtime, name, device, config, data_dir)
    model = runtime.model  # with a sharded base, what the sampling engine calls (its forwards are mirrored)
    wake = threading.Event()  # the device loop's doorbell, rung by both kinds of producer
    scheduler = ClockCycleScheduler(on_work=wake.set, gap_timeout_s=config.gap_timeout_s,
                                    gather_window_s=config.gather_window_s,
                                    max_tokens_per_cycle=config.max_tokens_per_cycle,
                                    max_models_per_cycle=config.max_live_adapters)
    kv_budget = choose_kv_budget(config.max_sampling_kv_tokens, model, device)  # after the model is loaded
    backend = make_backend(name, config, runtime, tokenizer, device, kv_budget, wake.set, data_dir, observer)
    worker = TrainingWorker(runtime, futures, store, checkpoints, backend)
    return ServedModel(name=name, tokenizer=tokenizer, eos_token_ids=eos_token_ids(model, tokenizer),
                       runtime=runtime, scheduler=scheduler, worker=worker, sampling_backend=backend,
                       sampler=SamplingService(backend, futures),
                       loop=DeviceLoop(scheduler, worker, backend, futures, wake,
                                       on_cycle=functools.partial(observer.observe_cycle, name)),
                       kv_budget=kv_budget,
                       images=image_encoder(model, resolve_model_source(name, data_dir), tokenizer, ImageLimits(
                           config.max_image_bytes, config.max_image_pixels, config.max_images_per_request)))


class Server:
    def __init__(self, config: ServerConfig, observer: Observer | None = None):
        self.config = config
        self.started_at = time.time()
        data_dir = Path(config.data_dir)
        # Before anything reads or repairs the store: a second server on this dir stops here.
        self.data_dir_lock = DataDirLock(data_dir)
        self.keyring = KeyRing.load(config.api_keys_file)
        if self.keyring.dev_mode:
            log.warning("=" * 78)
            log.warning("DEV MODE: no API keys configured, so ANY key starting with 'tml-' is accepted.")
            log.warning("Set %s or --api-keys-file before exposing this server to anyone.", ENV_VAR)
            log.warning("=" * 78)
        else:
            log.info("%d API key(s) configured", len(self.keyring))
        self.auth = Authenticator(self.keyring, TokenSigner(data_dir, config.jwt_lifetime_s),
                                  RevokedKeys(data_dir / REVOKED_KEYS_FILE))
        self.store = Store(db_path(data_dir), config.max_query_s)
        interrupted = self.store.futures.fail_interrupted(
            "the server restarted while this request was running; resubmit it")
        if interrupted:
            log.warning("%d request(s) were running when the server last stopped; they failed with "
                        "category 'server'", interrupted)
        self.store.runs.mark_unloaded()
        self.futures = FutureStore(self.store)
        self.sample_records = SampleRecords(self.store, ttl_s=config.sample_record_ttl_s)
        # Checkpoints of every served model: one catalog, one expiry sweep, one URL signing key.
        self.checkpoints = CheckpointCatalog(self.store, data_dir / "checkpoints")
        self.expiry = ExpirySweeper(self.checkpoints, on_removed=self._expired)
        self.url_signer = UrlSigner(data_dir / "url_signing.key")
        self.uploads = data_dir / "uploads"  # imports being received
        self.telemetry = TelemetryLog(data_dir / "telemetry.jsonl", config.telemetry_max_bytes)
        # Usage, the audit log and request timings; it watches the device loops beside the metrics.
        self.accounting = Accounting(self.store, self.futures)
        self.traces = TraceExports(self.accounting.tables, data_dir / "traces")
        # Every served model's requests' images are decoded on these threads, within one bound.
        self.image_decodes = ImageDecodes(config.max_image_decodes, config.max_image_decodes_per_key)
        self.retention = Retention(self.store.db, self.futures, data_dir, RetentionSettings.of(config),
                                   remove_snapshot=self._remove_snapshot)
        self.rate_card = load_rate_card(config.rate_card, [entry.name for entry in config.served_models])
        observer = FanOut(observer or _Unobserved(), self.accounting)
        self.models = ModelRegistry([serve_model(entry, config, self.futures, self.store, self.checkpoints, data_dir,
                                                 observer) for entry in config.served_models])

    def start(self) -> None:
        recover(self.checkpoints)  # checkpoint records and folders agree again, before any work runs
        shutil.rmtree(self.uploads, ignore_errors=True)  # imports cut short by the last stop
        for model in self.models:
            model.loop.start()
        self.expiry.start()
        self.accounting.start()

    def audit_checkpoint(self, event: str, actor: str, row: CheckpointRecord, **details) -> None:
        """An audit log entry about checkpoint `row` (audit_log.AUDIT_EVENTS names the events)."""
        self.accounting.audit(event, actor, tinker_path=str(TinkerPath.of_record(row.model_id, row.checkpoint_id)),
                              model_id=row.model_id, owner=row.owner, **details)

    def audit_read(self, owner: str, row: CheckpointRecord, purpose: str) -> None:
        self.audit_checkpoint("checkpoint_read", owner, row, purpose=purpose)

    def _expired(self, row: CheckpointRecord) -> None:
        self.audit_checkpoint("checkpoint_delete", "", row, reason="expired")

    def _remove_snapshot(self, row: CheckpointRecord) -> bool:
        """A sampler snapshot over --sampler-snapshot-retention-bytes goes as an expired checkpoint does."""
        if not self.checkpoints.delete(row):
            return False
        log.info("sampler snapshot %s removed: snapshots held more than --sampler-snapshot-retention-bytes",
                 TinkerPath.of_record(row.model_id, row.checkpoint_id))
        self.audit_checkpoint("checkpoint_delete", "", row, reason="snapshot retention")
        return True

    def cycles_started(self) -> dict[str, int]:
        """Each served model's clock cycles started so far (what `Accounting.settle` waits for)."""
        return {served.name: served.scheduler.cycles for served in self.models}

    def stop(self) -> None:
        log.info("shutting down: finishing the running cycle")
        self.expiry.stop()
        for model in self.models:
            model.loop.stop()
            model.runtime.close()
        self.image_decodes.close()
        self.accounting.stop()  # after the loops: their last cycles are counted
        self.traces.close()
        self.store.close()
        self.telemetry.close()
        self.data_dir_lock.release()
