"""`Accounting`: the `Server`'s observer that counts usage, audit entries and request timings as the server
runs, and the hooks that feed them. Each count has one home:

- `usage_meter.py`: training, prefill, sampled and cached tokens, checkpoints saved, storage GB-hours;
- `audit_log.py`: the audit log's entries (`AUDIT_EVENTS`);
- `request_timings.py`: each session request's timings, for session traces;
- `accounting_writer.py`: all three written in batches, by its own thread and after each cycle.

Where each count comes from, each hook in one place (here):

- training tokens, checkpoints saved and their `checkpoint_create` entries, and the training requests'
  timings: the device loop's cycle observer (`observe_cycle`, beside the metrics'), from the plan it ran
  and each request's answer in the `FutureStore` (a request that failed is not charged; a part of a split
  request is charged when it ran);
- prefill and sampled tokens and the sample requests' timings: `count_sample`, which the sampling service
  wraps around a job's `on_done` and `on_error` before the job is queued, so a sample is counted once,
  before its answer exists, whichever backend ran it; one cut short (its client left, or it failed) is
  charged what was computed of it until it stopped;
- the other audit entries (reads, publish, TTL, copies, deletes, project moves): `audit`, called by the
  services;
- storage GB-hours: accrued from the live checkpoints every `STORAGE_TICK_S` and before a report.

A report first `settle`s: it waits until every clock cycle started so far has been observed (a request a
client saw answered is in one), then flushes, so it shows everything answered before it.
"""

from __future__ import annotations

import logging
import threading
import time

from .accounting_writer import AccountingWriter
from .audit_log import AuditLog
from ..checkpoints.paths import TinkerPath
from ..training.cycle_plan import CyclePlan, Request
from ..requests.futures import FutureStore
from .request_timings import CycleSpan, RequestTimings
from ..requests.kinds import SaveSpec
from ..sampling.jobs import SampleJob, SampleResult
from ..store.tables import Store
from ..store.accounting import AccountingTables
from .usage_meter import SAVES, Payer, UsageMeter

log = logging.getLogger(__name__)

SETTLE_WAIT_S = 60.0  # hang guard: a report waits this long at most for a running cycle's observation
MAX_REMEMBERED = 65536  # a bound on the payers remembered (runs, sampling sessions), not a cache policy


class Accounting:
    def __init__(self, store: Store, futures: FutureStore):
        self.store = store
        self.futures = futures
        self.tables = AccountingTables(store.db)
        self.usage = UsageMeter(store)
        self.audit_log = AuditLog()
        self.timings = RequestTimings()
        self.writer = AccountingWriter(self.tables, self.usage, self.audit_log, self.timings)
        self._runs: dict[str, Payer | None] = {}  # training run -> whom its usage goes to (None: no such run)
        self._samplers: dict[str, str] = {}  # sampling session -> its session
        self._cycles: dict[str, int] = {}  # base model -> cycles observed
        self._cycles_seen = threading.Condition()

    # -- the device loops' observer (beside the metrics) --------------------------------------------
    def observe_cycle(self, base_model: str, plan: CyclePlan, seconds: float) -> None:
        """Called on `base_model`'s device loop after each training cycle, its requests answered."""
        try:
            self._count_cycle(base_model, plan, seconds)
        finally:  # counted even if counting failed: a report never waits for a cycle forever
            with self._cycles_seen:
                self._cycles[base_model] = self._cycles.get(base_model, 0) + 1
                self._cycles_seen.notify_all()
        self.flush()

    def observe_sample(self, base_model: str, job: SampleJob, generated_tokens: int) -> None:
        pass  # samples are counted through count_sample, before their answer exists

    def observe_vllm_request(self, base_model: str, job: SampleJob, result: SampleResult | None,
                             seconds: float) -> None:
        pass

    def _count_cycle(self, base_model: str, plan: CyclePlan, seconds: float) -> None:
        ended, ended_monotonic = time.time(), time.monotonic()
        cycle = CycleSpan(base_model, self._cycles.get(base_model, 0) + 1, ended - seconds, ended, ended_monotonic,
                          max(len(plan.models) - 1, 0))
        with self.writer.one_batch:  # a cycle's records are written together
            for req in plan.compute + plan.optim + plan.tail:
                payer = self._payer_of_run(req.model_id)
                if payer is None:
                    continue
                answer = None if self.futures.is_pending(req.request_id) else self.futures.lookup(req.request_id)
                outcome = "part" if answer is None else "failed" if answer.failed else "done"
                self.usage.count_training(ended, base_model, payer, req.kind, req.tokens, outcome)
                if req.kind in SAVES and outcome == "done":
                    self.audit_log.record("checkpoint_create", payer.owner, at=ended, **self._saved(req, payer))
                self.timings.add_training(payer.session_id, cycle, req, None if answer is None else answer.resolved_at,
                                          outcome)

    @staticmethod
    def _saved(req: Request, payer: Payer) -> dict:
        """A save's `checkpoint_create` details."""
        spec: SaveSpec = req.payload
        path = TinkerPath(req.model_id, spec.kind, spec.name)
        return {"tinker_path": str(path), "model_id": req.model_id, "checkpoint_type": path.checkpoint_type,
                "session_id": payer.session_id, "how": "save"}

    def _payer_of_run(self, model_id: str) -> Payer | None:
        """Whom a training run's usage goes to (its record, read once)."""
        if model_id not in self._runs:
            if len(self._runs) > MAX_REMEMBERED:
                self._runs.clear()
            row = self.store.runs.get(model_id)
            self._runs[model_id] = None if row is None else Payer(row.owner, row.session_id)
        return self._runs[model_id]

    # -- the services' side -------------------------------------------------------------------------
    def count_sample(self, job: SampleJob, owner: str, base_model: str, request_id: str,
                     sampling_session_id: str | None = None) -> None:
        """Charge `job` once, when it ends, before its own `on_done` / `on_error` runs (so before its answer
        exists). Done: its prompt and every sampled token. Cancelled (its client left) or failed: what its
        backend computed until it stopped (`SampleJob.prefilled_tokens`, `generated_tokens`), nothing if it
        never started. Either way, plus the requests its backend sent for it beyond those (vLLM's per-row
        prompt-scoring requests, `SampleJob.scoring_*`) that were answered. Call before the job is queued."""
        payer = Payer(owner, "" if sampling_session_id is None else self._session_of(sampling_session_id))
        arrived, own_done, own_error = time.time(), job.on_done, job.on_error
        once = threading.Lock()  # a job whose answer fails to encode is told both: charged at on_done

        def charge(prefill: int, sampled: int, outcome: str) -> None:
            if not once.acquire(blocking=False):
                return
            try:
                self._charge_sample(job, prefill + job.scoring_prefilled_tokens, job.scoring_cached_tokens,
                                    sampled + job.scoring_generated_tokens, outcome, payer, base_model,
                                    request_id, arrived, sampling_session_id or "")
            except Exception:  # counting must never fail a sample
                log.exception("counting a sample's usage failed")

        def done(result: SampleResult) -> None:
            charge(len(job.prompt), sum(len(s.tokens) for s in result.sequences), "done")
            own_done(result)

        def error(message: str) -> None:
            charge(job.prefilled_tokens, job.generated_tokens, "failed")
            own_error(message)

        job.on_done, job.on_error = done, error

    def _charge_sample(self, job: SampleJob, prefill: int, cached: int, sampled: int, outcome: str, payer: Payer,
                       base_model: str, request_id: str, arrived: float, sampling_session_id: str) -> None:
        now = time.time()
        self.usage.count_sample(now, base_model, payer, prefill, cached, sampled)
        first = None if job.first_token_at is None else now - (time.perf_counter() - job.first_token_at)
        self.timings.add_sample(payer.session_id, base_model, request_id, sampling_session_id, arrived, first, now,
                                prefill + cached + sampled, outcome)

    def _session_of(self, sampling_session_id: str) -> str:
        session = self._samplers.get(sampling_session_id)
        if session is None:
            row = self.store.sampling_sessions.get(sampling_session_id)
            session = "" if row is None else row.session_id
            if len(self._samplers) > MAX_REMEMBERED:  # sessions are few per client
                self._samplers.clear()
            self._samplers[sampling_session_id] = session
        return session

    def audit(self, event: str, actor: str, **details) -> None:
        """One audit log entry: `actor` (an owner) did `event` (one of AUDIT_EVENTS); `details` say to what."""
        self.audit_log.record(event, actor, **details)

    # -- writing ------------------------------------------------------------------------------------
    def flush(self) -> None:
        self.writer.flush()

    def settle(self, cycles_started: dict[str, int]) -> None:
        """Wait until the cycles counted in `cycles_started` (base model -> its scheduler's count) have been
        observed, then accrue storage and flush: the tables then hold everything answered before."""
        with self._cycles_seen:
            done = self._cycles_seen.wait_for(
                lambda: all(self._cycles.get(m, 0) >= n for m, n in cycles_started.items()), SETTLE_WAIT_S)
        if not done:
            log.warning("a device loop did not finish its cycle within %.0f s: the report may miss its usage",
                        SETTLE_WAIT_S)
        self.usage.accrue_storage()
        self.writer.flush()

    def start(self) -> None:
        self.writer.start()

    def stop(self) -> None:
        """Write everything still in memory. Call after the device loops have stopped."""
        self.writer.stop()
