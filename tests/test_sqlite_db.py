"""`SQLiteDB` (issue 40, item 2): reads on each thread's own connection, writes batched on one writer,
a time budget for the queries a user shapes; real SQLite files, real threads, a real kill -9.

- A read held open mid-statement (its progress handler parked: `faults.gate` replaced in this process
  by an event the test sets, the server's gate without its FIFO) holds up neither writes nor other
  threads' reads, which see each write as soon as it returns.
- A budgeted query that would never end is stopped past the budget, naming `max_query_s`; the
  connection reads on afterwards.
- Writes queued while the writer is busy are committed in one transaction, and one that fails is
  undone alone.
- kill -9 of a process writing from eight threads at once loses no write that had returned.
"""

from __future__ import annotations

import subprocess
import sys
import threading
from pathlib import Path

import pytest

from helpers import WAIT, wait_until
from hosted_tinker import faults
from hosted_tinker.errors import QueryTooSlow
from hosted_tinker.store.database import SQLiteDB

REPO_ROOT = Path(__file__).resolve().parent.parent
ENDLESS = "WITH RECURSIVE n(x) AS (SELECT 1 UNION ALL SELECT x + 1 FROM n) SELECT x FROM n WHERE x < 0"


@pytest.fixture
def db(tmp_path):
    db = SQLiteDB(tmp_path / "db.sqlite3", query_budget_s=3600)
    db.create("CREATE TABLE IF NOT EXISTS t (id INTEGER PRIMARY KEY, v TEXT);")
    yield db
    db.close()


def test_a_read_held_open_holds_up_no_write_and_no_other_read(db, monkeypatch):
    db.executemany("INSERT INTO t(id, v) VALUES (?, ?)", [(i, "x" * 100) for i in range(5000)])
    reached, release = threading.Event(), threading.Event()

    def parked_gate(point: str) -> None:
        if point == "db.user_query" and not reached.is_set():
            reached.set()
            release.wait(WAIT)

    monkeypatch.setattr(faults, "gate", parked_gate)
    held: list = []
    reader = threading.Thread(target=lambda: held.append(
        db.one("SELECT COUNT(*) FROM t a JOIN t b ON a.id = b.id", budgeted=True)[0]))
    reader.start()
    try:
        assert reached.wait(WAIT), "the budgeted read never reached its first check"
        for i in range(5000, 5010):  # each write commits, and every thread reads it at once
            db.execute("INSERT INTO t(id, v) VALUES (?, 'new')", (i,))
            seen: list = []
            other = threading.Thread(target=lambda: seen.append(db.one("SELECT v FROM t WHERE id = ?", (i,))))
            other.start()
            other.join(WAIT)
            assert db.one("SELECT v FROM t WHERE id = ?", (i,))["v"] == "new" and seen[0]["v"] == "new"
        assert reader.is_alive() and not held  # all of it while the read was still running
    finally:
        release.set()
        reader.join(WAIT)
    assert held == [5000]  # the read saw the table as it was when its statement began


def test_a_budgeted_query_past_its_budget_is_stopped_naming_the_setting(tmp_path):
    db = SQLiteDB(tmp_path / "db.sqlite3", query_budget_s=0.05)
    try:
        with pytest.raises(QueryTooSlow, match=r"max_query_s = 0\.05 s"):
            db.all(ENDLESS, budgeted=True)  # it never ends by itself
        assert db.one("SELECT 1 + 1")[0] == 2
        assert db.one("SELECT COUNT(*) FROM (SELECT 1 UNION ALL SELECT 2)", budgeted=True)[0] == 2
    finally:
        db.close()


def test_writes_queued_behind_the_writer_commit_together_and_fail_alone(db):
    def failing(c):
        c.execute("INSERT INTO t(id, v) VALUES (3, 'undone')")
        raise ValueError("this write fails")

    outcomes: dict[int, object] = {}

    def write(n: int, run) -> None:
        try:
            outcomes[n] = db.write(run)
        except ValueError as e:
            outcomes[n] = e

    started, release = threading.Event(), threading.Event()
    busy = threading.Thread(target=write, args=(0, lambda c: started.set() or release.wait(WAIT)))
    busy.start()
    assert started.wait(WAIT)
    commits = db.commits
    threads = [threading.Thread(target=write, args=(1, lambda c: c.execute("INSERT INTO t VALUES (1, 'a')").rowcount)),
               threading.Thread(target=write, args=(2, lambda c: c.execute("INSERT INTO t VALUES (2, 'b')").rowcount)),
               threading.Thread(target=write, args=(3, failing))]
    for t in threads:  # the writer is busy with write 0: these queue behind it
        t.start()
    wait_until(lambda: db.pending_writes() == 3, "three writes queued")
    release.set()
    for t in [busy, *threads]:
        t.join(WAIT)
    assert db.commits == commits + 2  # write 0's transaction, then one for the three
    assert outcomes[1] == 1 and outcomes[2] == 1 and isinstance(outcomes[3], ValueError)
    assert [tuple(r) for r in db.all("SELECT id, v FROM t ORDER BY id")] == [(1, "a"), (2, "b")]


WRITER = """
import sys, threading
from pathlib import Path
from hosted_tinker.store.database import SQLiteDB

db = SQLiteDB(Path(sys.argv[1]))
db.create("CREATE TABLE IF NOT EXISTS t (id TEXT PRIMARY KEY);")
out = threading.Lock()

def writer(k):
    for n in range(10 ** 9):
        db.execute("INSERT INTO t(id) VALUES (?)", (f"{k}-{n}",))
        with out:
            print(f"{k}-{n}", flush=True)

for k in range(8):
    threading.Thread(target=writer, args=(k,)).start()
"""


def test_kill9_loses_no_write_that_returned(tmp_path):
    path = tmp_path / "db.sqlite3"
    child = subprocess.Popen([sys.executable, "-c", WRITER, str(path)], cwd=REPO_ROOT, stdout=subprocess.PIPE, text=True)
    try:
        returned = [child.stdout.readline().strip() for _ in range(2000)]
    finally:
        child.kill()  # SIGKILL
        child.wait(WAIT)
    returned += [line.strip() for line in child.stdout]  # printed before the kill, read only now
    child.stdout.close()
    db = SQLiteDB(path)
    try:
        stored = {r[0] for r in db.all("SELECT id FROM t")}
    finally:
        db.close()
    assert "" not in returned[:2000]
    assert set(filter(None, returned)) <= stored
