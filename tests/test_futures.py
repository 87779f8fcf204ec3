"""Unit tests of `FutureStore` over a real SQLite `Store`: long-poll wake-ups, timeouts,
durability across a re-open, failure payloads, (model_id, seq_id) idempotency, and the
start-up sweep of interrupted futures."""

from __future__ import annotations

import asyncio
import json
import threading
import time

import pytest

from hosted_tinker.requests.futures import FutureStore, KnownFuture
from hosted_tinker.store.tables import Store


@pytest.fixture
def db_path(tmp_path):
    return tmp_path / "state" / "server.sqlite"


@pytest.fixture
def store(db_path):
    s = Store(db_path)
    yield s
    s.close()


def test_waiter_wakes_as_soon_as_another_thread_resolves(store):
    """A long-poll waiter is woken by resolve() from a worker thread. It gets the result, which
    only a wake-up delivers: a wait that runs into its timeout answers None."""
    futures = FutureStore(store)
    rid, is_new = futures.create("alice", "forward_backward", "m1", 0)
    assert is_new

    async def main():
        futures.bind_loop(asyncio.get_running_loop())
        waiter = asyncio.create_task(futures.wait(rid, timeout=60.0))
        await asyncio.sleep(0)  # the waiter runs up to its wait on the event
        assert not waiter.done()
        resolver = threading.Thread(target=futures.resolve, args=(rid, {"type": "fb", "loss": 1.5}))
        resolver.start()
        try:
            return await waiter
        finally:
            resolver.join()

    result = asyncio.run(main())
    assert result is not None and not result.failed and not result.is_proto
    assert json.loads(result.payload) == {"type": "fb", "loss": 1.5}


def test_several_waiters_on_one_id_all_wake(store):
    """Concurrent waiters on the same request id are all woken by one resolve."""
    futures = FutureStore(store)
    rid, _ = futures.create("alice", "optim_step", "m1", 1)

    async def main():
        futures.bind_loop(asyncio.get_running_loop())
        waiters = [asyncio.create_task(futures.wait(rid, timeout=60.0)) for _ in range(3)]
        await asyncio.sleep(0)  # each waiter runs up to its wait on the event
        threading.Thread(target=futures.resolve, args=(rid, {"ok": True})).start()
        return await asyncio.gather(*waiters)

    results = asyncio.run(main())
    assert [json.loads(r.payload) for r in results] == [{"ok": True}] * 3


def test_wait_returns_none_after_timeout(store):
    """With nothing resolving, wait() gives None, and not before its timeout has passed."""
    futures = FutureStore(store)
    rid, _ = futures.create("alice", "forward", "m1", 0)

    async def main():
        futures.bind_loop(asyncio.get_running_loop())
        t0 = time.monotonic()
        result = await futures.wait(rid, timeout=0.2)
        return result, time.monotonic() - t0

    result, elapsed = asyncio.run(main())
    assert result is None
    assert elapsed >= 0.18
    assert futures.lookup(rid) is None


def test_already_resolved_future_returns_immediately(store):
    """wait() on a resolved id answers without waiting: even with no time to wait at all."""
    futures = FutureStore(store)
    rid, _ = futures.create("alice", "forward", "m1", 0)
    futures.resolve(rid, b"\x08\x01", is_proto=True)  # no loop bound yet: must not fail

    async def main():
        futures.bind_loop(asyncio.get_running_loop())
        return await futures.wait(rid, timeout=0.0)

    result = asyncio.run(main())
    assert result.payload == b"\x08\x01" and result.is_proto


def test_results_survive_reopening_the_store(db_path):
    """Resolved and failed results are read back from SQLite by a new Store + FutureStore."""
    store = Store(db_path)
    futures = FutureStore(store)
    ok, _ = futures.create("alice", "forward_backward", "m1", 0)
    proto, _ = futures.create("alice", "forward_backward", "m1", 1)
    bad, _ = futures.create("alice", "optim_step", "m1", 2)
    futures.resolve(ok, {"type": "fb", "metrics": {"loss:sum": 3.0}})
    futures.resolve(proto, b"\x00\x01\x02", is_proto=True)
    futures.fail(bad, "no gradients", category="user")
    store.close()

    store2 = Store(db_path)
    try:
        futures2 = FutureStore(store2)
        r = futures2.lookup(ok)
        assert r is not None and not r.failed and not r.is_proto
        assert json.loads(r.payload) == {"type": "fb", "metrics": {"loss:sum": 3.0}}
        r = futures2.lookup(proto)
        assert r.is_proto and r.payload == b"\x00\x01\x02"
        r = futures2.lookup(bad)
        assert r.failed and json.loads(r.payload) == {"error": "no gradients", "category": "user"}
        # The idempotency key survives too.
        assert futures2.create("alice", "forward_backward", "m1", 0) == (ok, False)
    finally:
        store2.close()


def test_fail_payload_is_error_and_category(store):
    """fail() stores {"error", "category"} JSON, default category user, and marks it failed."""
    futures = FutureStore(store)
    a, _ = futures.create("alice", "forward", "m1", 0)
    b, _ = futures.create("alice", "forward", "m1", 1)
    futures.fail(a, "datum 3: loss_fn_inputs['weights'] has shape [2], expected [3]")
    futures.fail(b, "CUDA out of memory", category="server")
    ra, rb = futures.lookup(a), futures.lookup(b)
    assert ra.failed and rb.failed and not ra.is_proto
    assert json.loads(ra.payload) == {"error": "datum 3: loss_fn_inputs['weights'] has shape [2], expected [3]",
                                      "category": "user"}
    assert json.loads(rb.payload) == {"error": "CUDA out of memory", "category": "server"}
    assert store.futures.get(a).status == "failed"


def test_model_seq_idempotency_returns_first_request_id(store):
    """A repeated (model_id, seq_id) gets the first request id back; other keys get new ids."""
    futures = FutureStore(store)
    first, new1 = futures.create("alice", "forward_backward", "m1", 5)
    again, new2 = futures.create("alice", "forward_backward", "m1", 5)
    assert new1 and not new2 and again == first
    other_seq, new3 = futures.create("alice", "forward_backward", "m1", 6)
    other_model, new4 = futures.create("alice", "forward_backward", "m2", 5)
    assert new3 and new4 and len({first, other_seq, other_model}) == 3
    # Requests without a seq_id (e.g. unload_model) are never deduplicated.
    u1, n1 = futures.create("alice", "unload_model", "m1", None)
    u2, n2 = futures.create("alice", "unload_model", "m1", None)
    assert n1 and n2 and u1 != u2
    # Still the same id after the first one resolved.
    futures.resolve(first, {"done": True})
    assert futures.create("alice", "forward_backward", "m1", 5) == (first, False)


def test_fail_interrupted_futures_marks_pending_as_server_failures(db_path):
    """At start-up every still-pending future fails with category "server"; finished ones stay."""
    store = Store(db_path)
    futures = FutureStore(store)
    p1, _ = futures.create("alice", "forward_backward", "m1", 0)
    p2, _ = futures.create("bob", "save_weights", "m2", 0)
    done, _ = futures.create("alice", "forward_backward", "m1", 1)
    futures.resolve(done, {"ok": 1})
    store.close()

    store2 = Store(db_path)
    try:
        assert store2.futures.fail_interrupted("server restarted") == 2
        futures2 = FutureStore(store2)
        for rid in (p1, p2):
            r = futures2.lookup(rid)
            assert r is not None and r.failed
            assert json.loads(r.payload) == {"error": "server restarted", "category": "server"}
        r = futures2.lookup(done)
        assert not r.failed and json.loads(r.payload) == {"ok": 1}
        assert store2.futures.fail_interrupted("again") == 0
    finally:
        store2.close()


def test_prune_keeps_results_reachable_through_sqlite(store):
    """prune() drops in-memory results older than the keep window (and only those), but lookup
    still finds them in SQLite."""
    now = [1000.0]
    futures = FutureStore(store, keep_in_memory_s=60.0, clock=lambda: now[0])
    rid, _ = futures.create("alice", "forward", "m1", 0)
    futures.resolve(rid, {"v": 1})
    now[0] += 60.0
    futures.prune()
    assert rid in futures._results  # not older than the window yet
    now[0] += 0.001
    futures.prune()
    assert rid not in futures._results
    assert json.loads(futures.lookup(rid).payload) == {"v": 1}


def test_fail_unanswered_fails_only_what_is_still_pending(store):
    """The device loop's end-of-cycle sweep: pending ids fail with category "server"; answered
    ones keep their answer; the per-key pending count keeps no entry for a key with none."""
    futures = FutureStore(store)
    done, _ = futures.create("alice", "forward_backward", "m1", 0)
    pending, _ = futures.create("alice", "optim_step", "m1", 1)
    futures.resolve(done, {"ok": 1})
    assert futures.fail_unanswered([done, pending], "the cycle failed") == [pending]
    assert json.loads(futures.lookup(done).payload) == {"ok": 1}
    r = futures.lookup(pending)
    assert r.failed and json.loads(r.payload) == {"error": "the cycle failed", "category": "server"}
    assert futures.fail_unanswered([done, pending], "again") == []
    assert futures.pending("alice") == 0 and futures.pending_by_owner == {}


def test_on_finish_runs_once_when_a_new_request_ends(store):
    """What a request holds (its images' pixels, services/images.py) is given back when it is resolved
    or failed, once; a repeated (model_id, seq_id) registers nothing, its caller gives back itself."""
    futures = FutureStore(store)
    ended = []
    done, _ = futures.create("alice", "forward", "m1", 1, on_finish=lambda: ended.append("done"))
    failed, _ = futures.create("alice", "forward", "m1", 2, on_finish=lambda: ended.append("failed"))
    _, is_new = futures.create("alice", "forward", "m1", 1, on_finish=lambda: ended.append("repeated"))
    assert not is_new and ended == []
    futures.resolve(done, {"ok": True})
    futures.fail(failed, "bad input")
    futures.fail_unanswered([done, failed], "the cycle ended")  # both answered already: nothing more
    assert ended == ["done", "failed"]


def test_a_request_of_this_process_is_known_with_its_owner_until_pruned(store):
    """known(): a pending or resolved request this process created, with its owner (what
    retrieve_future checks the caller against, with no SQLite read); None for one it does not hold
    in memory (another process's, or pruned), which the route reads from SQLite as before."""
    now = [1000.0]
    futures = FutureStore(store, keep_in_memory_s=60.0, clock=lambda: now[0])
    rid, _ = futures.create("alice", "forward", "m1", 0)
    assert futures.known(rid) == KnownFuture("alice", None)
    futures.resolve(rid, {"v": 1})
    known = futures.known(rid)
    assert known.owner == "alice" and json.loads(known.result.payload) == {"v": 1}
    assert futures.known("req-unknown") is None
    now[0] += 61.0
    futures.prune()
    assert futures.known(rid) is None
    assert FutureStore(store).known(rid) is None  # a later process reads it from SQLite


def test_answers_given_in_a_batch_are_written_and_visible_together_at_its_end(store):
    """answering(): the results given inside the block are neither in SQLite nor visible to a waiter
    until the block ends; then all are, with the touched runs' last_request_at, in one go."""
    store.runs.create("m1", "s", "alice", "base", {}, {}, {})
    futures = FutureStore(store)
    ids = [futures.create("alice", "forward", "m1", seq)[0] for seq in (1, 2)]
    touched_before = store.runs.get("m1").last_request_at
    with futures.answering(touched_models=["m1"]):
        futures.resolve(ids[0], {"v": 1})
        futures.fail(ids[1], "no", "user")
        assert futures.lookup(ids[0]) is None and futures.is_pending(ids[1])
        assert store.futures.get(ids[0]).status == "pending"
    assert json.loads(futures.lookup(ids[0]).payload) == {"v": 1} and futures.lookup(ids[1]).failed
    assert [store.futures.get(i).status for i in ids] == ["done", "failed"]
    assert store.runs.get("m1").last_request_at > touched_before


def test_a_batch_whose_write_fails_publishes_nothing(store, monkeypatch):
    """If the batch's one transaction fails, no answer of it is visible: they stay pending, for the
    device loop to fail (fail_unanswered), never answered in memory but lost on disk."""
    futures = FutureStore(store)
    rid, _ = futures.create("alice", "forward", "m1", 1)

    def disk_full(*args, **kwargs):
        raise OSError("disk full")

    monkeypatch.setattr(store.futures, "complete_batch", disk_full)
    with pytest.raises(OSError), futures.answering():
        futures.resolve(rid, {"v": 1})
    assert futures.is_pending(rid) and futures.lookup(rid) is None
