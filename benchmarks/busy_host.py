"""Training steps on a busy host: this checkout's CPU threads against an older revision's, side by side.

Issue 41 item 5: with torch's 2 OpenMP threads and CPU-bound processes beside the server, every
tenant's step stalled together every few seconds (p99 of a step 4-8 s); one thread did not. Each
variant here is a server process (its own checkout's code, its own data dir) on the embedded
model, with `--tenants` SDK training clients looping forward_backward + optim_step for
`--seconds`, while `--hogs` processes (`python -c 'while True: pass'`) compete for the CPUs.
Printed per variant: steps done, p50 and p99 of a step, the share of steps over 1 s, the
steps as a fraction of the one-thread server's under the same load, and the host's 1-minute load
average at the end of its runs (on a shared machine, what else ran: hogs and tenants included). The same again on an idle
host (no hogs), where the question is whether the default is slower than the old one.

    .venv/bin/python benchmarks/busy_host.py [--old f62a3dc] [--seconds 90] [--tenants 6] [--hogs 2]
        [--variant LABEL:REV:K=V,K=V ...]

REV is a git revision (its code taken with `git archive`) or `.` for this checkout. Default
variants: the old revision as it is, the old revision with OMP_NUM_THREADS=1 (the yardstick),
and this checkout as it is. Variants run one at a time in rotating order each round (a shared
box drifts). A benchmark, not a test: it asserts nothing about time and exits 0.
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

os.environ.setdefault("TINKER_TELEMETRY", "0")

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tests"))

import numpy as np  # noqa: E402

from server_process import ServerProcess  # noqa: E402

API_KEY = "tml-bench-busy-host"
THREAD_ENV = ("OMP_NUM_THREADS", "OMP_WAIT_POLICY", "GOMP_SPINCOUNT", "KMP_BLOCKTIME", "MKL_NUM_THREADS")


@dataclass
class Variant:
    label: str
    rev: str  # "." = this checkout
    env: dict[str, str] = field(default_factory=dict)
    runs: dict[int, list[list[float]]] = field(default_factory=dict)  # hogs -> per run, its step times
    loads: dict[int, list[float]] = field(default_factory=dict)  # hogs -> per run, the host's 1-min load at its end


def parse_variant(text: str) -> Variant:
    label, rev, *rest = text.split(":", 2)
    env = dict(kv.split("=", 1) for kv in (rest[0].split(",") if rest and rest[0] else []))
    return Variant(label, rev, env)


def tree_of(rev: str, tmp: Path) -> Path:
    if rev == ".":
        return ROOT
    src = tmp / f"src-{rev}"
    if not src.exists():
        src.mkdir()
        archive = subprocess.run(["git", "-C", str(ROOT), "archive", rev], check=True, capture_output=True).stdout
        subprocess.run(["tar", "-x", "-C", str(src)], input=archive, check=True)
    return src


def batch(rng: np.random.Generator, rows: int, seq_len: int) -> list:
    from tinker import types

    out = []
    for _ in range(rows):
        tokens = rng.integers(0, 1000, seq_len + 1).tolist()
        out.append(types.Datum(model_input=types.ModelInput.from_ints(tokens[:-1]),
                               loss_fn_inputs={"target_tokens": tokens[1:], "weights": [1.0] * seq_len}))
    return out


def tenant_loop(sc, seed: int, args, start: threading.Barrier, stop_at: list[float], times: list[float]) -> None:
    from tinker import types

    tc = sc.create_lora_training_client(base_model=args.base_model, rank=16).result()
    rng = np.random.default_rng(seed)
    data = batch(rng, args.rows, args.seq_len)
    tc.forward_backward(data, "cross_entropy").result()  # warm-up: shapes seen, adapter made
    tc.optim_step(types.AdamParams(learning_rate=1e-4)).result()
    start.wait()
    while time.monotonic() < stop_at[0]:
        t = time.monotonic()
        fb = tc.forward_backward(data, "cross_entropy")
        opt = tc.optim_step(types.AdamParams(learning_rate=1e-4))
        fb.result()
        opt.result()
        times.append(time.monotonic() - t)


def run_once(variant: Variant, tree: Path, hogs: int, args, tmp: Path) -> list[float]:
    env = {k: v for k, v in os.environ.items() if k not in THREAD_ENV}
    env.update(variant.env)
    data_dir = Path(tempfile.mkdtemp(dir=tmp, prefix=f"{variant.label}-"))
    srv = ServerProcess(data_dir, env=env, checkout=tree).start()
    per_tenant: list[list[float]] = [[] for _ in range(args.tenants)]
    start = threading.Barrier(args.tenants + 1)
    stop_at = [float("inf")]
    load: list[subprocess.Popen] = []
    try:
        clients = [srv.client(API_KEY) for _ in range(args.tenants)]
        threads = [threading.Thread(target=tenant_loop, args=(sc, i, args, start, stop_at, per_tenant[i]))
                   for i, sc in enumerate(clients)]
        for t in threads:
            t.start()
        start.wait()  # every tenant warmed up: the hogs start, then the clock
        load = [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(hogs)]
        stop_at[0] = time.monotonic() + args.seconds
        for t in threads:
            t.join()
    finally:
        for p in load:
            p.kill()
            p.wait()
        srv.stop()
    return [s for times in per_tenant for s in times]


def summary(runs: list[list[float]]) -> tuple[float, float, float, float]:
    """(steps per run, p50, p99, share over 1 s) over every run of a variant."""
    steps = [s for r in runs for s in r]
    if not steps:
        return 0.0, float("nan"), float("nan"), float("nan")
    q = statistics.quantiles(steps, n=100) if len(steps) > 1 else [steps[0]] * 99
    return len(steps) / len(runs), statistics.median(steps), q[98], sum(s > 1.0 for s in steps) / len(steps)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--old", default="f62a3dc", help="the revision to compare with (default: main before issue 41)")
    p.add_argument("--seconds", type=float, default=90.0, help="measured time per variant and load")
    p.add_argument("--tenants", type=int, default=6)
    p.add_argument("--rows", type=int, default=4, help="datums per forward_backward")
    p.add_argument("--seq-len", type=int, default=64)
    p.add_argument("--hogs", type=int, default=2, help="CPU-bound processes beside the server under load")
    p.add_argument("--rounds", type=int, default=1)
    p.add_argument("--no-idle", action="store_true", help="skip the idle-host half")
    p.add_argument("--base-model", default="hosted-tinker/tiny-qwen3-embedded")
    p.add_argument("--variant", action="append", type=parse_variant,
                   help="LABEL:REV:K=V,... (repeatable; replaces the default variants)")
    args = p.parse_args()
    variants = args.variant or [Variant("old", args.old), Variant("old 1 thread", args.old, {"OMP_NUM_THREADS": "1"}),
                                Variant("new", ".")]
    loads = [args.hogs] + ([] if args.no_idle or args.hogs == 0 else [0])
    with tempfile.TemporaryDirectory(prefix="busy-host-") as tmp_name:
        tmp = Path(tmp_name)
        trees = {v.rev: tree_of(v.rev, tmp) for v in variants}
        for r in range(args.rounds):
            for hogs in loads:
                order = variants[r % len(variants):] + variants[:r % len(variants)]
                for v in order:
                    times = run_once(v, trees[v.rev], hogs, args, tmp)
                    v.runs.setdefault(hogs, []).append(times)
                    v.loads.setdefault(hogs, []).append(os.getloadavg()[0])
                    print(f"  round {r + 1}, {hogs} hogs, {v.label}: {len(times)} steps, host load "
                          f"{v.loads[hogs][-1]:.1f}", flush=True)
    print(f"\n{args.tenants} tenants x {args.rows} rows x {args.seq_len} tokens, {args.seconds:.0f} s per run, "
          f"{args.rounds} round(s), {os.cpu_count()} CPUs")
    yardstick = next((v for v in variants if v.env.get("OMP_NUM_THREADS") == "1"), None)
    for hogs in loads:
        print(f"\n{hogs} competing CPU-bound processes" if hogs else "\nidle host (no competing processes)")
        print(f"{'variant':<22}{'steps':>8}{'p50 s':>8}{'p99 s':>8}{'>1 s':>7}{'vs 1 thread':>13}{'host load':>11}")
        ref = summary(yardstick.runs[hogs])[0] if yardstick else None
        for v in variants:
            steps, p50, p99, slow = summary(v.runs[hogs])
            ratio = f"{steps / ref:.2f}x" if ref else "-"
            load = statistics.mean(v.loads[hogs])
            print(f"{v.label:<22}{steps:>8.0f}{p50:>8.3f}{p99:>8.3f}{slow:>7.1%}{ratio:>13}{load:>11.1f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
