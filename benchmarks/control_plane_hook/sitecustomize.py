"""The control-plane benchmark's counters inside a server process (benchmarks/control_plane.py).

Python imports `sitecustomize` at start-up from the first directory of PYTHONPATH that has one;
the benchmark starts its servers with this directory there and CONTROL_PLANE_HOOK_PORT set, and
nothing else ever does. It wraps, from outside the server's code, so that any revision can be
measured the same way:

* `ClockCycleScheduler._plan`: each plan's duration (the planning alone, under the scheduler's
  lock) and whether it made a cycle; `_ready_prefix`: one call per model a plan visits;
* every SQLite connection (`sqlite3.connect`): each statement executed (a trace callback), its
  text with its values (the bytes SQLite is handed), and the transactions, by thread: the device
  loops' (a cycle's own writes) or the others' (HTTP requests, flushers);

and serves them as JSON on 127.0.0.1:CONTROL_PLANE_HOOK_PORT (`GET /?since=K`: the plan durations
from the K-th on, and every counter).
"""

from __future__ import annotations

import json
import os
import sqlite3
import sys
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from urllib.parse import parse_qs, urlparse

WRITES = ("INSERT", "UPDATE", "DELETE", "REPLACE")


class Counters:
    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.plans: list[tuple[float, bool]] = []  # (seconds, made a cycle)
        self.visits = 0
        self.sql = {side: {"statements": 0, "writes": 0, "bytes": 0, "transactions": 0}
                    for side in ("device", "other")}
        self.in_transaction: dict[int, bool] = {}

    def statement(self, sql: str) -> None:
        side = "device" if threading.current_thread().name.startswith("device-loop") else "other"
        head = sql.lstrip()[:8].upper()
        with self.lock:
            c = self.sql[side]
            c["statements"] += 1
            c["bytes"] += len(sql)
            tid = threading.get_ident()
            if head.startswith("BEGIN"):
                self.in_transaction[tid] = True
            elif head.startswith(("COMMIT", "ROLLBACK", "END")):
                self.in_transaction[tid] = False
                c["transactions"] += 1
            elif head.startswith(WRITES):
                c["writes"] += 1
                if not self.in_transaction.get(tid):
                    c["transactions"] += 1  # autocommit: a transaction of its own

    def snapshot(self, since: int) -> dict:
        with self.lock:
            return {"plans": self.plans[since:], "plan_count": len(self.plans), "visits": self.visits,
                    "sql": json.loads(json.dumps(self.sql))}


COUNTERS = Counters()


def _wrap_sqlite() -> None:
    connect = sqlite3.connect

    def counted_connect(*args, **kwargs):
        connection = connect(*args, **kwargs)
        connection.set_trace_callback(COUNTERS.statement)
        return connection

    sqlite3.connect = counted_connect


def _wrap_scheduler() -> None:
    sys.path.insert(0, os.getcwd())  # the server runs `python -m hosted_tinker` in its checkout
    from hosted_tinker.training.scheduler import ClockCycleScheduler

    plan, visit = ClockCycleScheduler._plan, ClockCycleScheduler._ready_prefix

    def timed_plan(self):
        start = time.perf_counter()
        out = plan(self)
        seconds = time.perf_counter() - start
        with COUNTERS.lock:
            COUNTERS.plans.append((seconds, bool(out[0])))
        return out

    def counted_visit(self, *args, **kwargs):
        COUNTERS.visits += 1  # under the scheduler's lock
        return visit(self, *args, **kwargs)

    ClockCycleScheduler._plan, ClockCycleScheduler._ready_prefix = timed_plan, counted_visit


class _Handler(BaseHTTPRequestHandler):
    def do_GET(self) -> None:  # noqa: N802 (http.server's name)
        since = int(parse_qs(urlparse(self.path).query).get("since", ["0"])[0])
        body = json.dumps(COUNTERS.snapshot(since)).encode()
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *args) -> None:
        pass


def _serve(port: int) -> None:
    server = ThreadingHTTPServer(("127.0.0.1", port), _Handler)
    threading.Thread(target=server.serve_forever, name="control-plane-hook", daemon=True).start()


if os.environ.get("CONTROL_PLANE_HOOK_PORT"):
    _wrap_sqlite()
    _wrap_scheduler()
    _serve(int(os.environ["CONTROL_PLANE_HOOK_PORT"]))
