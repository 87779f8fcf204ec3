"""One key's heavy session search against another key's listing and `forward` (issue 40, item 2).

Key A owns `--sessions` sessions, each with `--metadata-keys` user_metadata pairs of ~62 KB in all,
and runs `search_sessions` with every one of those pairs as a filter (each session matches all of
them), `--loops` such searches back to back at once. Key B, meanwhile, lists its sessions
(`RestClient.list_sessions`) and runs `TrainingClient.forward` on one datum, alternately, through
the real `tinker` SDK against a real `hosted_tinker serve` process. Prints B's round trips, p50 and
p99, without the load and with it, and their ratio (goal: within 2x), plus A's searches: how many
ran, how long they took and how many were refused (4xx).

    .venv/bin/python benchmarks/db_contention.py [--old REV] [--sessions 400] [--loops 2] \
        [--samples 20] [--phase-s 240] [--page 50]

`--old REV` runs the same first on REV's code (taken with `git archive`, one server after the
other, never at once), then on this checkout, and prints both tables. A benchmark, not a test: it
asserts nothing about time and exits 0.
"""

from __future__ import annotations

import argparse
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
from hosted_tinker.embedded_model import EMBEDDED_MODEL_NAME  # noqa: E402
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


def rest_client(server: ServerProcess, key: str) -> tinker.RestClient:
    return tinker.RestClient(base_url=server.base_url, api_key=key)


class SearchLoop:
    """`loops` threads, each running key A's search back to back until stopped."""

    def __init__(self, server: ServerProcess, loops: int, keys: int, page: int):
        self.request = types.SessionSearchRequest(user_metadata=metadata(keys), limit=page)
        self.stop = threading.Event()
        self.times: list[float] = []
        self.refused: list[str] = []
        self.threads = [threading.Thread(target=self._run, args=(rest_client(server, KEY_A),), daemon=True)
                        for _ in range(loops)]

    def _run(self, rest) -> None:
        while not self.stop.is_set():
            t = time.perf_counter()
            try:
                rest.search_sessions(self.request).result()
                self.times.append(time.perf_counter() - t)
            except tinker.APIStatusError as e:  # a 4xx: the server refused the query (a bound, a budget)
                self.refused.append(f"{e.status_code}: {str(e)[:160]}")
                time.sleep(0.05)

    def __enter__(self) -> "SearchLoop":
        for t in self.threads:
            t.start()
        while not (self.times or self.refused):  # the load is running before anything is measured
            time.sleep(0.1)
        return self

    def __exit__(self, *exc) -> None:
        self.stop.set()
        for t in self.threads:
            t.join()


def measure(rest, tc, datum, samples: int, phase_s: float) -> dict[str, list[float]]:
    """B's round trips, listing and forward alternately, `samples` of each or until `phase_s` ran out."""
    out: dict[str, list[float]] = {"list_sessions": [], "forward": []}
    deadline = time.monotonic() + phase_s
    while len(out["forward"]) < samples and (time.monotonic() < deadline or not out["forward"]):
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
        rest = rest_client(server, KEY_B)
        tc = sc.create_lora_training_client(base_model=EMBEDDED_MODEL_NAME, rank=4).result()
        tokens = list(range(1, 33))
        datum = types.Datum(model_input=types.ModelInput.from_ints(tokens[:-1]),
                            loss_fn_inputs={"target_tokens": tokens[1:], "weights": [1.0] * 31})
        measure(rest, tc, datum, 3, 60)  # warm-up
        stall = cpu_stall_us()
        idle = measure(rest, tc, datum, args.samples, args.phase_s)
        with SearchLoop(server, args.loops, args.metadata_keys, args.page) as load:
            loaded = measure(rest, tc, datum, args.samples, args.phase_s)
        stall_after = cpu_stall_us()
        return {"label": label, "setup_s": setup_s, "idle": idle, "loaded": loaded, "searches": load.times,
                "refused": load.refused, "stall_s": None if stall is None else (stall_after - stall) / 1e6}
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
    ap.add_argument("--loops", type=int, default=2, help="key A's searches running at once, back to back")
    ap.add_argument("--page", type=int, default=50, help="the search's limit (the SDK's default)")
    ap.add_argument("--samples", type=int, default=20, help="key B's round trips of each kind per phase")
    ap.add_argument("--phase-s", type=float, default=240.0, help="a phase stops early after this long")
    args = ap.parse_args()
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
