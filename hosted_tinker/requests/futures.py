"""`FutureStore`: request ids handed to the SDK, their results, and the waiters long-polling them.

A result is written to SQLite first (so an acknowledged result survives a crash), then kept in
memory for fast delivery, then every waiter on that id is woken through its asyncio event. No
waiter ever sleeps and re-checks: `retrieve_future` answers the moment the scheduler resolves
the future, or after the long-poll window with `try_again`. Once the SDK has fetched a result,
the retention sweep drops it from SQLite soon after (`delivered`, retention.py); memory keeps it
for `keep_in_memory_s`, so a retry of a fetch whose answer was lost on the way still gets it.

A cycle answers its requests together (`answering`): their results, and the `last_request_at` of
the training runs they touched, are written in one transaction, then all are published, so a
cycle's writes cost one commit however many tenants it ran.
"""

from __future__ import annotations

import asyncio
import json
import sqlite3
import threading
import time
import uuid
from collections import OrderedDict
from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass

from ..errors import Failure
from ..store.tables import Store


@dataclass
class FutureResult:
    payload: bytes  # JSON text or protobuf bytes
    is_proto: bool
    failed: bool
    resolved_at: float
    owner: str | None = None  # whose request it was, where this process created it


@dataclass(frozen=True)
class KnownFuture:
    """A request this process holds in memory: its owner, and its result (None while pending)."""
    owner: str
    result: FutureResult | None


class FutureStore:
    def __init__(self, store: Store, *, keep_in_memory_s: float = 600.0, clock: Callable[[], float] = time.time):
        self.store = store
        self.keep_in_memory_s = keep_in_memory_s
        self.clock = clock  # when a result is kept from, for prune(); injectable so that tests step it
        self._loop: asyncio.AbstractEventLoop | None = None
        self._lock = threading.Lock()
        # In the order they were resolved, so that prune() pops the old ones off the front: the event loop
        # never walks every result held (a busy server holds keep_in_memory_s of them).
        self._results: OrderedDict[str, FutureResult] = OrderedDict()
        self._events: dict[str, asyncio.Event] = {}
        self.resolved_total = 0
        # Unfinished requests per owner, for per-key back-pressure.
        self._pending_owner: dict[str, str] = {}
        self.pending_by_owner: dict[str, int] = {}
        self._on_finish: dict[str, Callable[[], None]] = {}  # what an unfinished request gives back when it ends
        self._batch = threading.local()  # answers held by `answering` on this thread, written together
        self._delivered: dict[str, float] = {}  # request id -> when its result was first handed to the SDK

    def bind_loop(self, loop: asyncio.AbstractEventLoop) -> None:
        self._loop = loop

    # -- creation / resolution (any thread) ----------------------------------------------------
    def create(self, owner: str, kind: str, model_id: str | None = None, seq_id: int | None = None,
               on_finish: Callable[[], None] | None = None,
               with_write: Callable[[sqlite3.Connection], None] | None = None) -> tuple[str, bool]:
        """Return (request_id, is_new). A repeated (model_id, seq_id) returns the first id. A new
        request calls `on_finish` once, when it is resolved or failed; a repeated one never does.
        `with_write(connection)`, for a new request, is written in the future's own transaction."""
        request_id = f"req-{uuid.uuid4().hex}"
        got = self.store.futures.insert(request_id, owner, kind, model_id, seq_id, with_write)
        if got == request_id:
            with self._lock:
                self._pending_owner[request_id] = owner
                self.pending_by_owner[owner] = self.pending_by_owner.get(owner, 0) + 1
                if on_finish is not None:
                    self._on_finish[request_id] = on_finish
        return got, got == request_id

    def pending(self, owner: str) -> int:
        with self._lock:
            return self.pending_by_owner.get(owner, 0)

    def is_pending(self, request_id: str) -> bool:
        with self._lock:
            return request_id in self._pending_owner

    def resolve(self, request_id: str, result: dict | bytes, *, is_proto: bool = False) -> None:
        payload = result if isinstance(result, bytes) else json.dumps(result, allow_nan=False).encode()
        self._finish(request_id, payload, is_proto=is_proto, failed=False)

    def fail(self, request_id: str, message: str, category: str = "user") -> None:
        self._finish(request_id, Failure(message, category).to_wire(), is_proto=False, failed=True)

    def fail_unanswered(self, request_ids, message: str) -> list[str]:
        """Fail, with category "server", those of `request_ids` still pending; return them.

        The device loop calls this when a cycle ends, so no request that ran is left waiting.
        """
        with self._lock:
            pending = [rid for rid in request_ids if rid in self._pending_owner]
        for rid in pending:
            self.fail(rid, message, "server")
        return pending

    @contextmanager
    def answering(self, touched_models: Iterable[str] = ()) -> Iterator[None]:
        """The answers given on this thread inside the block are written to SQLite in one transaction
        at its end, with `touched_models`' last_request_at, then published and their waiters woken.
        If the block raises, what it answered is still written and published; if the write raises,
        nothing is published (the requests stay pending, for the caller to fail)."""
        if getattr(self._batch, "rows", None) is not None:  # nested: the outer block writes
            yield
            return
        self._batch.rows = rows = []
        try:
            yield
        finally:
            self._batch.rows = None
            self.store.futures.complete_batch(rows, touched_models=list(touched_models))
            for rid, payload, is_proto, failed in rows:
                self._publish(rid, payload, is_proto=is_proto, failed=failed)

    def _finish(self, request_id: str, payload: bytes, *, is_proto: bool, failed: bool) -> None:
        rows = getattr(self._batch, "rows", None)
        if rows is not None:
            rows.append((request_id, payload, is_proto, failed))
            return
        self.store.futures.complete(request_id, payload, is_proto, failed)
        self._publish(request_id, payload, is_proto=is_proto, failed=failed)

    def _publish(self, request_id: str, payload: bytes, *, is_proto: bool, failed: bool) -> None:
        """A written result, in memory for its waiters, who are woken; its request's on_finish runs."""
        with self._lock:
            owner = self._pending_owner.pop(request_id, None)
            self._results[request_id] = FutureResult(payload, is_proto, failed, self.clock(), owner)
            self.resolved_total += 1
            if owner is not None:
                self.pending_by_owner[owner] -= 1
                if not self.pending_by_owner[owner]:  # one entry per key with work, not per key ever seen
                    del self.pending_by_owner[owner]
            on_finish = self._on_finish.pop(request_id, None)
        if on_finish is not None:
            on_finish()
        if self._loop is not None and not self._loop.is_closed():
            self._loop.call_soon_threadsafe(self._wake, request_id)

    def _wake(self, request_id: str) -> None:
        event = self._events.pop(request_id, None)
        if event is not None:
            event.set()

    # -- retrieval (event-loop thread) ---------------------------------------------------------
    def known(self, request_id: str) -> KnownFuture | None:
        """The request if this process holds it in memory (pending, or resolved and not yet pruned),
        with its owner: a long-poll on it needs no SQLite read and no trip to a thread. None: ask
        the store (a request of an earlier process, or one pruned from memory)."""
        with self._lock:
            hit = self._results.get(request_id)
            if hit is not None and hit.owner is not None:
                return KnownFuture(hit.owner, hit)
            owner = self._pending_owner.get(request_id)
        return None if owner is None else KnownFuture(owner, None)

    def lookup(self, request_id: str) -> FutureResult | None:
        with self._lock:
            hit = self._results.get(request_id)
        if hit is not None:
            return hit
        return self.from_record(self.store.futures.get(request_id))

    def from_record(self, rec) -> FutureResult | None:
        """The result of a SQLite future record, or None while it is pending. A result dropped after
        its delivery is still answered from memory for a while, then as a failure that says so."""
        if rec is None or rec.status == "pending":
            return None
        if rec.result is None:
            with self._lock:
                hit = self._results.get(rec.request_id)
            return hit or FutureResult(Failure(
                f"request {rec.request_id} was answered and its result fetched; results are not kept after they "
                "are fetched", "server").to_wire(), False, True, rec.completed_at or time.time())
        return FutureResult(rec.result, rec.result_is_proto, rec.status == "failed", rec.completed_at or time.time())

    def delivered(self, request_id: str) -> None:
        """The SDK was handed this request's result (`retrieve_future`): SQLite need not keep it."""
        with self._lock:
            self._delivered.setdefault(request_id, self.clock())

    def take_delivered(self, before: float) -> list[str]:
        """The requests whose results were first delivered before `before`, forgotten here."""
        with self._lock:
            ids = [rid for rid, at in self._delivered.items() if at < before]
            for rid in ids:
                del self._delivered[rid]
        return ids

    async def wait(self, request_id: str, timeout: float) -> FutureResult | None:
        """The result, or None if it is still pending after `timeout` seconds.

        Runs on the event loop, so it reads memory only, never SQLite: the caller has read the
        record (pending) from the store already, and a result that arrives after that is in
        memory before any waiter is woken (`_finish`).
        """
        event = self._events.get(request_id)
        if event is None:
            event = self._events[request_id] = asyncio.Event()
        # Checked after registering: a resolve that raced us is either visible now or will call
        # _wake on this loop later (both steps above run without yielding).
        with self._lock:
            hit = self._results.get(request_id)
        if hit is not None:
            return hit
        try:
            await asyncio.wait_for(event.wait(), timeout)
        except asyncio.TimeoutError:
            return None
        with self._lock:
            return self._results.get(request_id)

    def prune(self) -> None:
        """Drop in-memory results older than the keep window (they stay in SQLite)."""
        cutoff = self.clock() - self.keep_in_memory_s
        with self._lock:
            while self._results:
                rid, oldest = next(iter(self._results.items()))
                if oldest.resolved_at >= cutoff:
                    break
                del self._results[rid]
