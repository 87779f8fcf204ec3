"""Multi-tenant training throughput: the fused scheduler vs tenant-after-tenant vs the ideal.

N tenants (default 1, 2, 4, 8, 16), each with its own LoRA adapter (rank 16, every attention and
MLP projection, PEFT's "all-linear": lm_head is not adapted), each sending 2 datums x 128 tokens
of cross_entropy per step, on several model sizes. Per (size, N), in one run, interleaved:

  (a) fused:  one fused pass over every tenant's ``FBWork`` and one ``optim_steps`` over every
              tenant, launched, then one wait for the device -- what one clock cycle of the
              server does (bench_common.cycle_step);
  (b) serial: the same work tenant after tenant: per tenant one such cycle of its own;
  (c) ideal:  a plain ``transformers`` model with ONE PEFT LoRA adapter of the same rank and
              targets: one forward/backward over all N x 2 rows + one AdamW step. The compute
              floor of the same token count (one adapter, one optimizer, no bookkeeping).

and prints aggregate tokens/s of each (medians) and the ratios a/c (target >= 0.90) and a/b
(target >= 1.00), each the median of the ratios measured within one round (see paired_ratio).
Fusing can gain at most c/b over serial. A second table runs ONE tenant with a large batch (default
16 x 128 tokens) through the multi-LoRA runtime and through the plain PEFT step: target ratio
>= 0.90 (within 10%).

Variants rotate order every round, each variant is warmed up first (on a GPU before every
shape; on CPU once per size, at its largest N, which runs first so the heap has grown), and
every figure is the median over the measured rounds (on CPU by default: tiny 25, small 7,
medium 5; single steps on this shared box vary by +-10-20%). torch runs 1 intra-op
thread by default for every variant (--threads): on a shared 2-core box, 2 OpenMP threads
made steps 20-60x slower whenever other jobs were running. 128-token rows are not padded by
the runtime (its bucket widths are 16, 24, 32, 48, 64, 96, 128, ...).

    .venv/bin/python benchmarks/multi_tenant.py [--sizes tiny,small,medium] \
        [--tenants 1,2,4,8,16] [--repeats N] [--big-rows 16] [--threads 1]

Sizes: tiny (the embedded model, hidden 64 x 2 layers), small (hidden 256 x 4), medium
(hidden 512 x 8), 1b (hidden 2048 x 28, a Qwen3-1.7B-shaped body with the embedded 1k
vocabulary; randomly initialised in memory, on by default only when a GPU is present), moe (a
Qwen3-MoE body, hidden 256 x 4, 8 experts of 256, top-2; the tenants' LoRA and the ideal's PEFT
adapter cover attention and every expert; on request only: --sizes small,moe compares it with
its dense twin), a3b (Qwen3-30B-A3B's layers -- 128 experts of 768, top-8, hidden 2048 -- cut to 4
layers, 2.5B parameters; for a GPU: --sizes a3b --tenants 1,4,16) and tiny-moe; benchmarks/bodies.py
builds them all.

A benchmark, not a test: it asserts nothing about time and exits 0.
"""

from __future__ import annotations

import argparse
import dataclasses
import gc
import os
import statistics
import sys
import tempfile
import time
import warnings
from pathlib import Path

warnings.filterwarnings("ignore", category=FutureWarning)

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

import numpy as np  # noqa: E402
import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

from hosted_tinker.models.loading import pick_device, pick_dtype  # noqa: E402
from hosted_tinker.requests.kinds import FBWork  # noqa: E402
from hosted_tinker.runtime.adapters import AdamParams, LoRAConfig  # noqa: E402
from hosted_tinker.runtime.trainer import TrainingRuntime  # noqa: E402
from bodies import LABELS, MOE, SIZES, build_models  # noqa: E402
from bench_common import (cpu_stall_us, cycle_step, fb_work, host_op_counts, matmul_peak_tflops, paired_ratio,  # noqa: E402
                          tenant_rows)

RANK = 16
ALPHA = 32.0
LR = 1e-4
# PEFT "all-linear" for a Qwen3 (no lm_head): its attention and MLP projections
TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]

EXPERT_PARAMETERS = ["mlp.experts.gate_up_proj", "mlp.experts.down_proj"]
CPU_REPEATS = {"tiny": 25, "small": 7, "medium": 5, "1b": 1, "moe": 7, "a3b": 1, "tiny-moe": 7}


# ---- models ---------------------------------------------------------------------------------------
def load_pair(size: str, tmp: Path, device: torch.device, dtype: torch.dtype):
    """Two identical copies of the base model: one for the runtime, one for PEFT."""
    return tuple(build_models(size, tmp, device, dtype, copies=2))


def make_peft(model, moe: bool):
    from peft import LoraConfig, get_peft_model

    targets = dict(target_modules=TARGETS[:4], target_parameters=EXPERT_PARAMETERS) if moe else \
        dict(target_modules=TARGETS)
    peft_model = get_peft_model(model, LoraConfig(r=RANK, lora_alpha=ALPHA, lora_dropout=0.0, bias="none",
                                                  **targets))
    peft_model.eval()  # same as the runtime: no dropout anywhere; gradients still flow
    params = [p for p in peft_model.parameters() if p.requires_grad]
    # Make B non-zero so the adapter path is a real one (as after a first step).
    with torch.no_grad():
        for n, p in peft_model.named_parameters():
            if "lora_B" in n:
                p.normal_(0, 1e-3)
    opt = torch.optim.AdamW(params, lr=LR, betas=(0.9, 0.95), eps=1e-12, weight_decay=0.0)
    return peft_model, opt


# ---- the three steps ------------------------------------------------------------------------------


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize()


def fused_step(runtime: TrainingRuntime, works: list[FBWork], adam: AdamParams) -> None:
    cycle_step(runtime, works, [(w.model_id, adam) for w in works])


def serial_step(runtime: TrainingRuntime, works: list[FBWork], adam: AdamParams) -> None:
    for w in works:
        cycle_step(runtime, [w], [(w.model_id, adam)])


def ideal_step(peft_model, opt, ids: torch.Tensor, targets: torch.Tensor) -> None:
    logits = peft_model(input_ids=ids, use_cache=False).logits
    vocab = logits.shape[-1]
    lp = -F.cross_entropy(logits.float().reshape(-1, vocab), targets.reshape(-1), reduction="none")
    loss = -lp.sum()  # cross_entropy with unit weights, a sum like Tinker's
    loss.backward()
    opt.step()
    opt.zero_grad(set_to_none=True)


def timed(fn, device) -> float:
    sync(device)
    t = time.perf_counter()
    fn()
    sync(device)
    return time.perf_counter() - t


def measure(variants: dict, warmup: int, repeats: int, device) -> dict[str, list[float]]:
    """Warm each variant up, then `repeats` rounds of one step each, order rotating per round."""
    for fn in variants.values():
        for _ in range(warmup):
            timed(fn, device)
    times: dict[str, list[float]] = {k: [] for k in variants}
    order = list(variants)
    for _ in range(repeats):
        for k in order:
            times[k].append(timed(variants[k], device))
        order.append(order.pop(0))
    return times


# ---- main -----------------------------------------------------------------------------------------
def measure_size(size: str, args, tenants: list[int], device: torch.device, dtype: torch.dtype, tmp: Path,
                 adam: AdamParams, results: list, big_results: list, op_results: list) -> None:
    """Every (size, N) figure of one model size, appended to the three lists. Its models are this
    function's locals, freed when it returns, before the next size loads."""
    t_size = time.perf_counter()
    rt_model, peft_base = load_pair(size, tmp, device, dtype)
    n_params = sum(p.numel() for p in rt_model.parameters())
    runtime = TrainingRuntime(rt_model, size, device=device)
    vocab = min(runtime.vocab_size, 1000)
    lora = LoRAConfig(rank=RANK, alpha=ALPHA, train_unembed=False)
    for t in range(max(tenants)):
        adapter = runtime.create_adapter(f"tenant-{t}", dataclasses.replace(lora, seed=t))
        with torch.no_grad():  # non-zero B, as after a first step
            for w in adapter.weights.values():
                w.B.normal_(0, 1e-3)
    peft_model, opt = make_peft(peft_base, moe=size in MOE)
    cpu = device.type == "cpu"
    repeats = args.repeats or (CPU_REPEATS[size] if cpu else 5)
    print(f"\n[{LABELS[size]}] {n_params / 1e6:.1f}M params; {repeats} rounds", flush=True)
    print(f"  training path: {runtime.describe_training()}", flush=True)
    all_rows = tenant_rows(max(tenants), args.rows, args.seq_len, vocab)
    # Largest N first: on CPU the first step at the largest shape pays for growing the heap
    # (page faults); warming up there once leaves every smaller shape warm as well.
    for i, n in enumerate(sorted(tenants, reverse=True)):
        warmup = args.warmup if (not cpu or i == 0) else 0
        works = [fb_work(f"tenant-{t}", all_rows[t]) for t in range(n)]
        flat = np.concatenate(all_rows[:n])
        ids = torch.as_tensor(flat[:, :-1], device=device)
        tgt = torch.as_tensor(flat[:, 1:], device=device)
        times = measure({
            "fused": lambda: fused_step(runtime, works, adam),
            "serial": lambda: serial_step(runtime, works, adam),
            "ideal": lambda: ideal_step(peft_model, opt, ids, tgt),
        }, warmup, repeats, device)
        tokens = n * args.rows * args.seq_len
        tps = {k: tokens / statistics.median(v) for k, v in times.items()}
        ratios = {"a/c": paired_ratio(times, "fused", "ideal"), "a/b": paired_ratio(times, "fused", "serial"),
                  "c/b": paired_ratio(times, "ideal", "serial")}
        ms = 1000 * statistics.median(times["fused"])
        results.append((size, n, tokens, tps, ratios, ms))
        print(f"  N={n:<3} fused {tps['fused']:>9.0f}  serial {tps['serial']:>9.0f}  ideal {tps['ideal']:>9.0f} "
              f"tok/s  a/c {ratios['a/c']:.3f}  a/b {ratios['a/b']:.3f}  fused {ms:.1f} ms/step", flush=True)
    if args.host_ops:  # host ops per fused step, smallest and largest N (after their warm-up)
        counts = {}
        for n in (min(tenants), max(tenants)):
            works = [fb_work(f"tenant-{t}", all_rows[t]) for t in range(n)]
            counts[n] = host_op_counts(lambda: fused_step(runtime, works, adam))
        op_results.append((size, counts, runtime.policy.describe()))
        lo, hi = min(tenants), max(tenants)
        print(f"  host ops per fused step (aten, all / top-level): N={lo} {counts[lo][0]} / {counts[lo][1]}, "
              f"N={hi} {counts[hi][0]} / {counts[hi][1]}", flush=True)
    if args.big_rows:
        seqs = tenant_rows(1, args.big_rows, args.seq_len, vocab, seed=1)[0]
        works = [fb_work("tenant-0", seqs)]
        ids = torch.as_tensor(seqs[:, :-1], device=device)
        tgt = torch.as_tensor(seqs[:, 1:], device=device)
        times = measure({
            "runtime": lambda: fused_step(runtime, works, adam),
            "peft": lambda: ideal_step(peft_model, opt, ids, tgt),
        }, 0 if cpu else args.warmup, repeats, device)
        tokens = args.big_rows * args.seq_len
        med = {k: statistics.median(v) for k, v in times.items()}
        med["ratio"] = paired_ratio(times, "runtime", "peft")
        # 4 x params x tokens: forward 2PT, backward to the activations 2PT (the base is frozen).
        med["tflops"] = 4 * n_params * tokens / med["runtime"] / 1e12
        big_results.append((size, tokens, med))
        print(f"  1 tenant x {args.big_rows} rows: runtime {1000 * med['runtime']:.1f} ms "
              f"({med['tflops']:.3g} TFLOP/s), PEFT {1000 * med['peft']:.1f} ms, ratio {med['ratio']:.3f}",
              flush=True)
    if runtime.graphs is not None:
        print(f"  CUDA graphs: {runtime.graphs.captures} captured, {runtime.graphs.replays} replays")
    print(f"  ({time.perf_counter() - t_size:.0f}s)")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--sizes", default=None,
                    help="comma-separated of tiny,small,medium,1b,moe,a3b,tiny-moe (default: tiny,small,medium, plus 1b "
                         "when a GPU is present)")
    ap.add_argument("--tenants", default="1,2,4,8,16", help="tenant counts (default 1,2,4,8,16)")
    ap.add_argument("--rows", type=int, default=2, help="datums per tenant per step (default 2)")
    ap.add_argument("--seq-len", type=int, default=128, help="tokens per datum (default 128)")
    ap.add_argument("--repeats", type=int, default=None,
                    help="measured rounds per (size, N); default on CPU: tiny 25, small 7, medium 5 "
                         "(the default run takes about 9 minutes on a 2-core box), 1b 1; on a GPU 5")
    ap.add_argument("--warmup", type=int, default=1,
                    help="warm-up steps per variant (default 1): on a GPU before every shape, on CPU "
                         "once per size, at the largest N (which is measured first)")
    ap.add_argument("--big-rows", type=int, default=16,
                    help="rows of the single-tenant large-batch table (default 16; 0 skips it)")
    ap.add_argument("--threads", type=int, default=1,
                    help="torch intra-op threads, the same for every variant (default 1: on a shared "
                         "2-core box that other jobs also load, 2 OpenMP threads made steps 20-60x "
                         "slower and erratic; raise it on an idle machine)")
    ap.add_argument("--device", default="auto", help="auto (cuda if present), cpu or cuda")
    ap.add_argument("--no-host-ops", dest="host_ops", action="store_false",
                    help="skip counting host ops per fused step (torch.profiler) at the smallest and largest N")
    args = ap.parse_args()

    torch.set_num_threads(args.threads)
    device = pick_device(args.device)
    dtype = pick_dtype("auto", device)
    sizes = (args.sizes.split(",") if args.sizes
             else ["tiny", "small", "medium"] + (["1b"] if device.type == "cuda" else []))
    for s in sizes:
        if s not in SIZES and s not in MOE:
            ap.error(f"unknown size {s!r}; choose from {sorted(SIZES) + sorted(MOE)}")
    tenants = [int(x) for x in args.tenants.split(",")]
    print(f"device {device} ({dtype}), torch {torch.__version__}, torch threads {torch.get_num_threads()}, "
          f"{os.cpu_count()} CPUs; LoRA rank {RANK} alpha {ALPHA:g} on {'/'.join(TARGETS)}; "
          f"{args.rows} datums x {args.seq_len} tokens per tenant per step; cross_entropy; AdamW")
    print(f"medians over rounds (rotating variant order), {args.warmup} warm-up step(s) per variant "
          f"{'and shape' if device.type == 'cuda' else 'and size'}")

    tmp = Path(tempfile.mkdtemp(prefix="ht-multi-tenant-"))
    adam = AdamParams(learning_rate=LR)
    results: list[tuple] = []
    big_results: list[tuple] = []
    op_results: list[tuple] = []
    peak = matmul_peak_tflops(device, dtype)
    print(f"one square {dtype} matmul on this device: {peak:.3g} TFLOP/s (the peak the step TFLOP/s are "
          "compared with)")
    t_start = time.perf_counter()
    stall0 = cpu_stall_us()
    for size in sizes:
        measure_size(size, args, tenants, device, dtype, tmp, adam, results, big_results, op_results)
        gc.collect()
        if device.type == "cuda":
            torch.cuda.empty_cache()

    report(results, big_results, op_results, peak, args)
    wall = time.perf_counter() - t_start
    stall1 = cpu_stall_us()
    if stall0 is not None and stall1 is not None:
        pressure = (stall1 - stall0) / 1e6 / wall
        print(f"\nCPU pressure: {100 * pressure:.0f}% of the time some task waited for a CPU"
              + (" -- the machine was busy with other work; ratios are noisier than on an idle box"
                 if pressure > 0.25 else ""))
    print(f"total {wall:.0f}s")
    return 0


def report(results, big_results, op_results, peak, args) -> None:
    sizes_order = list(SIZES) + list(MOE)
    print("\nTable 1: aggregate training tokens/s, N tenants x "
          f"{args.rows} datums x {args.seq_len} tokens per step (medians; ratios: medians of "
          "the ratios within each round)")
    print("  (a) fused = one runtime.forward_backward over all tenants + one optim_steps over all")
    print("  (b) serial = per tenant: forward_backward + optim_step")
    print("  (c) ideal = plain transformers + one PEFT adapter over all rows + one AdamW step")
    hdr = (f"{'model':<16}{'N':>4}{'tokens':>8}{'(a) fused':>11}{'(b) serial':>12}{'(c) ideal':>11}"
           f"{'a/c':>7}{'a/b':>7}{'c/b':>7}{'(a) ms':>9}  targets (a/c>=0.90, a/b>=1.00)")
    print(hdr)
    print("-" * len(hdr))
    missed = []
    for size, n, tokens, tps, ratios, ms in sorted(results, key=lambda r: (sizes_order.index(r[0]), r[1])):
        ac, ab, cb = ratios["a/c"], ratios["a/b"], ratios["c/b"]
        # At N=1, (a) and (b) run the very same calls: their a/b is the noise of this run, not a
        # property of fusing, so only a/c is judged there.
        ok = ac >= 0.90 and (ab >= 1.00 or n == 1)
        if not ok:
            missed.append(f"{LABELS[size]} N={n}")
        verdict = "met" if ok else "NOT MET"
        if n == 1 and ab < 1.00 and ok:
            verdict += " (a/b: same work, noise)"
        print(f"{LABELS[size]:<16}{n:>4}{tokens:>8}{tps['fused']:>11.0f}{tps['serial']:>12.0f}{tps['ideal']:>11.0f}"
              f"{ac:>7.3f}{ab:>7.3f}{cb:>7.3f}{ms:>9.1f}  {verdict}")
    print(f"target over the table: {'MET' if not missed else 'NOT MET (' + ', '.join(missed) + ')'}")
    # The run's own noise: at N=1, (a) and (b) run the same calls, so |1 - a/b| there is how far
    # a ratio of equal work strayed in this run, per model size.
    noise = {size: abs(1 - ratios["a/b"]) for size, n, _, _, ratios, _ in results if n == 1}
    if noise:
        print("  same-work noise of this run (|1 - a/b| at N=1): "
              + ", ".join(f"{LABELS[size]} {100 * v:.1f}%" for size, v in noise.items()))
        if missed:
            within = all(
                ratios["a/c"] >= 0.90 - noise.get(size, 0) and (n == 1 or ratios["a/b"] >= 1.00 - noise.get(size, 0))
                for size, n, _, _, ratios, _ in results)
            print(f"  every miss {'is' if within else 'is NOT'} within that noise")
    print("  c/b bounds what fusing can gain over serial; at N=1 (a) and (b) are the same work, so "
          "a/b there shows the measurement noise (judged on a/c only)")

    if big_results:
        print(f"\nTable 2: one tenant, {args.big_rows} x {args.seq_len} tokens: multi-LoRA runtime step "
              "vs plain PEFT single-adapter step (median ms per fb + optim step)")
        print(f"  TFLOP/s = 4 x base params x tokens / runtime step; peak = one square matmul, this run: "
              f"{peak:.3g} TFLOP/s")
        hdr = (f"{'model':<16}{'tokens':>8}{'runtime ms':>12}{'PEFT ms':>10}{'PEFT/runtime':>14}{'TFLOP/s':>10}"
               f"{'% peak':>8}  target (>= 0.90)")
        print(hdr)
        print("-" * len(hdr))
        for size, tokens, med in big_results:
            r = med["ratio"]
            print(f"{LABELS[size]:<16}{tokens:>8}{1000 * med['runtime']:>12.1f}{1000 * med['peft']:>10.1f}"
                  f"{r:>14.3f}{med['tflops']:>10.3g}{100 * med['tflops'] / peak:>7.1f}%  "
                  f"{'met' if r >= 0.90 else 'NOT MET'}")

    if op_results:
        lo, hi = min(op_results[0][1]), max(op_results[0][1])
        print(f"\nTable 3: host ops per fused step (torch.profiler aten ops), N={lo} vs N={hi}; target: "
              f"N={hi} at most 1.5x N={lo}")
        print("  all = every aten op, nested ones too (the per-tensor loops inside CPU multi-tensor kernels);")
        print("  top = ops the host dispatches itself (on a GPU, each one launch or more)")
        hdr = (f"{'model':<16}{f'all N={lo}':>10}{f'all N={hi}':>11}{'ratio':>7}{f'top N={lo}':>10}"
               f"{f'top N={hi}':>11}{'ratio':>7}  policy")
        print(hdr)
        print("-" * len(hdr))
        for size, counts, policy in op_results:
            (a_lo, t_lo), (a_hi, t_hi) = counts[lo], counts[hi]
            mode = ("tenants share micro-batches" if policy["mix_tenants"]
                    else "each tenant its own micro-batches (sharing not proven here)")
            print(f"{LABELS[size]:<16}{a_lo:>10}{a_hi:>11}{a_hi / a_lo:>7.2f}{t_lo:>10}{t_hi:>11}{t_hi / t_lo:>7.2f}"
                  f"  {mode}")


if __name__ == "__main__":
    sys.exit(main())
