"""How fast the data dir grows with training steps: this checkout against an older revision.

Issue 41 item 6: under a soak the data dir grew 6.4 MiB a minute, most of it request history that
was kept 24 h with every result in it. Each variant here is a server process (its own checkout's
code, its own data dir) on the embedded model, with `--tenants` SDK training clients each taking
`--steps` steps (forward_backward + optim_step, and every `--sample-every` steps a
save_weights_and_get_sampling_client and one sample, as an RL loop does). The data dir is measured
by kind (hosted_tinker/store/data_dir_usage.py: the database's pages in use by table group, from SQLite's
dbstat; checkpoints; snapshots; ...) once a third of the steps are done and again at the end, each
time after the tenants have idled `--settle-s` (what a server keeps only for a while, a result
fetched less than 30 s ago, is then gone, as it is from a server that runs for hours); the growth
between the two, per 1,000 steps, is printed per kind side by side.

    .venv/bin/python benchmarks/data_dir_growth.py [--old f62a3dc] [--tenants 4] [--steps 60]
        [--sample-every 5] [--new-arg=--retention-sweep-s=10 ...]

The new revision runs twice: with its defaults but `--retention-sweep-s 10` (a sweep every 10 s
instead of 60, so that a run of minutes sees many; what is kept is the same), and again with small
size bounds (`--bounded-snapshots`, `--bounded-history`), where the data dir stops growing once
they are reached. A benchmark, not a test: it asserts nothing and exits 0.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

os.environ.setdefault("TINKER_TELEMETRY", "0")

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "tests"))

import numpy as np  # noqa: E402

from hosted_tinker.store.data_dir_usage import database_bytes, files_bytes  # noqa: E402
from server_process import ServerProcess  # noqa: E402

API_KEY = "tml-bench-data-dir"
DB_FILE = "hosted_tinker.sqlite3"


def tree_of(rev: str, tmp: Path) -> Path:
    if rev == ".":
        return ROOT
    src = tmp / f"src-{rev}"
    src.mkdir()
    archive = subprocess.run(["git", "-C", str(ROOT), "archive", rev], check=True, capture_output=True).stdout
    subprocess.run(["tar", "-x", "-C", str(src)], input=archive, check=True)
    return src


def usage(data_dir: Path) -> dict[str, int]:
    db = data_dir / DB_FILE
    out = {k: v for k, v in database_bytes(db).items() if k not in ("database/free", "database/wal")}
    out["database file"] = db.stat().st_size if db.exists() else 0
    out.update(files_bytes(data_dir, db))
    out.pop("other", None)  # the server's own log, keys: not what the server keeps
    return out


def tenant(sc, seed: int, args, pauses: list[tuple[threading.Barrier, threading.Barrier]]) -> None:
    from tinker import types

    tc = sc.create_lora_training_client(base_model=args.base_model, rank=16).result()
    rng = np.random.default_rng(seed)
    data = []
    for _ in range(args.rows):
        tokens = rng.integers(0, 1000, args.seq_len + 1).tolist()
        data.append(types.Datum(model_input=types.ModelInput.from_ints(tokens[:-1]),
                                loss_fn_inputs={"target_tokens": tokens[1:], "weights": [1.0] * args.seq_len}))
    for step in range(args.steps):
        if step in (args.steps // 3, args.steps - 1):  # every tenant idle while the data dir is measured
            arrive, go = pauses[0 if step < args.steps - 1 else 1]
            arrive.wait()
            go.wait()
        fb = tc.forward_backward(data, "cross_entropy")
        opt = tc.optim_step(types.AdamParams(learning_rate=1e-4))
        fb.result()
        opt.result()
        if args.sample_every and step % args.sample_every == 0:
            sampler = tc.save_weights_and_get_sampling_client().result()
            sampler.sample(types.ModelInput.from_ints([1, 2, 3]), 4, types.SamplingParams(max_tokens=16)).result()


def run(label: str, tree: Path, extra: list[str], args, tmp: Path) -> tuple[dict[str, int], int]:
    """(bytes per kind grown between the two measurements, steps taken between them)."""
    data_dir = tmp / label.replace(" ", "-")
    srv = ServerProcess(data_dir, checkout=tree, args=tuple(extra)).start()
    measured: list[dict[str, int]] = []
    pauses = [(threading.Barrier(args.tenants + 1), threading.Barrier(args.tenants + 1)) for _ in range(2)]
    try:
        clients = [srv.client(API_KEY) for _ in range(args.tenants)]
        threads = [threading.Thread(target=tenant, args=(sc, i, args, pauses)) for i, sc in enumerate(clients)]
        for t in threads:
            t.start()
        for arrive, go in pauses:
            arrive.wait()
            time.sleep(args.settle_s)  # the tenants idle: the server's retention sweep catches up
            measured.append(usage(data_dir))
            go.wait()
        for t in threads:
            t.join()
    finally:
        srv.stop()
    steps = args.tenants * (args.steps - 1 - args.steps // 3)
    return {k: measured[1].get(k, 0) - measured[0].get(k, 0) for k in measured[1]}, steps


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--old", default="f62a3dc", help="the revision to compare with (default: main before issue 41)")
    p.add_argument("--new", default=".", help="this checkout (.) or a revision")
    p.add_argument("--tenants", type=int, default=4)
    p.add_argument("--steps", type=int, default=60, help="steps per tenant")
    p.add_argument("--rows", type=int, default=4, help="datums per forward_backward")
    p.add_argument("--seq-len", type=int, default=64)
    p.add_argument("--sample-every", type=int, default=5, help="steps between sampler snapshots (0: none)")
    p.add_argument("--new-arg", action="append", default=None, help="a flag for the new revision's server")
    p.add_argument("--settle-s", type=float, default=45.0,
                   help="idle time before each measurement (a fetched result goes 30 s after, at a sweep)")
    p.add_argument("--bounded-snapshots", type=int, default=4 << 20, help="the bounded run's snapshot bound, bytes")
    p.add_argument("--bounded-history", type=int, default=1 << 20, help="the bounded run's history bound, bytes")
    p.add_argument("--base-model", default="hosted-tinker/tiny-qwen3-embedded")
    args = p.parse_args()
    new_args = args.new_arg if args.new_arg is not None else ["--retention-sweep-s=10"]
    bounded = [*new_args, f"--sampler-snapshot-retention-bytes={args.bounded_snapshots}",
               f"--request-history-retention-bytes={args.bounded_history}"]
    variants = [("old", args.old, []), ("new", args.new, new_args), ("new, bounded", args.new, bounded)]
    with tempfile.TemporaryDirectory(prefix="data-dir-growth-") as tmp_name:
        tmp = Path(tmp_name)
        trees = {rev: tree_of(rev, tmp) for rev in {args.old, args.new}}
        results = {label: run(label, trees[rev], extra, args, tmp) for label, rev, extra in variants}
    print(f"\n{args.tenants} tenants x {args.steps} steps of {args.rows} x {args.seq_len} tokens, a snapshot and a "
          f"sample every {args.sample_every} steps")
    for label, rev, extra in variants:
        print(f"  {label}: {rev} {' '.join(extra)}")
    steps = results["new"][1]
    print(f"growth per 1,000 steps (between the {steps} steps from 1/3 of the run to its end), bytes; the database "
          "file grows only as its WAL is checkpointed, its groups are its pages in use")
    print(f"{'kind':<24}" + "".join(f"{label:>16}" for label, _, _ in variants) + f"{'new/old':>10}")
    for kind in sorted(set().union(*(r[0] for r in results.values()))):
        per = [results[label][0].get(kind, 0) * 1000 / results[label][1] for label, _, _ in variants]
        ratio = f"{per[1] / per[0]:.2f}" if per[0] > 0 else "-"
        print(f"{kind:<24}" + "".join(f"{v:>16,.0f}" for v in per) + f"{ratio:>10}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
