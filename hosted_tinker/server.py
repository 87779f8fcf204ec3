"""`Server`: builds and owns the components, in the order a request flows through them.

HTTP route (api/) -> FutureStore (futures.py) + ClockCycleScheduler (scheduler.py)
-> TrainingWorker (worker.py) -> TrainingRuntime (runtime/trainer.py) -> MultiLoRALinear.
"""

from __future__ import annotations

import logging
import shutil
import time
from pathlib import Path

from .auth import ENV_VAR, KeyRing
from .checkpoints.catalog import CheckpointCatalog, ExpirySweeper
from .checkpoints.recovery import recover
from .checkpoints.transfer import UrlSigner
from .config import ServerConfig
from .futures import FutureStore
from .model_loading import load_base_model, pick_device, pick_dtype
from .runtime.trainer import TrainingRuntime
from .sampling.engine import SamplingEngine
from .sampling.records import SampleRecords
from .sampling.service import SamplingService
from .sampling.snapshots import SnapshotCache
from .scheduler import ClockCycleScheduler
from .store import Store, db_path
from .worker import TrainingWorker

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


class Server:
    def __init__(self, config: ServerConfig):
        self.config = config
        self.started_at = time.time()
        self.keyring = KeyRing.load(config.api_keys_file)
        if self.keyring.dev_mode:
            log.warning("=" * 78)
            log.warning("DEV MODE: no API keys configured, so ANY key starting with 'tml-' is accepted.")
            log.warning("Set %s or --api-keys-file before exposing this server to anyone.", ENV_VAR)
            log.warning("=" * 78)
        else:
            log.info("%d API key(s) configured", len(self.keyring))
        data_dir = Path(config.data_dir)
        data_dir.mkdir(parents=True, exist_ok=True)
        self.store = Store(db_path(data_dir))
        interrupted = self.store.fail_interrupted_futures(
            "the server restarted while this request was running; resubmit it")
        if interrupted:
            log.warning("%d request(s) were running when the server last stopped; they failed with "
                        "category 'server'", interrupted)
        self.store.mark_models_unloaded()
        self.futures = FutureStore(self.store)
        self.sample_records = SampleRecords(self.store, ttl_s=config.sample_record_ttl_s)
        device = pick_device(config.device)
        model, self.tokenizer = load_base_model(config.base_model, data_dir, device,
                                                pick_dtype(config.dtype, device))
        self.runtime = TrainingRuntime(model, config.base_model, device=device,
                                       max_tokens_per_micro_batch=config.max_tokens_per_micro_batch,
                                       max_live_adapters=config.max_live_adapters)
        self.eos_token_ids = eos_token_ids(model, self.tokenizer)
        engine = SamplingEngine(model, self.runtime.routing, self.tokenizer, device)
        self.snapshots = SnapshotCache(self.runtime.layers, device, capacity=config.max_sampler_snapshots)
        self.sampler = SamplingService(engine, self.snapshots, self.futures,
                                       wake=lambda: self.scheduler.wake(),
                                       training_waiting=lambda: self.scheduler.has_training_work(),
                                       last_cycle_seconds=lambda: self.scheduler.last_cycle_seconds)
        self.checkpoints = CheckpointCatalog(self.store, data_dir / "checkpoints")
        self.expiry = ExpirySweeper(self.checkpoints)
        self.url_signer = UrlSigner(data_dir / "url_signing.key")
        self.uploads = data_dir / "uploads"  # imports being received
        self.worker = TrainingWorker(self.runtime, self.futures, self.store, self.checkpoints, self.sampler)
        self.scheduler = ClockCycleScheduler(self.worker.run_cycle, gap_timeout_s=config.gap_timeout_s,
                                             side_work=self.sampler.has_work,
                                             gather_window_s=config.gather_window_s,
                                             max_tokens_per_cycle=config.max_tokens_per_cycle,
                                             max_models_per_cycle=config.max_live_adapters)
        self.worker.on_compute_done = self.scheduler.compute_done

    def start(self) -> None:
        recover(self.checkpoints)  # checkpoint records and folders agree again, before any work runs
        shutil.rmtree(self.uploads, ignore_errors=True)  # imports cut short by the last stop
        self.scheduler.start()
        self.expiry.start()

    def stop(self) -> None:
        log.info("shutting down: finishing the running cycle")
        self.expiry.stop()
        self.scheduler.stop()
        self.store.close()
