"""One key's query never holds up another key (issue 40, item 2), against a real server process.

- A search of Alice's is held mid-statement by a gate (faults.gate "db.user_query", at its first time
  budget check: its read open on its thread's connection). Meanwhile Bob lists his sessions, trains a
  step, creates a session and sees it in his next listing. (On f62a3dc every statement ran on one
  connection under one lock: Bob's listing waited for hers.)
- Held past `max_query_s` (the test sleeps past it before it opens the gate), her search is stopped at
  its next check and refused with a 400 naming the setting. (Bob's small listings never reach a check.)

- Name words and listing pages are bounded; a database from before the metadata index gets it filled.

tests/test_sqlite_db.py has the connections' own tests (batched writes, kill -9, read-your-writes).

The benchmark of the same (numbers, not assertions): benchmarks/db_contention.py.
"""

from __future__ import annotations

import os
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest
import tinker
from tinker import types

from helpers import BASE_MODEL, TEAM, WAIT, open_gate, sft_batch
from hosted_tinker import faults
from hosted_tinker.store.tables import Store
from hosted_tinker.store.search import SessionFilter, SessionSearch
from server_process import ServerProcess

pytestmark = [pytest.mark.e2e, pytest.mark.filterwarnings("ignore::FutureWarning")]  # search is "experimental"
ALICE, BOB = "tml-alice-db-contention", "tml-bob-db-contention"
# 20 sessions x 64 pairs, all matching: tens of thousands of SQLite steps, so the search surely reaches
# its first budget check (every 1,000 steps), where the gate is.
PAIRS = {f"key{i:02d}": f"value {i}" for i in range(64)}
SESSIONS = 20


def create_session(srv: ServerProcess, key: str, metadata: dict, name: str) -> str:
    r = httpx.post(f"{srv.base_url}/api/v1/create_session", headers={"X-API-Key": key}, timeout=60,
                   json={"tags": [], "user_metadata": metadata, "display_name": name, "sdk_version": "0.38.0"})
    r.raise_for_status()
    return r.json()["session_id"]


def gated_server(tmp_path, query_budget_s: float) -> tuple[ServerProcess, object]:
    gates = tmp_path / "gates"
    gates.mkdir()
    os.mkfifo(gates / "db.user_query")
    srv = ServerProcess(tmp_path / "srv", env={"HOSTED_TINKER_MAX_QUERY_S": str(query_budget_s),
                                               faults.ENV_VAR: "db.user_query:1", faults.GATES_VAR: str(gates)})
    return srv.start(), gates / "db.user_query"


def search_all_pairs(srv: ServerProcess):
    rest = tinker.RestClient(base_url=srv.base_url, api_key=ALICE)
    return rest.search_sessions(types.SessionSearchRequest(user_metadata=PAIRS, limit=50)).result(timeout=WAIT)


def test_a_search_held_mid_read_holds_up_no_other_key_and_is_stopped_past_its_budget(tmp_path):
    budget_s = 0.2
    srv, gate = gated_server(tmp_path, query_budget_s=budget_s)
    try:
        for i in range(SESSIONS):
            create_session(srv, ALICE, PAIRS, f"run {i}")
        with srv.client(BOB) as bob, ThreadPoolExecutor(1) as pool:
            bob_rest = tinker.RestClient(base_url=srv.base_url, api_key=BOB)
            training = bob.create_lora_training_client(base_model=BASE_MODEL, rank=4).result(timeout=WAIT)
            held = pool.submit(search_all_pairs, srv)
            with open_gate(gate):  # Alice's search is at the gate now, its statement running, its clock too
                before = bob_rest.list_sessions().result(timeout=WAIT).sessions
                fb = training.forward_backward(sft_batch(2), "cross_entropy")
                step = training.optim_step(types.AdamParams(learning_rate=1e-3))
                assert fb.result(timeout=WAIT).metrics and step.result(timeout=WAIT) is not None
                new = create_session(srv, BOB, {"note": "made while a search read"}, "bob's")
                after = bob_rest.list_sessions().result(timeout=WAIT).sessions
                assert new not in before and after[0] == new  # his write, committed, seen by his next read
                assert not held.done()  # all of it while Alice's search was still reading
                time.sleep(2 * budget_s)  # her search is past its budget by construction, not by luck
            with pytest.raises(tinker.BadRequestError) as refused:  # stopped at its next check
                held.result(timeout=WAIT)
        assert refused.value.status_code == 400
        assert "max_query_s = 0.2 s" in str(refused.value), refused.value
    finally:
        srv.stop()


def test_what_a_user_shapes_is_bounded(team_server):
    """Name words and listing pages have bounds, each refused naming its field (the time budget is the
    last line of defence, not the first)."""
    rest = tinker.RestClient(base_url=team_server.base_url, api_key=TEAM["alice"])
    words = " ".join(f"w{i}" for i in range(17))
    with pytest.raises(tinker.BadRequestError, match="display_name: at most 16 words"):
        rest.search_sessions(types.SessionSearchRequest(display_name=words)).result(timeout=WAIT)
    assert rest.search_sessions(types.SessionSearchRequest(display_name=words[:words.index(" w16")])).result(
        timeout=WAIT).sessions == []
    for page in (lambda: rest.list_training_runs(limit=1001), lambda: rest.list_user_checkpoints(limit=1001),
                 lambda: rest.list_sessions(limit=1001)):
        with pytest.raises(tinker.UnprocessableEntityError, match="limit"):
            page().result(timeout=WAIT)
    assert rest.list_sessions(limit=1000).result(timeout=WAIT) is not None


def test_sessions_stored_before_the_metadata_index_are_found_by_it(tmp_path):
    """A database from before `session_metadata` (made here by dropping it) gets it filled at the next
    start, in one transaction: a metadata filter then finds the older sessions."""
    store = Store(tmp_path / "db.sqlite3")
    store.sessions.create("sess-old", "alice", [], {"team": "nlp", "n": 3, "nested": {"team": "nlp"}}, "old", None)
    store.db.execute("DROP TABLE session_metadata")
    store.close()
    store = Store(tmp_path / "db.sqlite3")
    try:
        search = SessionSearch(store.db)

        def found(metadata: dict) -> list[str]:
            return [f.record.session_id for f in search.find(SessionFilter(
                caller="alice", owners=None, session_id=None, name_words=(), metadata=metadata, projects=None,
                statuses=None, limit=10, after=None))]

        assert found({"team": "nlp"}) == ["sess-old"]
        assert found({"n": "3"}) == [] and found({"nested": "{\"team\": \"nlp\"}"}) == []  # text values only, as before
    finally:
        store.close()
