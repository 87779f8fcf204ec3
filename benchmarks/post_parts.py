"""What a training POST's own work is made of: each part timed alone, in this process (post_cost.py).

post_cost.py prints what a `forward_backward` and an `optim_step` POST cost this server's process in
CPU beside a server that does no work. This prints the parts of the difference, each the server's
own code or the same library call, timed N times in a row on this machine, as CPU (every thread of
this process) per operation:

- a hop to the thread pool and back (`run_in_threadpool` from an event loop): both POSTs take one,
  because the future's row is written to SQLite, which stays off the event loop (issue 12: a slow
  disk must not stall every other request; tests/test_event_loop.py);
- a wake of another thread (`threading.Event`, one way): the scheduler wakes the device loop;
- the future's row (`FutureTable.insert`: a transaction on the real SQLite in WAL mode), committed
  before the POST is answered so that the request id the client gets survives a restart;
- decoding the `forward_backward` body (`decode_forward_backward_request`) and parsing the
  `optim_step` body (its pydantic model): a malformed body gets its 400 from the POST itself;
- one access-log line (the server's text format, to a file).

These add up to most of the difference post_cost.py prints; what they cost is a property of the
machine they run on (on a 2-core VM a thread wake costs ~45 us of CPU).
"""

from __future__ import annotations

import asyncio
import json
import logging
import shutil
import statistics
import tempfile
import threading
import time
from collections.abc import Callable
from pathlib import Path


def cpu_us_per_op(run: Callable[[int], None], n: int, rounds: int) -> float:
    """Median over `rounds` of this process's CPU per operation, in us, of `run(n)` doing `n` of them."""
    per_round = []
    for _ in range(rounds):
        start = time.process_time_ns()
        run(n)
        per_round.append((time.process_time_ns() - start) / n / 1e3)
    return statistics.median(per_round)


def thread_hops(n: int) -> None:
    from fastapi.concurrency import run_in_threadpool

    async def hops() -> None:
        for _ in range(n):
            await run_in_threadpool(int)

    asyncio.run(hops())


def thread_wakes(n: int) -> None:
    """`n` wakes of one thread by another, as ping-pong (2 wakes a round trip)."""
    ping, pong = threading.Event(), threading.Event()

    def other() -> None:
        for _ in range(n // 2):
            ping.wait()
            ping.clear()
            pong.set()

    thread = threading.Thread(target=other)
    thread.start()
    for _ in range(n // 2):
        ping.set()
        pong.wait()
        pong.clear()
    thread.join()


def measure_parts(fb_body: bytes, *, n: int = 1000, rounds: int = 5) -> list[tuple[str, float]]:
    """(part, CPU us per operation) for each part above; `fb_body`: a forward_backward as the SDK sends it."""
    from hosted_tinker.api.schemas import OptimStepRequest
    from hosted_tinker.observability.logs import TEXT_FORMAT
    from hosted_tinker.store.tables import Store
    from hosted_tinker.wire.codec import decode_forward_backward_request

    tmp = Path(tempfile.mkdtemp(prefix="ht-post-parts-"))
    store = Store(tmp / "store.sqlite")
    handler = logging.FileHandler(tmp / "access.log")
    handler.setFormatter(logging.Formatter(TEXT_FORMAT))
    log = logging.getLogger("hosted_tinker.bench.post_parts")
    log.addHandler(handler)
    log.setLevel(logging.INFO)
    log.propagate = False
    seq = iter(range(1, 1 << 30))
    optim_body = json.dumps({"model_id": "m", "seq_id": 1, "type": "optim_step",
                             "adam_params": {"learning_rate": 1e-4}}).encode()

    def rows(k: int) -> None:
        for _ in range(k):
            s = next(seq)
            store.futures.insert(f"req-{s}", "owner", "optim_step", "m", s)

    def decodes(k: int) -> None:
        for _ in range(k):
            decode_forward_backward_request(fb_body, None, max_decompressed_bytes=1 << 28)

    def parses(k: int) -> None:
        for _ in range(k):
            OptimStepRequest.model_validate(json.loads(optim_body))

    def lines(k: int) -> None:
        for _ in range(k):
            log.info("request_id=%s method=%s route=%s status=%d ms=%.1f%s", "3f9a0c1d2e3b4a59", "POST",
                     "/api/v1/optim_step", 200, 1.0, "", extra={"route": "/api/v1/optim_step"})

    try:
        return [(name, cpu_us_per_op(run, n, rounds)) for name, run in (
            ("hop to the thread pool and back", thread_hops),
            ("wake of another thread (one way)", thread_wakes),
            ("the future's SQLite row", rows),
            ("decode the forward_backward body", decodes),
            ("parse the optim_step body", parses),
            ("one access-log line", lines))]
    finally:
        log.removeHandler(handler)
        handler.close()
        store.close()
        shutil.rmtree(tmp, ignore_errors=True)


def report_parts(parts: list[tuple[str, float]], floor_ms: float) -> None:
    """`floor_ms`: the no-work server's CPU per POST, measured beside (post_cost.py)."""
    print("\nwhat a POST's own work is made of (each part alone, in this process; CPU us per operation):")
    for name, us in parts:
        print(f"  {name:<40}{us:>8.0f}")
    cost = {name: us / 1e3 for name, us in parts}
    rules = cost["hop to the thread pool and back"] + cost["the future's SQLite row"]
    rules += cost["wake of another thread (one way)"]
    print(f"  every training POST takes a hop, writes its row and wakes the device loop ({rules:.3f} ms); with the"
          f" no-work server's floor ({floor_ms:.3f} ms)")
    print(f"  that is {floor_ms + rules:.3f} ms before anything else (goal <= 0.5)")
