"""A kernel profile of the fused training step in one call: where a step's time goes.

Profiles one fused training step -- one `TrainingRuntime.forward_backward` over every tenant plus
one `optim_steps` over them, what one clock cycle of the server does -- with `torch.profiler`
(CUDA activity where CUDA is, CPU activity alone otherwise), after warm-up steps (on CUDA the
step is then a replay of its captured graphs). Cases (the issue's map): N=1 and N=16 tenants on
the dense body, N=16 on the MoE body; each tenant sends 2 datums x 128 tokens of cross_entropy
and has LoRA rank 16 on every attention and MLP projection (MoE: and every expert).

For each case it writes into DIR/<case>/:
  kernels.txt   the top kernels by GPU time (on CPU: aten ops by self CPU time) with their counts
  trace.json    the step's trace (Chrome trace format: open it in https://ui.perfetto.dev)
and DIR/summary.json and DIR/summary.txt with, per case: the step's wall time, the GPU-busy
fraction of it (on CPU: the share of wall time inside aten ops), kernel launches per step (CUDA
kernel and graph launches; on CPU: top-level aten ops, each of which is one or more launches on
a GPU), host syncs per step (runtime/step_audit.py's count of ops that wait for the device, plus
on CUDA the synchronize calls the profiler saw), and the host ops ratio N=16 / N=1 of the dense
body. A case that fails writes its error into its summary entry; the other cases still run.

    python3 benchmarks/profile_step.py --out DIR [--preset gpu|cpu] [--cases dense-1,dense-16,moe-16]
        [--moe-body moe|a3b] [--warmup 2] [--seq-len 128] [--device auto]

Presets: `gpu` (the default where CUDA is: the 1.4B Qwen3-1.7B-shaped body and the 256x4, 8-expert
MoE body of multi_tenant.py) and `cpu` (the default elsewhere: the embedded tiny body and a 64x2,
4-expert MoE, 32-token datums; seconds); both in bf16 unless --dtype says otherwise. `--moe-body a3b` profiles Qwen3-30B-A3B's layer
shapes cut to 4 layers (benchmarks/bodies.py) instead. Sized for 3 minutes on an H100 or H200
(27 s on an H200 at 9b9bbbf; the CPU preset is what tests/test_profile_step.py runs).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
import tempfile
import time
import traceback
import warnings
from collections import defaultdict
from pathlib import Path

warnings.filterwarnings("ignore", category=FutureWarning)

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))

import torch  # noqa: E402
from torch.autograd import DeviceType  # noqa: E402
from torch.profiler import ProfilerActivity, profile, record_function  # noqa: E402

from hosted_tinker.models.loading import pick_device, pick_dtype  # noqa: E402
from hosted_tinker.runtime.adapters import AdamParams, LoRAConfig  # noqa: E402
from hosted_tinker.runtime.step_audit import SyncAudit  # noqa: E402
from hosted_tinker.runtime.trainer import TrainingRuntime  # noqa: E402
from bench_common import cycle_step, fb_work, host_op_counts, tenant_rows  # noqa: E402
from bodies import LABELS, build_models  # noqa: E402

# Both run in bf16 by default (--dtype): the dtype decides which paths a step takes (LoRA GEMMs,
# grouped expert GEMMs), and bf16's are what a GPU runs.
PRESETS = {"gpu": {"dense": "1b", "moe": "moe", "seq_len": 128},
           "cpu": {"dense": "tiny", "moe": "tiny-moe", "seq_len": 32}}
CASES = {"dense-1": ("dense", 1), "dense-16": ("dense", 16), "moe-16": ("moe", 16)}
RANK, ALPHA, ROWS, TOP = 16, 32.0, 2, 30
# CUDA runtime calls that launch work, and those that make the host wait for the device.
LAUNCHES = ("cudaLaunchKernel", "cuLaunchKernel", "cudaLaunchCooperativeKernel", "cudaGraphLaunch",
            "cudaMemcpyAsync", "cudaMemsetAsync")
SYNCS = ("cudaDeviceSynchronize", "cudaStreamSynchronize", "cudaEventSynchronize", "cudaMemcpy ")


@dataclasses.dataclass
class Case:
    name: str
    body: str  # a size of benchmarks/bodies.py
    tenants: int


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def make_runtime(body: str, tenants: int, device: torch.device, dtype: torch.dtype, tmp: Path) -> TrainingRuntime:
    """The body's runtime with `tenants` adapters (rank 16, non-zero B, as after a first step)."""
    model = build_models(body, tmp, device, dtype)[0]
    runtime = TrainingRuntime(model, body, device=device)
    for t in range(tenants):
        adapter = runtime.create_adapter(f"tenant-{t}", LoRAConfig(rank=RANK, alpha=ALPHA, seed=t, train_unembed=False))
        with torch.no_grad():
            for w in adapter.weights.values():
                w.B.normal_(0, 1e-3)
    return runtime


def step_fn(runtime: TrainingRuntime, n: int, seq_len: int):
    """One clock cycle's training work for tenants 0..n-1: fused fb + one optim_steps, one wait."""
    vocab = min(runtime.vocab_size, 1000)
    rows = tenant_rows(n, ROWS, seq_len, vocab)
    works = [fb_work(f"tenant-{t}", rows[t]) for t in range(n)]
    adam = AdamParams(learning_rate=1e-4)

    def step() -> None:
        cycle_step(runtime, works, [(w.model_id, adam) for w in works])
    return step


def device_events(events) -> list:
    return [e for e in events if e.device_type == DeviceType.CUDA]


def busy_fraction(intervals: list[tuple[float, float]], wall_us: float) -> float:
    """The share of the wall time covered by the union of the intervals (us)."""
    covered, end = 0.0, float("-inf")
    for s, e in sorted(intervals):
        if e <= end:
            continue
        covered += e - max(s, end)
        end = e
    return covered / wall_us if wall_us > 0 else float("nan")


def top_table(events, device: torch.device) -> tuple[list[dict], list[tuple[float, float]]]:
    """(the top kernels by GPU time, or aten ops by self CPU time, with counts; the intervals
    that count as busy: GPU kernels and copies, or top-level aten ops)."""
    total: dict[str, float] = defaultdict(float)
    count: dict[str, int] = defaultdict(int)
    if device.type == "cuda":
        kernels = device_events(events)
        for e in kernels:
            total[e.name] += e.time_range.elapsed_us()
            count[e.name] += 1
        intervals = [(e.time_range.start, e.time_range.end) for e in kernels]
    else:
        ops = [e for e in events if e.name.startswith("aten::")]
        for e in ops:
            total[e.name] += e.self_cpu_time_total
            count[e.name] += 1
        intervals = [(e.time_range.start, e.time_range.end) for e in ops
                     if e.cpu_parent is None or not e.cpu_parent.name.startswith("aten::")]
    rows = sorted(({"name": k, "us": total[k], "count": count[k]} for k in total), key=lambda r: -r["us"])
    return rows, intervals


def launch_counts(events, device: torch.device) -> dict[str, int]:
    """Launches and synchronize calls the profiler saw on the host (CUDA), or top-level aten ops (CPU)."""
    if device.type != "cuda":
        ops = [e for e in events if e.name.startswith("aten::")]
        return {"top_level_aten_ops": sum(1 for e in ops if e.cpu_parent is None
                                          or not e.cpu_parent.name.startswith("aten::"))}
    out = {"kernel_launches": 0, "graph_launches": 0, "copies_and_sets": 0, "profiler_syncs": 0,
           "kernels_run": len([e for e in device_events(events)])}
    for e in events:
        if e.device_type == DeviceType.CUDA:
            continue
        if e.name.startswith("cudaGraphLaunch"):
            out["graph_launches"] += 1
        elif e.name.startswith(("cudaMemcpyAsync", "cudaMemsetAsync")):
            out["copies_and_sets"] += 1
        elif e.name.startswith(LAUNCHES):
            out["kernel_launches"] += 1
        elif e.name.startswith(SYNCS) or e.name == "cudaMemcpy":
            out["profiler_syncs"] += 1
    return out


def write_kernels(path: Path, rows: list[dict], device: torch.device, wall_ms: float) -> None:
    what = "kernel (GPU time)" if device.type == "cuda" else "aten op (self CPU time)"
    lines = [f"top {len(rows[:TOP])} of {len(rows)} by {what}; step wall {wall_ms:.2f} ms", "",
             f"{'ms':>10} {'% wall':>7} {'count':>7}  name"]
    for r in rows[:TOP]:
        share = 100 * r["us"] / 1000 / wall_ms if wall_ms else float("nan")
        lines.append(f"{r['us'] / 1000:>10.3f} {share:>6.1f}% {r['count']:>7}  {r['name'][:160]}")
    path.write_text("\n".join(lines) + "\n")


def profile_case(case: Case, runtime: TrainingRuntime, args, device: torch.device, out: Path) -> dict:
    """Warm up, count the step's host syncs, then profile one step; write its files."""
    step = step_fn(runtime, case.tenants, args.seq_len)
    for _ in range(args.warmup):
        step()
    sync(device)
    with SyncAudit() as audit:
        step()
        sync(device)
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
    with profile(activities=activities) as prof:
        t0 = time.perf_counter()
        with record_function(f"fused_step {case.name}"):
            step()
            sync(device)
        wall_ms = 1000 * (time.perf_counter() - t0)
    case_dir = out / case.name
    case_dir.mkdir(parents=True, exist_ok=True)
    prof.export_chrome_trace(str(case_dir / "trace.json"))
    events = prof.events()
    rows, intervals = top_table(events, device)
    write_kernels(case_dir / "kernels.txt", rows, device, wall_ms)
    summary = {"body": LABELS.get(case.body, case.body), "tenants": case.tenants, "wall_ms": wall_ms,
               "busy_fraction": busy_fraction(intervals, 1000 * wall_ms),
               "host_syncs": audit.count, "host_sync_reasons": dict(audit.reasons),
               **launch_counts(events, device), "top": rows[:5]}
    if runtime.graphs is not None:
        summary["graphs"] = {"captured": runtime.graphs.captures, "replays": runtime.graphs.replays}
    return summary


def run_body(body: str, cases: list[Case], args, device, dtype, out: Path, tmp: Path, summary: dict) -> None:
    """Every case on one body, on one runtime (built once, freed on return)."""
    try:
        runtime = make_runtime(body, max(c.tenants for c in cases), device, dtype, tmp)
        print(f"[{LABELS.get(body, body)}] {runtime.describe_training()}", flush=True)
    except Exception as e:  # noqa: BLE001 (the other bodies still run)
        for c in cases:
            summary[c.name] = {"error": f"{type(e).__name__}: {e}", "traceback": traceback.format_exc()}
        return
    for case in cases:
        t = time.perf_counter()
        try:
            summary[case.name] = profile_case(case, runtime, args, device, out)
        except Exception as e:  # noqa: BLE001
            summary[case.name] = {"error": f"{type(e).__name__}: {e}", "traceback": traceback.format_exc()}
        print(f"  {case.name}: {json.dumps({k: v for k, v in summary[case.name].items() if k not in ('top', 'traceback')})}"
              f" ({time.perf_counter() - t:.0f}s)", flush=True)
    if len({c.tenants for c in cases}) > 1:  # host ops per fused step, largest N over smallest
        counts = {n: host_op_counts(step_fn(runtime, n, args.seq_len))[1] for n in sorted({c.tenants for c in cases})}
        lo, hi = min(counts), max(counts)
        summary[f"host_ops_{body}"] = {"per_tenants": counts, f"ratio_{hi}_over_{lo}": counts[hi] / counts[lo]}


def write_summary(out: Path, summary: dict, header: str) -> None:
    (out / "summary.json").write_text(json.dumps(summary, indent=2, default=str) + "\n")
    lines = [header, "", f"{'case':<10}{'body':<18}{'N':>3}{'wall ms':>10}{'busy':>7}{'launches':>10}"
             f"{'syncs':>7}  top kernel"]
    for name, s in summary.items():
        if not isinstance(s, dict) or "tenants" not in s and "error" not in s:
            continue
        if "error" in s:
            lines.append(f"{name:<10}ERROR {s['error']}")
            continue
        launches = s.get("kernel_launches", s.get("top_level_aten_ops", 0)) + s.get("graph_launches", 0)
        top = s["top"][0]["name"][:60] if s["top"] else ""
        lines.append(f"{name:<10}{s['body']:<18}{s['tenants']:>3}{s['wall_ms']:>10.2f}{100 * s['busy_fraction']:>6.0f}%"
                     f"{launches:>10}{s['host_syncs'] + s.get('profiler_syncs', 0):>7}  {top}")
    for name, s in summary.items():
        if name.startswith("host_ops_"):
            lines.append(f"{name}: {s}")
    (out / "summary.txt").write_text("\n".join(lines) + "\n")
    print("\n".join(lines), flush=True)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", required=True, type=Path, help="folder for the profile's files")
    ap.add_argument("--preset", choices=sorted(PRESETS), default=None, help="gpu (default with CUDA) or cpu")
    ap.add_argument("--cases", default=",".join(CASES), help=f"comma-separated of {', '.join(CASES)}")
    ap.add_argument("--moe-body", default=None, help="the MoE body: moe (gpu preset), a3b, tiny-moe (cpu preset)")
    ap.add_argument("--warmup", type=int, default=2, help="steps before the profiled one (default 2)")
    ap.add_argument("--seq-len", type=int, default=None, help="tokens per datum (default: the preset's)")
    ap.add_argument("--device", default="auto", help="auto (cuda if present), cpu or cuda")
    ap.add_argument("--threads", type=int, default=None, help="torch intra-op threads (default: torch's)")
    ap.add_argument("--dtype", default="bfloat16", help="the bodies' dtype (default bfloat16, as a GPU serves them)")
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    device = pick_device(args.device)
    dtype = pick_dtype(args.dtype, device)
    preset = PRESETS[args.preset or ("gpu" if device.type == "cuda" else "cpu")]
    args.seq_len = args.seq_len or preset["seq_len"]
    bodies = {"dense": preset["dense"], "moe": args.moe_body or preset["moe"]}
    cases = [Case(c, bodies[CASES[c][0]], CASES[c][1]) for c in args.cases.split(",")]
    args.out.mkdir(parents=True, exist_ok=True)
    header = (f"profile of one fused step (fb + AdamW), {ROWS} x {args.seq_len} tokens per tenant, LoRA rank {RANK}; "
              f"device {device} ({dtype}), torch {torch.__version__}, {args.warmup} warm-up steps")
    print(header, flush=True)
    summary: dict = {"device": str(device), "dtype": str(dtype), "torch": torch.__version__, "seq_len": args.seq_len}
    t0 = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="ht-profile-") as tmp:
        for body in dict.fromkeys(c.body for c in cases):
            run_body(body, [c for c in cases if c.body == body], args, device, dtype, args.out, Path(tmp), summary)
            if device.type == "cuda":
                torch.cuda.empty_cache()
    summary["seconds"] = time.perf_counter() - t0
    write_summary(args.out, summary, header + f"; {summary['seconds']:.0f}s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
