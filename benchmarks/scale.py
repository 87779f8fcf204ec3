"""Worker-pool scaling: training tokens/s on 1 rank and on 2 ranks (gloo, CPU), in one run.

T tenants (default 4), each with its own LoRA adapter (rank 16 on every attention and MLP
projection), each sending R datums x L tokens of cross_entropy per step (default 8 x 128), on
the `small` model (hidden 256 x 4 layers). A step is what one clock cycle does: one fused
`forward_backward` over every tenant, then one `optim_steps` over all of them.

  (a) 1 rank:  a `TrainingRuntime` in this process, 1 CPU thread;
  (b) 2 ranks: a `PoolRuntime` as `serve --workers 2` builds it (this process is rank 0, torchrun
               starts rank 1), 1 CPU thread each: each rank computes about half of every
               request's datums, the gradients are reduced into rank 0, which steps and sends
               the new weights back before the next pass. With --shard-base, the base model is
               sharded over the two ranks (FSDP2).

Both exist at once; every round runs one step of each, back to back, order rotating; the table
gives tokens/s (medians) and b/a as the median of the per-round ratios (a shared machine's speed
drifts over tens of seconds; a ratio inside one round cancels that). On 2 free cores the ideal b/a
is 2.0. Where a GPU is present, (a) also runs on cuda:0 and its tokens/s are printed beside the
CPU figures, followed by what a run over several GPUs needs.

    .venv/bin/python benchmarks/scale.py [--size small] [--tenants 4] [--rows 8] [--seq-len 128] \
        [--repeats 7] [--warmup 2] [--shard-base]

A benchmark, not a test: it asserts nothing about time and exits 0.
"""

from __future__ import annotations

import argparse
import logging
import os
import statistics
import sys
import tempfile
import time
import warnings
from pathlib import Path

warnings.filterwarnings("ignore", category=FutureWarning)
os.environ["HF_HUB_DISABLE_PROGRESS_BARS"] = "1"  # no weight-loading bars (this process and rank 1)

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

import torch  # noqa: E402

from hosted_tinker.config.settings import ServerConfig  # noqa: E402
from hosted_tinker.models.embedded import SPEC_PRESETS, build_tiny_model  # noqa: E402
from hosted_tinker.models.loading import load_base_model  # noqa: E402
from hosted_tinker.runtime.adapters import AdamParams, LoRAConfig  # noqa: E402
from hosted_tinker.runtime.trainer import TrainingRuntime  # noqa: E402
from hosted_tinker.server.served_models import make_runtime  # noqa: E402
from bench_common import cpu_stall_us, cycle_step, fb_work, paired_ratio, tenant_rows  # noqa: E402

LORA = LoRAConfig(rank=16, train_unembed=False)
ADAM = AdamParams(learning_rate=1e-4)

MULTI_GPU = """\
What a run over several GPUs needs (one machine, N GPUs; docs/scale.md):
  hosted-tinker serve --workers N --device cuda [--shard-base]
  - rank r uses cuda:r (pick the GPUs with CUDA_VISIBLE_DEVICES); tensors go over NCCL, commands and
    per-datum outputs over a gloo group; each pass's datums are split over the N ranks;
  - per pass, one NCCL reduce per trained adapter (its LoRA gradients: rank 32 on every projection of
    Qwen3-8B is 87M parameters, 350 MB in fp32), and before the next pass one broadcast of each
    stepped adapter's weights, the same bytes again: about a millisecond each over NVLink, tens of
    milliseconds over PCIe; the compute per rank drops to about 1/N of the cycle's tokens;
  - with --shard-base, FSDP2 all-gathers every decoder layer's weights in each micro-batch's forward
    and backward (2 x the base's bytes per micro-batch on every rank), which pays only when the
    base does not fit one GPU;
  - several machines: the same on machine 0 plus --nnodes M --master-addr/--master-port, and
    `launch.sh pool-node` on machines 1..M-1 (NCCL then crosses the network: InfiniBand or RoCE)."""


def step(runtime, works, adam: AdamParams) -> float:
    t = time.perf_counter()
    cycle_step(runtime, works, [(w.model_id, adam) for w in works])  # its one wait is the device's
    return time.perf_counter() - t


def with_adapters(runtime, works):
    for w in works:
        runtime.create_adapter(w.model_id, LORA)
    return runtime


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--size", default="small", choices=sorted(SPEC_PRESETS))
    ap.add_argument("--tenants", type=int, default=4)
    ap.add_argument("--rows", type=int, default=8, help="datums per tenant per step")
    ap.add_argument("--seq-len", type=int, default=128)
    ap.add_argument("--repeats", type=int, default=7, help="measured rounds")
    ap.add_argument("--warmup", type=int, default=2, help="steps of each variant before measuring")
    ap.add_argument("--shard-base", action="store_true", help="(b) shards the base model over its 2 ranks")
    args = ap.parse_args()
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")

    tmp = Path(tempfile.mkdtemp(prefix="ht-scale-"))
    src = build_tiny_model(tmp / args.size, SPEC_PRESETS[args.size])
    cpu = torch.device("cpu")
    rows = tenant_rows(args.tenants, args.rows, args.seq_len, vocab=1000)
    works = [fb_work(f"tenant-{t}", rows[t]) for t in range(args.tenants)]
    tokens = args.tenants * args.rows * args.seq_len
    print(f"{args.size} model ({src.name}), {args.tenants} tenants x {args.rows} datums x {args.seq_len} tokens = "
          f"{tokens} tokens per step; LoRA rank {LORA.rank} on attention + MLP; cross_entropy + AdamW; "
          f"{os.cpu_count()} CPUs, torch {torch.__version__}")

    config = ServerConfig(base_model=str(src), data_dir=tmp, device="cpu", workers=2, shard_base=args.shard_base,
                          log_level="warning")
    pool, _ = make_runtime(str(src), cpu, config, tmp)  # (b); sets this process's torch threads to 1 (2 ranks / 2 CPUs)
    try:
        torch.set_num_threads(1)
        single = TrainingRuntime(load_base_model(str(src), tmp, cpu, torch.float32)[0], str(src), device=cpu)
        variants = {"1 rank": with_adapters(single, works), "2 ranks": with_adapters(pool, works)}
        for rt in variants.values():
            for _ in range(args.warmup):
                step(rt, works, ADAM)
        times: dict[str, list[float]] = {k: [] for k in variants}
        stall0, t0 = cpu_stall_us(), time.perf_counter()
        for r in range(args.repeats):
            order = list(variants) if r % 2 == 0 else list(reversed(variants))
            for name in order:
                times[name].append(step(variants[name], works, ADAM))
        stall1, elapsed = cpu_stall_us(), time.perf_counter() - t0
    finally:
        pool.close()
    tps = {k: tokens / statistics.median(v) for k, v in times.items()}
    rows = {"1 rank": "CPU, 1 rank x 1 thread",
            "2 ranks": "CPU, 2 ranks x 1 thread" + (", base sharded (FSDP2)" if args.shard_base else "")}
    print(f"\n{'':46} {'tokens/s':>10} {'step ms':>9}")
    for key, label in rows.items():
        print(f"{label:46} {tps[key]:10.0f} {1000 * statistics.median(times[key]):9.1f}")
    print(f"2 ranks / 1 rank: {paired_ratio(times, '2 ranks', '1 rank'):.2f}x (median of {args.repeats} paired rounds; "
          "ideal 2.0 on 2 free cores)")
    if stall0 is not None and stall1 is not None:
        share = (stall1 - stall0) / 1e6 / elapsed
        print(f"CPU pressure during the measurement: runnable tasks waited {share:.0%} of the time"
              + ("  (other work competed for the CPUs: the ratio understates the scaling)" if share > 0.1 else ""))

    if torch.cuda.is_available():
        gpu = torch.device("cuda", 0)
        runtime = with_adapters(TrainingRuntime(load_base_model(str(src), tmp, gpu, torch.bfloat16)[0], str(src),
                                                device=gpu), works)
        for _ in range(args.warmup):
            step(runtime, works, ADAM)
        gpu_tps = tokens / statistics.median(step(runtime, works, ADAM) for _ in range(args.repeats))
        print(f"{'GPU, 1 rank (' + torch.cuda.get_device_name(gpu) + ', bf16)':46} {gpu_tps:10.0f}")
    else:
        print("GPU: none available in this run (torch.cuda.is_available() is False): no GPU figure")
    print("\n" + MULTI_GPU)
    return 0


if __name__ == "__main__":
    sys.exit(main())
