"""The control plane at 10, 100 and 1,000 tenants: what the host costs per cycle, per request and per
idle client, with tiny steps on the embedded model so that the host is what is measured.

Per N (a fresh server each, N API keys with one training run each, all stepping at once, pipelined:
fb + optim posted, then both awaited):

  plan p50/p99     the scheduler's planning per cycle (`_plan`, timed inside the server)
  visits/plan      models a plan looked at (`_ready_prefix` calls): work, not time
  SQL/cycle        SQLite statements, transactions and bytes (statement text with its values) per
                   cycle, of the device loop's thread (the cycle's own) and of all threads
  CPU/request      server CPU (user + system, the whole process) per request, by route, each
                   route measured alone: heartbeats, retrieve_future of finished requests, and
                   forward_backward / optim_step POSTs queued behind a missing seq_id (so no
                   compute runs; the plan each one triggers is counted in)
  step p50/p99     the real SDK's pipelined step (`--sdk-clients` of the N runs use the `tinker`
                   SDK; the others are raw httpx clients that speak the SDK's routes, one event
                   loop, as 1,000 SDK clients in one process would not hold on 2 cores)

Then idle clients (`--idle`, raw httpx, as the SDK would: a session, a training run, a
forward_backward queued behind a missing seq_id, long-polled with retrieve_future, and a heartbeat
every 10 s) beside 10 stepping runs: the server's RSS and threads per idle client, and the per-cycle
numbers with and without them (nothing in a cycle should grow with idle runs).

The server-side counters come from benchmarks/control_plane_hook/ (a `sitecustomize` the server
process alone loads), which wraps the scheduler and sqlite3 from outside, so any revision is
measured alike: `--checkout DIR` runs the server from another checkout (e.g. a `git worktree` of
main). A benchmark: it prints, asserts nothing about time, exits 0. One command:

    .venv/bin/python benchmarks/control_plane.py [--runs 10,100,1000] [--idle 1000] [--checkout DIR]
"""

from __future__ import annotations

import argparse
import asyncio
import os
import random
import shutil
import signal
import socket
import statistics
import sys
import tempfile
import time
from pathlib import Path

os.environ.setdefault("TINKER_TELEMETRY", "0")
ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "tests"))
sys.path.insert(0, str(ROOT / "benchmarks"))

import httpx  # noqa: E402
import psutil  # noqa: E402

from bench_common import cpu_stall_us  # noqa: E402
from server_process import ServerProcess  # noqa: E402

BASE_MODEL = "hosted-tinker/tiny-qwen3-embedded"
HOOK_DIR = ROOT / "benchmarks" / "control_plane_hook"
TOKENS = 8  # per datum, one datum per forward_backward: the host's share is what is measured
HEARTBEAT_S = 10.0  # the SDK's session heartbeat period
CLIENTS_PER_POOL = 25  # raw clients sharing one httpx pool (HttpPools)
PROTO = {"Content-Type": "application/x-protobuf"}


def pct(xs: list[float], q: float) -> float:
    s = sorted(xs)
    return float("nan") if not s else s[min(len(s) - 1, int(q * (len(s) - 1) + 0.5))]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def fb_body(model_id: str, seq_id: int, seed: int) -> bytes:
    """A forward_backward as the SDK sends it (protobuf): one datum of TOKENS tokens."""
    from tinker import types
    from tinker.proto.request_conv import forward_backward_request_to_proto

    rng = random.Random(seed)
    toks = [rng.randrange(1, 200) for _ in range(TOKENS + 1)]
    datum = types.Datum(model_input=types.ModelInput.from_ints(toks[:-1]),
                        loss_fn_inputs={"target_tokens": toks[1:], "weights": [1.0] * TOKENS})
    request = types.ForwardBackwardRequest(model_id=model_id, seq_id=seq_id, forward_backward_input=(
        types.ForwardBackwardInput(data=[datum], loss_fn="cross_entropy")))
    return forward_backward_request_to_proto(request).SerializeToString()


class HttpPools:
    """httpx clients for many RawClients, CLIENTS_PER_POOL each. httpcore assigns every request by
    scanning each connection of its pool: one pool of 1,000 long-polling connections made this
    benchmark's own process the bottleneck (a core at 100 %, the server at 5 %; N=1000 never ended)."""

    def __init__(self, base_url: str):
        self.base_url, self.pools, self.handed = base_url, [], 0

    def next(self) -> httpx.AsyncClient:
        if self.handed % CLIENTS_PER_POOL == 0:
            self.pools.append(httpx.AsyncClient(base_url=self.base_url, timeout=600,
                                                limits=httpx.Limits(max_connections=None)))
        self.handed += 1
        return self.pools[-1]

    async def __aenter__(self) -> "HttpPools":
        return self

    async def __aexit__(self, *exc) -> None:
        for pool in self.pools:
            await pool.aclose()


class RawClient:
    """One API key's client over a shared httpx pool, speaking the SDK's routes."""

    def __init__(self, http: httpx.AsyncClient, key: str):
        self.http, self.headers = http, {"X-API-Key": key}
        self.session_id = self.model_id = ""
        self.seq = 0
        self.last_request = ""  # the last step's forward_backward, finished

    async def post(self, route: str, body: dict | None = None, *, content: bytes | None = None) -> dict:
        headers = self.headers if content is None else {**self.headers, **PROTO}
        for attempt in range(5):  # as the SDK does: a kept-alive connection the server just closed
            try:
                r = await self.http.post(f"/api/v1/{route}", json=body, content=content, headers=headers)
                break
            except (httpx.ReadError, httpx.RemoteProtocolError, httpx.ConnectError):
                if attempt == 4:
                    raise
                await asyncio.sleep(0.1 * (attempt + 1))
        r.raise_for_status()
        return r.json() if r.headers.get("content-type", "").startswith("application/json") else {}

    async def result(self, request_id: str) -> dict:
        while True:
            out = await self.post("retrieve_future", {"request_id": request_id})
            if out.get("type") != "try_again":
                return out

    async def open(self, with_run: bool = True) -> None:
        self.session_id = (await self.post("create_session", {"sdk_version": "0.38.0"}))["session_id"]
        if with_run:
            await self.create_run()

    async def create_run(self) -> None:
        ref = await self.post("create_model", {"session_id": self.session_id, "model_seq_id": 0,
                                               "base_model": BASE_MODEL, "lora_config": {"rank": 1}})
        self.model_id = ref["model_id"]
        await self.result(ref["request_id"])

    async def step(self) -> float:
        t = time.perf_counter()
        fb = await self.post("forward_backward", content=fb_body(self.model_id, self.seq + 1, self.seq))
        opt = await self.post("optim_step", {"model_id": self.model_id, "seq_id": self.seq + 2,
                                             "adam_params": {"learning_rate": 1e-4}})
        self.seq += 2
        await asyncio.gather(self.result(fb["request_id"]), self.result(opt["request_id"]))
        self.last_request = fb["request_id"]
        return time.perf_counter() - t


class SDKClient:
    """A real `tinker` SDK training client (its steps run on a thread of their own)."""

    def __init__(self, server: ServerProcess, key: str):
        from tinker import types

        self.types = types
        self.tc = server.client(key).create_lora_training_client(base_model=BASE_MODEL, rank=1).result()
        rng = random.Random(key)
        toks = [rng.randrange(1, 200) for _ in range(TOKENS + 1)]
        self.data = [types.Datum(model_input=types.ModelInput.from_ints(toks[:-1]),
                                 loss_fn_inputs={"target_tokens": toks[1:], "weights": [1.0] * TOKENS})]

    def step(self) -> float:
        t = time.perf_counter()
        fb = self.tc.forward_backward(self.data, "cross_entropy")
        opt = self.tc.optim_step(self.types.AdamParams(learning_rate=1e-4))
        fb.result()
        opt.result()
        return time.perf_counter() - t


class Server:
    """A server process with the hook, and what the benchmark reads of it."""

    def __init__(self, tmp: Path, name: str, checkout: Path, extra: list[str]):
        self.hook_port = free_port()
        env = {"CONTROL_PLANE_HOOK_PORT": str(self.hook_port),
               "PYTHONPATH": os.pathsep.join([str(HOOK_DIR), os.environ.get("PYTHONPATH", "")])}
        self.proc = ServerProcess(tmp / name, env=env, checkout=checkout, args=("--gap-timeout-s", "3600", *extra))
        try:
            self.proc.start()
        except BaseException:  # a kill while it starts: the process is ended all the same
            self.proc.stop()
            raise
        self.ps = psutil.Process(self.proc.proc.pid)

    def hook(self, since: int = 0) -> dict:
        return httpx.get(f"http://127.0.0.1:{self.hook_port}/?since={since}", timeout=30).json()

    def cpu(self) -> float:
        t = self.ps.cpu_times()
        return t.user + t.system

    def stop(self) -> None:
        self.proc.stop()


async def gather_limited(coros, limit: int = 32) -> list:
    sem = asyncio.Semaphore(limit)

    async def one(c):
        async with sem:
            return await c

    return await asyncio.gather(*(one(c) for c in coros))


def cycle_numbers(before: dict, after: dict) -> dict:
    """Per cycle between two hook snapshots: plan p50/p99 (ms), visits per plan, SQLite per cycle."""
    plans = after["plans"]
    cycles = [s for s, made in plans if made] or [float("nan")]
    n = max(1, len(cycles))
    out = {"cycles": len(cycles), "plan_p50": 1000 * pct(cycles, 0.5), "plan_p99": 1000 * pct(cycles, 0.99),
           "visits": (after["visits"] - before["visits"]) / max(1, len(plans))}
    for side in ("device", "other"):
        for k in ("statements", "transactions", "bytes"):
            out[f"{side}_{k}"] = (after["sql"][side][k] - before["sql"][side][k]) / n
    return out


async def step_rounds(raw: list[RawClient], sdk: list[SDKClient], rounds: int) -> tuple[list[float], list[float]]:
    """`rounds` rounds of every client stepping at once; (SDK step seconds, raw step seconds)."""
    sdk_times: list[float] = []
    raw_times: list[float] = []
    for _ in range(rounds):
        sdk_steps = [asyncio.to_thread(c.step) for c in sdk]
        results = await asyncio.gather(*sdk_steps, gather_limited([c.step() for c in raw], limit=len(raw) or 1))
        sdk_times += results[:len(sdk)]
        raw_times += results[-1] if raw else []
    return sdk_times, raw_times


async def route_costs(srv: Server, clients: list[RawClient], count: int) -> dict[str, tuple[float, float]]:
    """Per route, measured alone: (server CPU ms per request, median latency ms)."""
    gapped = {c.model_id: c.seq + 1 for c in clients}  # seq_id seq + 1 never sent: all stay queued

    def next_seq(c: RawClient) -> int:
        gapped[c.model_id] += 1
        return gapped[c.model_id]

    routes = {
        "session_heartbeat": lambda c, i: c.post("session_heartbeat", {"session_id": c.session_id}),
        "retrieve_future (done)": lambda c, i: c.post("retrieve_future", {"request_id": c.last_request}),
        "forward_backward": lambda c, i: c.post("forward_backward", content=fb_body(c.model_id, next_seq(c), i)),
        "optim_step": lambda c, i: c.post("optim_step", {"model_id": c.model_id, "seq_id": next_seq(c),
                                                         "adam_params": {"learning_rate": 1e-4}}),
    }
    out = {}
    for route, call in routes.items():
        await asyncio.sleep(0.5)  # the device loop's plans of the last phase are done
        lat: list[float] = []

        async def timed(c, i, call=call, lat=lat):
            t = time.perf_counter()
            await call(c, i)
            lat.append(time.perf_counter() - t)

        cpu, hook = srv.cpu(), srv.hook()
        await gather_limited([timed(clients[i % len(clients)], i) for i in range(count)], limit=8)
        cpu, sql = srv.cpu() - cpu, srv.hook(hook["plan_count"])["sql"]
        writes = sum(sql[side]["transactions"] - hook["sql"][side]["transactions"] for side in sql)
        out[route] = (1000 * cpu / count, 1000 * statistics.median(lat), writes / count)
    return out


async def measure_n(args, tmp: Path, n: int) -> dict:
    srv = Server(tmp, f"n{n}", args.checkout, args.server_arg)
    try:
        async with HttpPools(srv.proc.base_url) as http:
            k_sdk = min(n, args.sdk_clients)
            sdk = await gather_limited([asyncio.to_thread(SDKClient, srv.proc, f"tml-cp-sdk-{i}")
                                        for i in range(k_sdk)], limit=4)
            raw = [RawClient(http.next(), f"tml-cp-{n}-{i}") for i in range(n - k_sdk)]
            await gather_limited([c.open() for c in raw])
            await step_rounds(raw, sdk, 1)  # warm-up
            before = srv.hook()
            sdk_t, raw_t = await step_rounds(raw, sdk, args.rounds)
            out = cycle_numbers(before, srv.hook(before["plan_count"]))
            out.update(sdk_p50=1000 * pct(sdk_t, 0.5), sdk_p99=1000 * pct(sdk_t, 0.99),
                       raw_p50=1000 * pct(raw_t, 0.5), raw_p99=1000 * pct(raw_t, 0.99), steps=len(sdk_t) + len(raw_t))
            extra = [RawClient(http.next(), f"tml-cp-{n}-route-{i}") for i in range(max(0, 10 - len(raw)))]
            await gather_limited([c.open() for c in extra])
            await step_rounds(extra, [], 1)  # each has a finished request to retrieve
            out["routes"] = await route_costs(srv, raw + extra, args.route_requests)
            return out
    finally:
        srv.stop()


async def idle_client(c: RawClient, stop: asyncio.Event) -> None:
    """An idle SDK client: a request queued behind a missing seq_id, long-polled, and heartbeats."""
    ref = await c.post("forward_backward", content=fb_body(c.model_id, 2, 0))

    async def heartbeats():
        await asyncio.sleep(random.uniform(0, HEARTBEAT_S))
        while not stop.is_set():
            await c.post("session_heartbeat", {"session_id": c.session_id})
            await asyncio.sleep(HEARTBEAT_S)

    beat = asyncio.create_task(heartbeats())
    try:
        while not stop.is_set():
            poll = asyncio.create_task(c.post("retrieve_future", {"request_id": ref["request_id"]}))
            stopping = asyncio.create_task(stop.wait())
            await asyncio.wait({poll, stopping}, return_when=asyncio.FIRST_COMPLETED)
            if not poll.done():
                poll.cancel()
            stopping.cancel()
    finally:
        beat.cancel()


async def measure_idle(args, tmp: Path) -> dict:
    srv = Server(tmp, "idle", args.checkout, args.server_arg)
    out: dict = {}
    try:
        async with HttpPools(srv.proc.base_url) as http:
            sdk = [await asyncio.to_thread(SDKClient, srv.proc, f"tml-cp-idle-sdk-{i}") for i in range(2)]
            active = [RawClient(http.next(), f"tml-cp-active-{i}") for i in range(8)]
            await gather_limited([c.open() for c in active])
            await step_rounds(active, sdk, 1)
            before = srv.hook()
            sdk_t, _ = await step_rounds(active, sdk, args.rounds)
            out["without"] = cycle_numbers(before, srv.hook(before["plan_count"]))
            out["without"].update(sdk_p50=1000 * pct(sdk_t, 0.5), sdk_p99=1000 * pct(sdk_t, 0.99))
            rss0, threads0 = srv.ps.memory_info().rss, srv.ps.num_threads()
            idle = [RawClient(http.next(), f"tml-cp-idle-{i}") for i in range(args.idle)]
            await gather_limited([c.open(with_run=False) for c in idle])
            rss1 = srv.ps.memory_info().rss
            await gather_limited([c.create_run() for c in idle])
            rss2 = srv.ps.memory_info().rss
            stop = asyncio.Event()
            tasks = [asyncio.create_task(idle_client(c, stop)) for c in idle]
            await asyncio.sleep(HEARTBEAT_S + 5)  # every idle client has polled and sent a heartbeat
            rss3, threads3 = srv.ps.memory_info().rss, srv.ps.num_threads()
            before = srv.hook()
            sdk_t, _ = await step_rounds(active, sdk, args.rounds)
            out["with"] = cycle_numbers(before, srv.hook(before["plan_count"]))
            out["with"].update(sdk_p50=1000 * pct(sdk_t, 0.5), sdk_p99=1000 * pct(sdk_t, 0.99))
            stop.set()
            await asyncio.gather(*tasks, return_exceptions=True)
            out["memory"] = {"sessions": (rss1 - rss0) / args.idle, "runs": (rss2 - rss1) / args.idle,
                             "polls": (rss3 - rss2) / args.idle, "threads": (threads0, threads3)}
            return out
    finally:
        srv.stop()


HEAD = (f"{'N':>8}{'cycles':>8}{'plan p50':>10}{'plan p99':>10}{'visits/plan':>12}{'dev SQL/cyc':>12}"
        f"{'dev txn/cyc':>12}{'dev KB/cyc':>11}{'all SQL/cyc':>12}{'SDK p50':>9}{'SDK p99':>9}{'raw p50':>9}"
        f"{'raw p99':>9}")
ROUTES = ("session_heartbeat", "retrieve_future (done)", "forward_backward", "optim_step")


def row(label: str, r: dict) -> str:
    return (f"{label:>8}{r['cycles']:>8}{r['plan_p50']:>10.3f}{r['plan_p99']:>10.3f}{r['visits']:>12.1f}"
            f"{r['device_statements']:>12.1f}{r['device_transactions']:>12.1f}{r['device_bytes'] / 1024:>11.1f}"
            f"{r['other_statements'] + r['device_statements']:>12.1f}{r['sdk_p50']:>9.1f}{r['sdk_p99']:>9.1f}"
            f"{r.get('raw_p50', float('nan')):>9.1f}{r.get('raw_p99', float('nan')):>9.1f}")


def route_row(label: str, r: dict) -> str:
    return f"{label:>8}" + "".join(f"{r['routes'][k][0]:>12.2f} ({r['routes'][k][1]:>5.1f}) {r['routes'][k][2]:>4.1f}"
                                   for k in ROUTES)


def memory_line(args, m: dict) -> str:
    return (f"idle clients ({args.idle}, raw httpx): server RSS per idle client: session {m['sessions'] / 1024:.1f} KB,"
            f" its training run {m['runs'] / 1024:.1f} KB, its long-poll + heartbeats {m['polls'] / 1024:.1f} KB;"
            f" server threads {m['threads'][0]} -> {m['threads'][1]}")


def report(args, per_n: dict[int, dict], idle: dict | None, busy: float | None) -> None:
    """Every table again, together (each row was printed as it was measured)."""
    print()
    print(f"per N training runs (N keys), all stepping pipelined, {args.rounds} rounds, {TOKENS}-token steps, "
          f"rank 1, embedded model; server {args.checkout}")
    print(HEAD)
    for n, r in per_n.items():
        print(row(str(n), r))
    if idle is not None:
        print(row("10", idle["without"]))
        print(row(f"10+{args.idle}i", idle["with"]))
    print("  plan: ms per cycle's plan; visits: models a plan looked at; dev: the device loop thread's SQLite per"
          " cycle (statements, transactions, KB of statement text with values); all: every thread's statements"
          " per cycle; SDK/raw: pipelined step ms")
    print(f"  10+{args.idle}i: 10 runs (2 of them SDK) beside {args.idle} idle clients (each run blocked on a"
          " missing seq_id, long-polled)")
    print()
    print(f"server CPU ms per request (median latency ms) SQLite write transactions per request, by route, "
          f"{args.route_requests} requests each, 8 at once")
    print(f"{'N':>8}" + "".join(f"{r:>25}" for r in ROUTES))
    for n, r in per_n.items():
        print(route_row(str(n), r))
    if len(per_n) > 1:
        (n0, first), (n1, last) = next(iter(per_n.items())), list(per_n.items())[-1]
        print(f"  CPU per request at N={n1} / N={n0}: "
              + ", ".join(f"{k} {last['routes'][k][0] / first['routes'][k][0]:.2f}x" for k in ROUTES)
              + "  (goal <= 1.5x)")
    if idle is not None:
        print()
        print(memory_line(args, idle["memory"]))
    if busy is not None:
        print(f"CPU pressure during the run: {100 * busy:.0f}% of the time some task waited for a CPU "
              "(timings are not reliable above ~25%; counts are)")


async def run_all(args, tmp: Path) -> tuple[dict, dict | None]:
    """N in order, the idle clients before the largest N (the longest part): each printed when measured."""
    per_n: dict[int, dict] = {}
    idle = None
    print(HEAD, flush=True)
    for n in args.runs:
        if n == max(args.runs) and args.idle and idle is None:
            idle = await measure_idle(args, tmp)
            print(row("10", idle["without"]) + "\n" + row(f"10+{args.idle}i", idle["with"]) + "\n"
                  + memory_line(args, idle["memory"]), flush=True)
        t = time.perf_counter()
        per_n[n] = await measure_n(args, tmp, n)
        print(row(str(n), per_n[n]) + f"   ({time.perf_counter() - t:.0f}s)\n" + route_row(str(n), per_n[n]),
              flush=True)
    return per_n, idle


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--runs", default="10,100,1000", help="training runs (and keys) per measurement")
    ap.add_argument("--idle", type=int, default=1000, help="idle clients beside 10 runs (0: skip)")
    ap.add_argument("--rounds", type=int, default=5, help="measured step rounds per N (default 5)")
    ap.add_argument("--sdk-clients", type=int, default=4, help="runs driven by the real SDK (default 4)")
    ap.add_argument("--route-requests", type=int, default=400, help="requests per route for CPU/request")
    ap.add_argument("--checkout", type=Path, default=ROOT, help="run the server from this checkout")
    ap.add_argument("--server-arg", action="append", default=[], help="extra `serve` argument, repeatable")
    args = ap.parse_args()
    args.runs = [int(x) for x in args.runs.split(",")]
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # a kill stops the servers too (finally blocks)
    tmp = Path(tempfile.mkdtemp(prefix="ht-control-plane-"))
    stall0, wall0 = cpu_stall_us(), time.monotonic()
    try:
        per_n, idle = asyncio.run(run_all(args, tmp))
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    stall1 = cpu_stall_us()
    busy = None if stall0 is None or stall1 is None else (stall1 - stall0) / 1e6 / (time.monotonic() - wall0)
    report(args, per_n, idle, busy)
    return 0


if __name__ == "__main__":
    sys.exit(main())
