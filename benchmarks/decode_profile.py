"""The kernel profile of one decode step of the built-in sampler, this checkout beside an older revision.

Both revisions' `SamplingEngine`s live in one process (the old package taken with `git archive`
and imported under another name, as compare_revisions.py does), each on its own copy of one model
(benchmarks/bodies.py's sizes: `1b` is the issue's 1.4B Qwen3-1.7B-shaped body) with the same adapters
(rank 16 on every projection, B non-zero). Each gets --rows concurrent requests of ~32-token
prompts over --adapters adapters (temperature 1, seeded, no stop), is driven tick by tick until
every row decodes, runs --warmup more steps (a captured step is a replay from its second on), and
then --steps decode steps are profiled with torch.profiler, one revision after the other.

Printed per revision: the wall time of a step (the host waits for the device at its end) and the
device (CUDA) time per step; then the top kernels by device time per step, side by side, with
their launch counts -- on a GPU, where a kernel that grew between the revisions shows. Without a
GPU it profiles the CPU ops instead (self CPU time), which checks that the script runs.

    .venv/bin/python benchmarks/decode_profile.py --old REV [--size 1b] [--rows 64] [--adapters 4] \
        [--steps 3] [--warmup 3] [--top 25] [--threads 1]

A benchmark, not a test: it asserts nothing about time and exits 0.
"""

from __future__ import annotations

import argparse
import importlib
import shutil
import sys
import tempfile
import time
import warnings
from collections import defaultdict
from pathlib import Path

warnings.filterwarnings("ignore", category=FutureWarning)

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))

import numpy as np  # noqa: E402
import torch  # noqa: E402

import bodies  # noqa: E402
import compare_revisions as revisions  # noqa: E402

RANK = 16


def engine_of(package: str, model, device: torch.device, adapters: int):
    """A revision's runtime around `model` (wrapped in place), its adapters, and its engine."""
    trainer, lora, _ = revisions.modules(package)
    engine_module = importlib.import_module(f"{package}.sampling.engine")
    runtime = trainer.TrainingRuntime(model, "bench", device=device)
    for a in range(adapters):
        adapter = runtime.create_adapter(f"a{a}", lora.LoRAConfig(rank=RANK, seed=a))
        with torch.no_grad():
            for w in adapter.weights.values():
                w.B.copy_(torch.randn(w.B.shape, generator=torch.Generator().manual_seed(a)).to(w.B) * 1e-2)
    return engine_module, engine_module.SamplingEngine(model, runtime.routing, None, device)


def decode_steps(module, engine, prompts: list[list[int]], adapters: int, new_tokens: int):
    """Submit the requests and tick until every row decodes; returns one decode step (a callable)."""
    done: list = []
    engine.submit_all([module.SampleJob(prompt=p, num_samples=1, max_tokens=new_tokens,
                                        adapter_id=f"a{i % adapters}", temperature=1.0, seed=i,
                                        on_done=done.append, on_error=done.append)
                       for i, p in enumerate(prompts)])

    def step() -> None:  # one tick: with every row started, one decode step of all of them
        engine.run(should_yield=lambda: True, max_seconds=0.0)

    while engine.active_rows < len(prompts) or engine.waiting_jobs:
        step()
    step()  # every row has its first token
    return step


def profile(step, device: torch.device, steps: int) -> tuple[float, float, dict[str, tuple[float, int]]]:
    """(wall ms per step, device ms per step, {kernel or op: (us per step, calls per step)})."""
    from torch.profiler import ProfilerActivity, profile as torch_profile

    cuda = device.type == "cuda"
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
    with torch_profile(activities=activities) as prof:
        t = time.perf_counter()
        for _ in range(steps):
            step()
        if cuda:
            torch.cuda.synchronize(device)
        wall = (time.perf_counter() - t) / steps
    kernels: dict[str, list[float]] = defaultdict(lambda: [0.0, 0])
    for e in prof.key_averages():
        spent = e.self_device_time_total if cuda else e.self_cpu_time_total
        if spent > 0 and (cuda or e.key.startswith("aten::")):
            kernels[e.key][0] += spent / steps
            kernels[e.key][1] += e.count / steps
    total = sum(v[0] for v in kernels.values()) / 1000
    return 1000 * wall, total, {k: (v[0], v[1]) for k, v in kernels.items()}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--old", required=True, help="the git revision to compare this checkout with")
    ap.add_argument("--size", default=None, help="a size of benchmarks/bodies.py (default: 1b on a GPU, small on CPU)")
    ap.add_argument("--rows", type=int, default=64, help="concurrent requests, one row each (default 64)")
    ap.add_argument("--adapters", type=int, default=4, help="distinct adapters (default 4)")
    ap.add_argument("--steps", type=int, default=3, help="decode steps profiled (default 3)")
    ap.add_argument("--warmup", type=int, default=3, help="decode steps before the profile (default 3)")
    ap.add_argument("--top", type=int, default=25, help="kernels listed (default 25)")
    ap.add_argument("--threads", type=int, default=1, help="torch intra-op threads (default 1)")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    size = args.size or ("1b" if device.type == "cuda" else "small")
    tmp = Path(tempfile.mkdtemp(prefix="ht-decode-profile-"))
    try:
        revisions.checkout(args.old, tmp)
        models = bodies.build_models(size, tmp, device, dtype, copies=2)
        vocab = models[0].get_input_embeddings().num_embeddings
        rng = np.random.default_rng(0)
        prompts = [rng.integers(0, min(vocab, 1000), int(rng.integers(28, 37))).tolist() for _ in range(args.rows)]
        new_tokens = 2 + args.warmup + args.steps + 8  # every row still decodes when the profile ends
        results = {}
        for (tag, package), model in zip(revisions.REVISIONS, models):
            module, engine = engine_of(package, model, device, args.adapters)
            step = decode_steps(module, engine, prompts, args.adapters, new_tokens)
            for _ in range(args.warmup):
                step()
            results[tag] = profile(step, device, args.steps)
            engine.run(should_yield=lambda: False, max_seconds=1e9)
        report(args, size, device, dtype, results)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return 0


def report(args, size: str, device: torch.device, dtype: torch.dtype, results: dict) -> None:
    what = "device (CUDA) time" if device.type == "cuda" else "self CPU time (no GPU here: aten ops)"
    print(f"decode step profile: old = {args.old}, new = this checkout; model {bodies.LABELS.get(size, size)} "
          f"({dtype}) on {device}, {args.rows} rows over {args.adapters} adapters (LoRA rank {RANK}), "
          f"{args.steps} steps after {args.warmup}")
    for tag, (wall, busy, _) in results.items():
        print(f"  {tag}: {wall:.2f} ms per step (wall), {busy:.2f} ms of {what} per step")
    old, new = results["old"][2], results["new"][2]
    names = sorted(set(old) | set(new), key=lambda k: -max(old.get(k, (0, 0))[0], new.get(k, (0, 0))[0]))
    width = min(90, max((len(n) for n in names[:args.top]), default=10))
    print(f"\n{'kernel' if device.type == 'cuda' else 'op':<{width}} {'old us':>10} {'calls':>7} {'new us':>10} "
          f"{'calls':>7}   ({what} per step)")
    for name in names[:args.top]:
        o, n = old.get(name, (0.0, 0)), new.get(name, (0.0, 0))
        print(f"{name[:width]:<{width}} {o[0]:>10.1f} {o[1]:>7.0f} {n[0]:>10.1f} {n[1]:>7.0f}")


if __name__ == "__main__":
    sys.exit(main())
