"""`Accounting`: usage, the audit log and per-request timings, counted as the server runs.

Where each count comes from, each hook in one place:

- training tokens, checkpoints saved and their `checkpoint_create` entries, and the training
  requests' timings: the device loop's cycle observer (`observe_cycle`, beside the metrics'), from
  the plan it ran and each request's answer in the `FutureStore` (a request that failed is not
  charged; a part of a split request is charged when it ran);
- prefill and sampled tokens and the sample requests' timings: `count_sample`, which the sampling
  service wraps around a job's `on_done` and `on_error` before the job is queued, so a sample is counted
  once, before its answer exists, whichever backend ran it; one cut short (its client left, or it
  failed) is charged what was computed of it until it stopped;
- the other audit entries (reads, publish, TTL, copies, deletes, project moves): `audit`, called by
  the services;
- storage GB-hours: accrued from the live checkpoints every `STORAGE_TICK_S` and before a report.

Everything is added up in memory and written by `flush` in one transaction: after each training
cycle (with the cycle's other records) and every `FLUSH_S` by a thread of its own (for sampling and
the API's entries), and once more when the server stops, after its device loops have finished their
last cycle: a graceful stop loses nothing. A kill -9 loses what was counted since the last flush:
the last cycle's training usage if it came after that cycle's answers, and at most `FLUSH_S` of
sampling usage and audit entries.

A report first `settle`s: it waits until every clock cycle started so far has been observed (a
request a client saw answered is in one), then flushes, so it shows everything answered before it.
"""

from __future__ import annotations

import logging
import threading
import time
from dataclasses import dataclass

from .checkpoints.paths import TinkerPath
from .futures import FutureStore
from .request_types import RequestKind, SaveSpec
from .sampling.jobs import SampleJob, SampleResult
from .cycle_plan import COMPUTE, CyclePlan, Request
from .store import Store
from .store_accounting import AccountingTables, AuditEntry, RequestTiming, UsageKey

log = logging.getLogger(__name__)

TRAINING, PREFILL, SAMPLE, CHECKPOINT, STORAGE = (
    "training", "sampling_prefill", "sampling_sample", "checkpoint", "storage")
SAVES = frozenset({RequestKind.SAVE_WEIGHTS, RequestKind.SAVE_WEIGHTS_FOR_SAMPLER, RequestKind.SAVE_WEIGHTS_EXTERNAL})
# The audit log's events (`<resource>_<action>`), and the resource each belongs to (`get_audit_log(event_type)`).
AUDIT_EVENTS = {
    "checkpoint_create": "checkpoints", "checkpoint_read": "checkpoints", "checkpoint_publish": "checkpoints",
    "checkpoint_unpublish": "checkpoints", "checkpoint_ttl_set": "checkpoints", "checkpoint_copy": "checkpoints",
    "checkpoint_delete": "checkpoints", "project_session_assign": "projects",
}
FLUSH_S = 1.0  # sampling usage and audit entries wait at most this long in memory
STORAGE_TICK_S = 60.0  # storage GB-hours are accrued this often (and before each report)
SETTLE_WAIT_S = 60.0  # hang guard: a report waits this long at most for a running cycle's observation
HOUR = 3600


def hour_of(t: float) -> int:
    """The UTC hour `t` falls in, as unix seconds of its start."""
    return int(t // HOUR) * HOUR


@dataclass(frozen=True)
class RunOwner:
    """Whom a training run's usage is charged to."""

    owner: str
    session_id: str
    base_model: str


class Accounting:
    def __init__(self, store: Store, futures: FutureStore):
        self.store = store
        self.futures = futures
        self.tables = AccountingTables(store.db)
        self._lock = threading.Lock()  # the in-memory batch
        self._usage: dict[UsageKey, float] = {}
        self._audit: list[AuditEntry] = []
        self._timings: list[RequestTiming] = []
        self._flush_lock = threading.Lock()  # one flush at a time: batches are written in order
        self._runs: dict[str, RunOwner | None] = {}
        self._samplers: dict[str, str] = {}  # sampling session -> its session
        self._cycles: dict[str, int] = {}  # base model -> cycles observed
        self._cycles_seen = threading.Condition()
        self._storage_since = time.time()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._flush_forever, name="accounting-flush", daemon=True)

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
        ended = time.time()
        started, cycle = ended - seconds, self._cycles.get(base_model, 0) + 1
        now_mono = time.monotonic()
        others = len(plan.models) - 1
        usage: list[tuple[UsageKey, float]] = []
        audit: list[AuditEntry] = []
        timings: list[RequestTiming] = []
        for req in plan.compute + plan.optim + plan.tail:
            run = self._run(req.model_id)
            if run is None:
                continue
            answer = None if self.futures.is_pending(req.request_id) else self.futures.lookup(req.request_id)
            outcome = "part" if answer is None else "failed" if answer.failed else "done"
            key = UsageKey(hour_of(ended), base_model, run.owner, run.session_id, TRAINING)
            if req.kind in COMPUTE and outcome != "failed":
                usage.append((key, req.tokens))
            elif req.kind in SAVES and outcome == "done":
                usage.append((UsageKey(key.bucket_start, base_model, run.owner, run.session_id, CHECKPOINT), 1))
                audit.append(self._saved(req, run, ended))
            if run.session_id:
                timings.append(RequestTiming(
                    run.session_id, base_model, req.request_id, str(req.kind), req.model_id,
                    ended - (now_mono - req.arrived_at), started, ended,
                    None if answer is None else answer.resolved_at, cycle, max(others, 0), req.tokens, outcome))
        self._add(usage, audit, timings)

    @staticmethod
    def _saved(req: Request, run: RunOwner, at: float) -> AuditEntry:
        spec: SaveSpec = req.payload
        path = TinkerPath(req.model_id, spec.kind, spec.name)
        return AuditEntry(at, "checkpoint_create", "checkpoints", run.owner, {
            "tinker_path": str(path), "model_id": req.model_id, "checkpoint_type": path.checkpoint_type,
            "session_id": run.session_id, "how": "save"})

    def _run(self, model_id: str) -> RunOwner | None:
        """Whom a training run's usage goes to (its record, read once)."""
        if model_id not in self._runs:
            if len(self._runs) > 65536:  # a bound on memory, not a cache policy
                self._runs.clear()
            row = self.store.runs.get(model_id)
            self._runs[model_id] = None if row is None else RunOwner(row.owner, row.session_id, row.base_model)
        return self._runs[model_id]

    # -- the services' side -------------------------------------------------------------------------
    def count_sample(self, job: SampleJob, owner: str, base_model: str, request_id: str,
                     sampling_session_id: str | None = None) -> None:
        """Charge `job` once, when it ends, before its own `on_done` / `on_error` runs (so before its answer
        exists). Done: its prompt and every sampled token. Cancelled (its client left) or failed: what its
        backend computed until it stopped (`SampleJob.prefilled_tokens`, `generated_tokens`), nothing if it
        never started. Either way, plus the requests its backend sent for it beyond those (vLLM's per-row
        prompt-scoring requests, `SampleJob.scoring_*`) that were answered. Call before the job is queued."""
        session_id = "" if sampling_session_id is None else self._session_of(sampling_session_id)
        arrived, own_done, own_error = time.time(), job.on_done, job.on_error
        once = threading.Lock()  # a job whose answer fails to encode is told both: charged at on_done

        def charge(prefill: int, sampled: int, outcome: str) -> None:
            if not once.acquire(blocking=False):
                return
            try:
                self._count_sample(job, prefill + job.scoring_prefilled_tokens, job.scoring_cached_tokens,
                                   sampled + job.scoring_generated_tokens, outcome, owner, base_model, session_id,
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

    def _count_sample(self, job: SampleJob, prefill: int, cached: int, sampled: int, outcome: str, owner: str,
                      base_model: str, session_id: str, request_id: str, arrived: float, target: str) -> None:
        now = time.time()
        hour = hour_of(now)
        # A job's own prompt is charged as computed (cached=False) on every backend, whatever vLLM's prefix cache
        # held from other requests: a request costs the same wherever it runs. Its prompt-scoring requests reuse
        # the prompt the job itself just prefilled: what vLLM says it took from its cache is charged as cached.
        usage = [(UsageKey(hour, base_model, owner, session_id, PREFILL, False), prefill),
                 (UsageKey(hour, base_model, owner, session_id, SAMPLE), sampled)] if prefill or sampled else []
        if cached:
            usage.append((UsageKey(hour, base_model, owner, session_id, PREFILL, True), cached))
        first = None if job.first_token_at is None else now - (time.perf_counter() - job.first_token_at)
        timings = [RequestTiming(session_id, base_model, request_id, "sample", target, arrived, first, now, now,
                                 None, None, prefill + cached + sampled, outcome)] if session_id else []
        self._add(usage, [], timings)

    def _session_of(self, sampling_session_id: str) -> str:
        session = self._samplers.get(sampling_session_id)
        if session is None:
            row = self.store.sampling_sessions.get(sampling_session_id)
            session = "" if row is None else row.session_id
            if len(self._samplers) > 65536:  # a bound, not a cache policy: sessions are few per client
                self._samplers.clear()
            self._samplers[sampling_session_id] = session
        return session

    def audit(self, event: str, actor: str, **details) -> None:
        """One audit log entry: `actor` (an owner) did `event` (one of AUDIT_EVENTS); `details` say to what."""
        self._add([], [AuditEntry(time.time(), event, AUDIT_EVENTS[event], actor, details)], [])

    def _add(self, usage: list[tuple[UsageKey, float]], audit: list[AuditEntry],
             timings: list[RequestTiming]) -> None:
        with self._lock:
            for key, quantity in usage:
                self._usage[key] = self._usage.get(key, 0) + quantity
            self._audit += audit
            self._timings += timings

    # -- storage ------------------------------------------------------------------------------------
    def accrue_storage(self) -> None:
        """Add the GB-hours the live checkpoints have held since the last accrual, hour by hour."""
        now = time.time()
        with self._lock:
            since, self._storage_since = self._storage_since, now
        if now <= since:
            return
        usage = []
        for held in self.store.checkpoints.live_storage():
            t = since
            while t < now:
                end = min(now, hour_of(t) + HOUR)
                usage.append((UsageKey(hour_of(t), held.base_model, held.owner, held.session_id, STORAGE),
                              held.size_bytes / 1e9 * (end - t) / HOUR))
                t = end
        self._add(usage, [], [])

    # -- writing ------------------------------------------------------------------------------------
    def flush(self) -> None:
        """Write what is counted in memory, in one transaction (added to the rows already there)."""
        with self._flush_lock:
            with self._lock:
                usage, audit, timings = self._usage, self._audit, self._timings
                self._usage, self._audit, self._timings = {}, [], []
            try:  # a batch's entries in time order: their ids (the audit log's order) follow their times
                self.tables.write(usage, sorted(audit, key=lambda e: e.at), timings)
            except Exception:
                with self._lock:  # kept for the next flush, added to what came meanwhile
                    for key, quantity in usage.items():
                        self._usage[key] = self._usage.get(key, 0) + quantity
                    self._audit[:0], self._timings[:0] = audit, timings
                raise

    def settle(self, cycles_started: dict[str, int]) -> None:
        """Wait until the cycles counted in `cycles_started` (base model -> its scheduler's count) have been
        observed, then accrue storage and flush: the tables then hold everything answered before."""
        with self._cycles_seen:
            done = self._cycles_seen.wait_for(
                lambda: all(self._cycles.get(m, 0) >= n for m, n in cycles_started.items()), SETTLE_WAIT_S)
        if not done:
            log.warning("a device loop did not finish its cycle within %.0f s: the report may miss its usage",
                        SETTLE_WAIT_S)
        self.accrue_storage()
        self.flush()

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        """Write everything still in memory. Call after the device loops have stopped."""
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join()
        self.accrue_storage()
        self.flush()

    def _flush_forever(self) -> None:
        last_storage = time.monotonic()
        while not self._stop.wait(FLUSH_S):
            try:
                if time.monotonic() - last_storage >= STORAGE_TICK_S:
                    last_storage = time.monotonic()
                    self.accrue_storage()
                self.flush()
            except Exception:  # a full disk must not end the accounting for good
                log.exception("writing the accounting records failed; they stay in memory for the next try")
