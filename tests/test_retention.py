"""The data dir's bounds (retention.py): what a retention sweep removes by age and by size, and what
it never does.

The sweeps here run on a real SQLite store in a temporary data dir, with a clock the test steps
(the futures' and the sweep's), and explicit calls of `Retention.sweep`: nothing waits on time.
test_retention_restart.py shows the same on a real server, across a restart, through the SDK.
"""

from __future__ import annotations

import json

import pytest

from hosted_tinker.requests.futures import FutureStore
from hosted_tinker.server.retention import DELIVERED_GRACE_S, Retention, RetentionSettings
from hosted_tinker.store.tables import Store, db_path
from hosted_tinker.store.accounting import AccountingTables, AuditEntry, RequestTiming

DAY = 86400.0
T0 = 1_800_000_000.0
LOOSE = RetentionSettings(history_s=7 * DAY, history_bytes=1 << 40, snapshot_bytes=1 << 40, audit_s=365 * DAY)


class Clock:
    def __init__(self, now: float = T0):
        self.now = now

    def __call__(self) -> float:
        return self.now


@pytest.fixture
def parts(tmp_path):
    clock = Clock()
    store = Store(db_path(tmp_path))
    tables = AccountingTables(store.db)
    futures = FutureStore(store, clock=clock)
    removed: list = []

    def remove_snapshot(row) -> bool:  # the record only: these snapshots have no files (the server's removes both)
        removed.append(row)
        return store.checkpoints.delete_if(row.model_id, row.checkpoint_id)

    def retention(settings: RetentionSettings = LOOSE) -> Retention:
        return Retention(store.db, futures, tmp_path, settings, remove_snapshot=remove_snapshot, clock=clock)

    yield clock, store, tables, futures, retention, removed
    store.close()


def answered(store: Store, futures: FutureStore, rid: str, seq_id: int, *, at: float, payload: bytes = b"x" * 3000):
    futures.create("alice", "forward_backward", "run-1", seq_id)
    assert store.db.execute("UPDATE futures SET request_id=? WHERE model_id='run-1' AND seq_id=?",
                            (rid, seq_id)).rowcount == 1
    futures.resolve(rid, payload)
    store.db.execute("UPDATE futures SET created_at=?, completed_at=? WHERE request_id=?", (at, at, rid))


def rows(store: Store, sql: str) -> list[tuple]:
    return [tuple(r) for r in store.db.all(sql)]


def test_a_fetched_result_goes_after_its_grace_and_its_row_and_unfetched_results_stay(parts):
    clock, store, _, futures, retention, _ = parts
    answered(store, futures, "req-fetched", 1, at=T0)
    answered(store, futures, "req-unfetched", 2, at=T0)
    answered(store, futures, "req-fetched-late", 3, at=T0)
    futures.create("alice", "optim_step", "run-1", 4)  # still pending
    futures.delivered("req-fetched")
    sweep = retention()
    sweep.sweep()  # within the grace: nothing goes yet
    assert store.futures.get("req-fetched").result is not None
    clock.now += DELIVERED_GRACE_S + 1
    futures.delivered("req-fetched-late")
    sweep.sweep()
    kept = {r[0]: r[1] for r in rows(store, "SELECT request_id, result IS NOT NULL FROM futures")}
    assert kept == {"req-fetched": 0, "req-unfetched": 1, "req-fetched-late": 1, pending_id(store): 0}
    assert futures.lookup("req-fetched").payload == b"x" * 3000  # memory still has it, for a lost answer's retry
    clock.now += futures.keep_in_memory_s + 1
    sweep.sweep()
    late = futures.lookup("req-fetched")  # a retry after that: a failure that says why, not a 404
    assert late.failed and "fetched" in json.loads(late.payload)["error"]
    assert futures.lookup("req-unfetched").payload == b"x" * 3000
    assert store.futures.request_id_of("run-1", 1) == "req-fetched"  # the seq_id still dedupes a resubmission


def pending_id(store: Store) -> str:
    return store.db.one("SELECT request_id FROM futures WHERE status='pending'")[0]


def test_history_and_audit_go_by_age_and_nothing_pending(parts):
    clock, store, tables, futures, retention, _ = parts
    old, new = T0 - 8 * DAY, T0 - 6 * DAY
    answered(store, futures, "req-old", 1, at=old)
    answered(store, futures, "req-new", 2, at=new)
    futures.create("alice", "optim_step", "run-1", 3)
    store.db.execute("UPDATE futures SET created_at=? WHERE status='pending'", (old,))  # pending for 8 days
    tables.write({}, [AuditEntry(T0 - 400 * DAY, "checkpoint_read", "checkpoints", "alice", {}),
                      AuditEntry(T0 - 300 * DAY, "checkpoint_read", "checkpoints", "bob", {})],
                 [timing("req-old", old), timing("req-new", new)])
    store.losses.record([("run-1", 1, 0, False, 1.0), ("run-1", 2, 1, False, 0.5)])
    store.db.execute("UPDATE request_losses SET created_at = CASE seq_id WHEN 1 THEN ? ELSE ? END", (old, new))
    retention().sweep()
    assert {r[0] for r in rows(store, "SELECT request_id FROM futures")} == {"req-new", pending_id(store)}
    assert rows(store, "SELECT request_id FROM request_timings") == [("req-new",)]
    assert rows(store, "SELECT seq_id FROM request_losses") == [(2,)]
    assert rows(store, "SELECT actor FROM audit_log") == [("bob",)]
    short = RetentionSettings(history_s=7 * DAY, history_bytes=1 << 40, snapshot_bytes=1 << 40, audit_s=DAY)
    retention(short).sweep()
    assert rows(store, "SELECT actor FROM audit_log") == []


def timing(request_id: str, at: float) -> RequestTiming:
    return RequestTiming("sess-1", "base", request_id, "forward_backward", "run-1", at, at, at, at, 1, 0, 10, "done")


def test_the_size_bound_removes_the_oldest_history_and_never_a_result_not_yet_fetched(parts):
    clock, store, tables, futures, retention, _ = parts
    n = 1500
    for i in range(1, n + 1):
        answered(store, futures, f"req-{i:04d}", i, at=T0 + i, payload=b"r" * 2500)
    unfetched = {"req-0001", "req-0002", "req-0750"}  # the oldest among them
    for i in range(1, n + 1):
        if f"req-{i:04d}" not in unfetched:
            futures.delivered(f"req-{i:04d}")
    tables.write({}, [], [timing(f"req-{i:04d}", T0 + i) for i in range(1, n + 1)])
    clock.now += DELIVERED_GRACE_S + 1
    loose = retention()
    with_results = loose.measure(force=True)["database/requests"]
    loose.sweep()  # the fetched results go, and their pages with them (not only their bytes)
    assert loose.usage["database/requests"] < with_results / 5
    held = sum(v for k, v in loose.usage.items() if k in ("database/requests", "database/timings", "database/losses"))
    assert held > 0
    bound = held // 2
    tight = retention(RetentionSettings(history_s=7 * DAY, history_bytes=bound, snapshot_bytes=1 << 40,
                                        audit_s=365 * DAY))
    tight.sweep()
    now_held = sum(v for k, v in tight.usage.items() if k in ("database/requests", "database/timings",
                                                               "database/losses"))
    assert now_held <= bound
    left = {r[0] for r in rows(store, "SELECT request_id FROM futures")}
    assert unfetched <= left  # a result the SDK may still ask for stays whatever the bound
    numbers = sorted(int(r[4:]) for r in left - unfetched)
    assert numbers and numbers == list(range(numbers[0], n + 1)) and numbers[0] > 1  # the oldest went
    timings = sorted(int(r[0][4:]) for r in rows(store, "SELECT request_id FROM request_timings"))
    assert timings and timings == list(range(timings[0], n + 1)) and timings[0] > 1


def test_snapshots_over_their_bound_go_oldest_first_and_nothing_saved_by_name(parts):
    clock, store, _, _, retention, removed = parts
    size = 1000
    for run, names in (("run-a", ["ephemeral-1", "ephemeral-3", "ephemeral-5"]), ("run-b", ["ephemeral-2"])):
        for name in names:
            store.checkpoints.upsert(run, f"sampler_weights/{name}", "sampler", "alice", f"/x/{run}/{name}", size,
                                    T0 + 7 * DAY, {})
    # saved by name: never the sweep's, however old or large
    store.checkpoints.upsert("run-a", "sampler_weights/ephemeral", "sampler", "alice", "/x/a/e", 10 * size, None, {})
    store.checkpoints.upsert("run-a", "weights/ephemeral-7", "training", "alice", "/x/a/w", 10 * size, None, {})
    store.checkpoints.upsert("run-a", "sampler_weights/final", "sampler", "alice", "/x/a/f", 10 * size, None, {})
    order = ["ephemeral-1", "ephemeral-2", "ephemeral-3", "ephemeral-5"]  # oldest first
    for i, name in enumerate(order):
        store.db.execute("UPDATE checkpoints SET created_at=? WHERE checkpoint_id=?", (T0 + i, f"sampler_weights/{name}"))
    retention(RetentionSettings(history_s=7 * DAY, history_bytes=1 << 40, snapshot_bytes=2 * size,
                                audit_s=365 * DAY)).sweep()
    # newest first: run-a's ephemeral-5 (its run's newest), run-b's ephemeral-2 (its run's newest) = the bound;
    # ephemeral-3 and ephemeral-1 are over it
    assert sorted(r.checkpoint_id for r in removed) == ["sampler_weights/ephemeral-1", "sampler_weights/ephemeral-3"]
    removed.clear()
    retention(RetentionSettings(history_s=7 * DAY, history_bytes=1 << 40, snapshot_bytes=0,
                                audit_s=365 * DAY)).sweep()
    assert removed == []  # each run's newest stays, whatever the bound
