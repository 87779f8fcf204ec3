"""One key's heavy session search against another key's listing and `forward` (issue 40, item 2).

Key A owns `--sessions` sessions, each with `--metadata-keys` user_metadata pairs of ~62 KB in all,
and runs `search_sessions` with every one of those pairs as a filter (each session matches all of
them), `--loops` such searches back to back at once, from a process of its own. Key B lists its
sessions (`RestClient.list_sessions`) and runs `TrainingClient.forward` on one datum, alternately,
through the real `tinker` SDK against a real `hosted_tinker serve` process, in blocks of `--samples`
each: with A's searches paused (idle) and running (loaded), the two kinds of block alternating for
`--rounds` rounds so that a shared box's drift falls on both alike. Prints B's round trips, p50 and
p99, idle and loaded, and their ratio (goal: within 2x), plus A's searches: how many ran, how long
they took and how many were refused (4xx).

    .venv/bin/python benchmarks/db_contention.py [--old REV] [--sessions 400] [--loops 1] \
        [--rounds 6] [--samples 4] [--max-s 300] [--page 50]

`--old REV` runs the same first on REV's code (taken with `git archive`, one server after the
other, never at once), then on this checkout, and prints both tables. A benchmark, not a test: it
asserts nothing about time and exits 0.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import threading
import time
import warnings
from pathlib import Path

os.environ.setdefault("TINKER_TELEMETRY", "0")

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "tests"))
sys.path.insert(0, str(ROOT / "benchmarks"))

import httpx  # noqa: E402
import numpy as np  # noqa: E402
import tinker  # noqa: E402
from tinker import types  # noqa: E402

from bench_common import cpu_stall_us  # noqa: E402
from hosted_tinker.models.embedded import EMBEDDED_MODEL_NAME  # noqa: E402
from server_process import ServerProcess  # noqa: E402

warnings.filterwarnings("ignore", category=tinker.ExperimentalWarning)  # search_sessions says so on every call

KEY_A, KEY_B = "tml-bench-searcher", "tml-bench-bystander"
VALUE_CHARS = 960  # 64 of these: ~62 KB of user_metadata per session


def metadata(keys: int) -> dict[str, str]:
    return {f"key{i:02d}": f"{i:02d}" + "v" * (VALUE_CHARS - 2) for i in range(keys)}


def populate(server: ServerProcess, sessions: int, keys: int) -> None:
    """Key A's sessions, created over HTTP as the SDK's create_session does (setup, not measured)."""
    body = {"tags": [], "user_metadata": metadata(keys), "sdk_version": tinker.__version__}
    with httpx.Client(base_url=server.base_url, headers={"X-API-Key": KEY_A}, timeout=120) as http:
        for i in range(sessions):
            r = http.post("/api/v1/create_session", json={**body, "display_name": f"bench {i}"})
            r.raise_for_status()


def rest_client(base_url: str, key: str) -> tinker.RestClient:
    return tinker.RestClient(base_url=base_url, api_key=key)


class Searcher:
    """Key A's client, in a process of its own (as another user's machine would be: its SDK's parsing
    of the pages shares nothing with key B's client): `--loops` threads, each running the search back
    to back while told to run. Driven over its stdin/stdout, one line per command and answer."""

    def __init__(self, base_url: str, args):
        cmd = [sys.executable, __file__, "--searcher", base_url, "--loops", str(args.loops),
               "--metadata-keys", str(args.metadata_keys), "--page", str(args.page)]
        self.proc = subprocess.Popen(cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, bufsize=1)

    def tell(self, command: str) -> str:
        self.proc.stdin.write(command + "\n")
        return self.proc.stdout.readline().strip()

    def run(self) -> None:
        assert self.tell("run") == "running"  # a search of each loop has been answered since

    def pause(self) -> None:
        assert self.tell("pause") == "paused"  # no search in flight

    def results(self) -> dict:
        out = json.loads(self.tell("quit"))
        self.proc.wait(60)
        return out


def searcher_main(base_url: str, loops: int, keys: int, page: int) -> None:
    """The searcher process: `run`, `pause`, `quit` on stdin; answers on stdout."""
    request = types.SessionSearchRequest(user_metadata=metadata(keys), limit=page)
    go, lock = threading.Event(), threading.Condition()
    state = {"times": [], "refused": [], "in_flight": 0, "answered": 0}

    def loop() -> None:
        rest = rest_client(base_url, KEY_A)
        while True:
            go.wait()
            with lock:
                if not go.is_set():
                    continue
                state["in_flight"] += 1
            t = time.perf_counter()
            try:
                rest.search_sessions(request).result()
                state["times"].append(time.perf_counter() - t)
            except tinker.APIStatusError as e:  # a 4xx: the server refused the query (a bound, its budget)
                state["refused"].append(f"{e.status_code}: {str(e)[:200]}")
            with lock:
                state["in_flight"] -= 1
                state["answered"] += 1
                lock.notify_all()

    for _ in range(loops):
        threading.Thread(target=loop, daemon=True).start()
    for command in sys.stdin:
        command = command.strip()
        if command == "run":
            with lock:
                target = state["answered"] + loops
                go.set()
                lock.wait_for(lambda: state["answered"] >= target)
            print("running", flush=True)
        elif command == "pause":
            with lock:
                go.clear()
                lock.wait_for(lambda: state["in_flight"] == 0)
            print("paused", flush=True)
        elif command == "quit":
            print(json.dumps({"times": state["times"], "refused": state["refused"]}), flush=True)
            return


def measure(rest, tc, datum, samples: int) -> dict[str, list[float]]:
    """B's round trips, listing and forward alternately, `samples` of each."""
    out: dict[str, list[float]] = {"list_sessions": [], "forward": []}
    for _ in range(samples):
        t = time.perf_counter()
        rest.list_sessions().result()
        out["list_sessions"].append(time.perf_counter() - t)
        t = time.perf_counter()
        tc.forward([datum], "cross_entropy").result()
        out["forward"].append(time.perf_counter() - t)
    return out


def pct(xs: list[float], q: float) -> float:
    return float(np.percentile(xs, q)) * 1000


def run(label: str, tree: Path, data_dir: Path, args) -> dict:
    server = ServerProcess(data_dir, checkout=tree).start()
    try:
        t = time.perf_counter()
        populate(server, args.sessions, args.metadata_keys)
        setup_s = time.perf_counter() - t
        sc = server.client(KEY_B, user_metadata={"who": "bystander"})
        rest = rest_client(server.base_url, KEY_B)
        tc = sc.create_lora_training_client(base_model=EMBEDDED_MODEL_NAME, rank=4).result()
        tokens = list(range(1, 33))
        datum = types.Datum(model_input=types.ModelInput.from_ints(tokens[:-1]),
                            loss_fn_inputs={"target_tokens": tokens[1:], "weights": [1.0] * 31})
        measure(rest, tc, datum, 3)  # warm-up
        searcher = Searcher(server.base_url, args)
        idle: dict[str, list[float]] = {"list_sessions": [], "forward": []}
        loaded: dict[str, list[float]] = {"list_sessions": [], "forward": []}
        stall = cpu_stall_us()
        deadline = time.monotonic() + args.max_s
        for r in range(args.rounds):  # idle and loaded blocks alternate: the box's drift hits both alike
            for phase, out in (("idle", idle), ("loaded", loaded))[::1 if r % 2 == 0 else -1]:
                searcher.run() if phase == "loaded" else searcher.pause()
                for what, times in measure(rest, tc, datum, args.samples).items():
                    out[what] += times
            if time.monotonic() > deadline:
                break
        searcher.pause()
        stall_after = cpu_stall_us()
        load = searcher.results()
        return {"label": label, "setup_s": setup_s, "idle": idle, "loaded": loaded, "searches": load["times"],
                "refused": load["refused"], "stall_s": None if stall is None else (stall_after - stall) / 1e6}
    finally:
        server.stop()


def report(r: dict, args) -> None:
    print(f"\n{r['label']}: key A {args.sessions} sessions x {args.metadata_keys} metadata pairs (~62 KB), "
          f"{args.loops} loop(s) of search_sessions with all {args.metadata_keys} as filters (limit {args.page}); "
          f"setup {r['setup_s']:.0f} s")
    print(f"{'key B round trip':<18}{'n':>4}{'idle p50':>11}{'idle p99':>11}{'loaded p50':>12}{'loaded p99':>12}"
          f"{'p50 x':>8}{'p99 x':>8}   (ms)")
    for what in ("list_sessions", "forward"):
        idle, loaded = r["idle"][what], r["loaded"][what]
        print(f"{what:<18}{len(loaded):>4}{pct(idle, 50):>11.1f}{pct(idle, 99):>11.1f}{pct(loaded, 50):>12.1f}"
              f"{pct(loaded, 99):>12.1f}{pct(loaded, 50) / pct(idle, 50):>8.2f}{pct(loaded, 99) / pct(idle, 99):>8.2f}")
    s = r["searches"]
    line = f"key A's searches: {len(s)} answered" + (f", p50 {pct(s, 50):.0f} ms, p99 {pct(s, 99):.0f} ms" if s else "")
    print(line + f"; {len(r['refused'])} refused" + (f" (first: {r['refused'][0]})" if r["refused"] else ""))
    if r["stall_s"] is not None:
        print(f"CPU pressure over the run (PSI some): {r['stall_s']:.1f} s of waiting for a CPU")


def old_tree(rev: str, tmp: Path) -> Path:
    src = tmp / "old-src"
    src.mkdir()
    archive = subprocess.run(["git", "-C", str(ROOT), "archive", rev], check=True, capture_output=True).stdout
    subprocess.run(["tar", "-x", "-C", str(src)], input=archive, check=True)
    return src


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--old", help="also run on this git revision first (e.g. f62a3dc), one after the other")
    ap.add_argument("--sessions", type=int, default=400)
    ap.add_argument("--metadata-keys", type=int, default=64)
    ap.add_argument("--loops", type=int, default=1, help="key A's searches running at once, back to back (the issue found 2)")
    ap.add_argument("--page", type=int, default=50, help="the search's limit (the SDK's default)")
    ap.add_argument("--rounds", type=int, default=6, help="rounds of an idle and a loaded block, alternating")
    ap.add_argument("--samples", type=int, default=4, help="key B's round trips of each kind per block")
    ap.add_argument("--max-s", type=float, default=300.0, help="no round starts after this long")
    ap.add_argument("--searcher", metavar="BASE_URL", help=argparse.SUPPRESS)  # the searcher process
    args = ap.parse_args()
    if args.searcher:
        searcher_main(args.searcher, args.loops, args.metadata_keys, args.page)
        return 0
    with tempfile.TemporaryDirectory(prefix="db-contention-") as tmp:
        runs = []
        if args.old:
            runs.append(run(f"old = {args.old}", old_tree(args.old, Path(tmp)), Path(tmp) / "old", args))
        runs.append(run("new = this checkout", ROOT, Path(tmp) / "new", args))
    for r in runs:
        report(r, args)
    return 0


if __name__ == "__main__":
    sys.exit(main())
