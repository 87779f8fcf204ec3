"""create_session's idempotency key under concurrency: the route itself over a real SQLite store.

The SDK retries create_session with the same X-Idempotency-Key; two such calls in flight at once
must get one session. To make "at once" deterministic, the store's `sessions.create` is wrapped so
that both calls are inside the route, past any check it made, before either writes (a barrier).
"""

from __future__ import annotations

import threading
from concurrent.futures import ThreadPoolExecutor
from types import SimpleNamespace

from hosted_tinker.api.schemas import CreateSessionRequest
from hosted_tinker.api.service import create_session
from hosted_tinker.store.tables import Store


def test_concurrent_creates_with_one_idempotency_key_get_one_session(tmp_path):
    store = Store(tmp_path / "db.sqlite3")
    try:
        real_create = store.sessions.create
        both_inside = threading.Barrier(2, timeout=30)

        def create_when_both_are_inside(*args, **kwargs):
            both_inside.wait()
            return real_create(*args, **kwargs)

        store.sessions.create = create_when_both_are_inside
        server = SimpleNamespace(store=store)  # the route reads nothing else
        body = CreateSessionRequest(tags=[], user_metadata={}, sdk_version="0.38.0")

        def call(_):
            return create_session(body, owner="alice", x_idempotency_key="retry-1", server=server)

        with ThreadPoolExecutor(2) as pool:
            answers = list(pool.map(call, range(2)))
        assert answers[0] == answers[1]
        assert store.sessions.page("alice", 10, 0) == ([answers[0]["session_id"]], 1)

        store.sessions.create = real_create
        # The key is per owner, and it survives: a later retry gets the same session too.
        assert call(0) == answers[0]
        other = create_session(body, owner="bob", x_idempotency_key="retry-1", server=server)
        assert other["session_id"] != answers[0]["session_id"]
        no_key = [create_session(body, owner="alice", x_idempotency_key=None, server=server) for _ in range(2)]
        assert no_key[0] != no_key[1]
    finally:
        store.close()
