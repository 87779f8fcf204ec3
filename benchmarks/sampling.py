"""Sampling throughput: the built-in batched engine vs `transformers` `generate` + PEFT per request.

64 concurrent requests (default) x 64 new tokens each, spread round-robin over 4 distinct LoRA
adapters (rank 16, non-zero B), prompts of ~32 tokens (28..36), temperature 1, no stop tokens,
so every request generates exactly 64 tokens:

  engine:   ``SamplingEngine`` + ``SnapshotCache``, all requests submitted at once and run to
            completion with ``engine.run`` (what the server's clock-cycle thread does when no
            training work waits); adapters are the sampler checkpoints ``TrainingRuntime.save``
            writes, loaded through the snapshot cache as the server loads them;
  baseline: a ``PeftModel`` holding the same 4 adapters; per request ``set_adapter`` +
            ``model.generate(max_new_tokens=64, min_new_tokens=64, do_sample=True, top_k=0)``,
            one request after another. To bound the run it generates for a subset of the
            requests (``--baseline-requests``, default 16) and extrapolates to all of them from
            the measured per-request time (the output says so).

Time-to-first-token (TTFT): the engine's at 1 and at 64 concurrent requests (all submitted at
once with max_tokens=1, timed from submission to each request's ``on_done``); the baseline's at
1 request (generate with max_new_tokens=1) and, at 64, what request-by-request serving implies
(the median request waits for the ones before it: derived, not measured).

Rounds interleave engine and baseline, after a warm-up of each; figures are medians over
rounds. Target (issue): engine tokens/s >= 5x the per-request baseline.

    .venv/bin/python benchmarks/sampling.py [--preset small] [--requests 64] [--new-tokens 64] \
        [--adapters 4] [--baseline-requests 16] [--rounds 3] [--threads 1]

A benchmark, not a test: it asserts nothing about time and exits 0.
"""

from __future__ import annotations

import argparse
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

from hosted_tinker.embedded_model import SPEC_PRESETS, build_tiny_model  # noqa: E402
from hosted_tinker.model_loading import pick_device, pick_dtype  # noqa: E402
from hosted_tinker.runtime.adapters import LoRAConfig  # noqa: E402
from hosted_tinker.runtime.trainer import TrainingRuntime  # noqa: E402
from hosted_tinker.sampling.engine import SampleJob, SamplingEngine  # noqa: E402
from hosted_tinker.sampling.snapshots import SnapshotCache  # noqa: E402
from bench_common import cpu_stall_us  # noqa: E402

RANK = 16


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize()


class Engine:
    """The built-in engine over adapter snapshots, as the server's sampling service wires it."""

    def __init__(self, model, runtime: TrainingRuntime, tokenizer, device):
        self.engine = SamplingEngine(model, runtime.routing, tokenizer, device)
        self.snapshots = SnapshotCache(runtime.layers, device)
        self.device = device

    def run(self, prompts: list[list[int]], adapters: list[str], max_tokens: int, seed0: int):
        """Submit every request at once, run to completion; return (wall s, per-request done s, tokens)."""
        t0 = time.perf_counter()
        done: list[float | None] = [None] * len(prompts)
        results: list = [None] * len(prompts)
        errors: list[str] = []

        def on_done(i):
            def cb(res):
                done[i] = time.perf_counter() - t0
                results[i] = res
            return cb

        for i, (p, a) in enumerate(zip(prompts, adapters)):
            self.engine.submit(SampleJob(prompt=p, num_samples=1, max_tokens=max_tokens, adapter_id=a,
                                         temperature=1.0, seed=seed0 + i, stop_token_ids=frozenset(),
                                         on_done=on_done(i), on_error=errors.append))
        self.engine.run(lambda: False, max_seconds=1e9,
                        resolve_adapter=lambda job: self.snapshots.ensure(Path(job.adapter_id)))
        sync(self.device)
        wall = time.perf_counter() - t0
        if errors or any(d is None for d in done):
            raise RuntimeError(f"engine: {len(errors)} requests failed: {errors[:1]}")
        tokens = sum(len(s.tokens) for r in results for s in r.sequences)
        return wall, done, tokens


class Baseline:
    """`transformers` generate on a PeftModel with every adapter loaded, one request at a time."""

    def __init__(self, peft_model, pad_id: int, device):
        self.model = peft_model
        self.pad_id = pad_id
        self.device = device

    def one(self, prompt: list[int], adapter: str, new_tokens: int, seed: int) -> tuple[float, int]:
        t0 = time.perf_counter()
        self.model.set_adapter(adapter)
        torch.manual_seed(seed)
        ids = torch.tensor([prompt], device=self.device)
        out = self.model.generate(input_ids=ids, attention_mask=torch.ones_like(ids),
                                  max_new_tokens=new_tokens, min_new_tokens=new_tokens, do_sample=True,
                                  temperature=1.0, top_k=0, top_p=1.0, pad_token_id=self.pad_id)
        sync(self.device)
        return time.perf_counter() - t0, out.shape[1] - ids.shape[1]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--preset", choices=sorted(SPEC_PRESETS), default="small",
                    help="model shape (default small = hidden 256 x 4 layers)")
    ap.add_argument("--requests", type=int, default=64, help="concurrent requests (default 64)")
    ap.add_argument("--new-tokens", type=int, default=64, help="tokens generated per request (default 64)")
    ap.add_argument("--adapters", type=int, default=4, help="distinct adapters (default 4)")
    ap.add_argument("--prompt-len", type=int, default=32, help="mean prompt length, +-4 (default 32)")
    ap.add_argument("--baseline-requests", type=int, default=16,
                    help="requests the baseline actually generates per round (default 16; "
                         "its throughput is extrapolated to --requests)")
    ap.add_argument("--rounds", type=int, default=3, help="measured rounds (default 3)")
    ap.add_argument("--threads", type=int, default=1,
                    help="torch intra-op threads, the same for both (default 1: on a shared 2-core box "
                         "2 OpenMP threads made steps many times slower when other jobs run)")
    ap.add_argument("--device", default="auto", help="auto (cuda if present), cpu or cuda")
    args = ap.parse_args()

    torch.set_num_threads(args.threads)
    device = pick_device(args.device)
    dtype = pick_dtype("auto", device)

    from peft import PeftModel
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()
    hf_logging.set_verbosity_error()
    tmp = Path(tempfile.mkdtemp(prefix="ht-sampling-"))
    spec = SPEC_PRESETS[args.preset]
    model_dir = build_tiny_model(tmp / "model", spec)
    tokenizer = AutoTokenizer.from_pretrained(model_dir)

    # Adapters: made by the training runtime, B perturbed (a fresh adapter's B is 0, which would
    # make every adapter the base model), saved as sampler checkpoints (standard PEFT files).
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=dtype).to(device)
    n_params = sum(p.numel() for p in model.parameters())
    runtime = TrainingRuntime(model, str(model_dir), device=device)
    adapter_dirs = []
    for a in range(args.adapters):
        mid = f"adapter-{a}"
        adapter = runtime.create_adapter(mid, LoRAConfig(rank=RANK, seed=a))
        with torch.no_grad():
            for w in adapter.weights.values():
                w.B.normal_(0, 0.02)
        out = tmp / "adapters" / mid
        runtime.save(mid, out, with_optimizer=False)
        runtime.remove_adapter(mid)  # sampling uses the snapshots only
        adapter_dirs.append(str(out))
    engine = Engine(model, runtime, tokenizer, device)

    base = AutoModelForCausalLM.from_pretrained(model_dir, dtype=dtype).to(device)
    peft_model = PeftModel.from_pretrained(base, adapter_dirs[0], adapter_name="a0")
    for a in range(1, args.adapters):
        peft_model.load_adapter(adapter_dirs[a], adapter_name=f"a{a}")
    peft_model.eval()
    baseline = Baseline(peft_model, tokenizer.pad_token_id or 0, device)

    rng = np.random.default_rng(0)
    vocab = min(len(tokenizer), 1000)
    prompts = [rng.integers(0, vocab, int(rng.integers(args.prompt_len - 4, args.prompt_len + 5))).tolist()
               for _ in range(args.requests)]
    which = [i % args.adapters for i in range(args.requests)]
    eng_adapters = [adapter_dirs[a] for a in which]
    n_base = min(args.baseline_requests, args.requests)
    new = args.new_tokens

    print(f"model {args.preset} (hidden {spec.hidden_size} x {spec.num_layers} layers, {n_params / 1e6:.1f}M "
          f"params), device {device} ({dtype}), torch {torch.__version__}, torch threads "
          f"{torch.get_num_threads()}, {os.cpu_count()} CPUs")
    print(f"{args.requests} requests x {new} new tokens, {args.adapters} adapters (LoRA rank {RANK}, "
          f"round-robin), prompts {min(map(len, prompts))}..{max(map(len, prompts))} tokens, temperature 1")

    # Warm-up: snapshot loads, first-call costs of both paths.
    engine.run(prompts, eng_adapters, 4, seed0=10_000)
    for i in range(min(2, n_base)):
        baseline.one(prompts[i], f"a{which[i]}", 4, seed=i)

    eng_tps, base_tps, eng_walls, base_req = [], [], [], []
    ttft1_eng, ttft64_med, ttft64_max, ttft1_base = [], [], [], []
    stall0, t_start = cpu_stall_us(), time.perf_counter()
    for rnd in range(args.rounds):
        order = ["engine", "baseline"] if rnd % 2 == 0 else ["baseline", "engine"]
        for what in order:
            if what == "engine":
                wall, _, tokens = engine.run(prompts, eng_adapters, new, seed0=1000 * rnd)
                if tokens != args.requests * new:
                    raise RuntimeError(f"engine generated {tokens} tokens, expected {args.requests * new}")
                eng_tps.append(tokens / wall)
                eng_walls.append(wall)
                _, done, _ = engine.run(prompts[:1], eng_adapters[:1], 1, seed0=rnd)
                ttft1_eng.append(done[0])
                _, done, _ = engine.run(prompts, eng_adapters, 1, seed0=rnd)
                ttft64_med.append(statistics.median(done))
                ttft64_max.append(max(done))
            else:
                times, tokens = [], 0
                # A different slice of the requests each round, so every adapter and prompt length appears.
                for k in range(n_base):
                    i = (rnd * n_base + k) % args.requests
                    t, n = baseline.one(prompts[i], f"a{which[i]}", new, seed=1000 * rnd + i)
                    times.append(t)
                    tokens += n
                if tokens != n_base * new:
                    raise RuntimeError(f"baseline generated {tokens} tokens, expected {n_base * new}")
                base_tps.append(tokens / sum(times))
                base_req.append(statistics.mean(times))
                ttft1_base.append(baseline.one(prompts[rnd % args.requests], f"a{which[rnd % args.requests]}",
                                               1, seed=rnd)[0])
        print(f"  round {rnd + 1}: engine {eng_tps[-1]:.0f} tok/s, baseline {base_tps[-1]:.0f} tok/s", flush=True)
    wall = time.perf_counter() - t_start
    stall1 = cpu_stall_us()

    med = statistics.median
    e, b = med(eng_tps), med(base_tps)
    per_req = med(base_req)
    print()
    print(f"Generated tokens/s, {args.requests} concurrent requests x {new} tokens, {args.adapters} adapters "
          f"(medians of {args.rounds} rounds)")
    hdr = f"{'path':<44}{'tokens/s':>10}{'wall s (64 req)':>17}"
    print(hdr)
    print("-" * len(hdr))
    print(f"{'built-in engine (all at once)':<44}{e:>10.0f}{med(eng_walls):>17.2f}")
    print(f"{'transformers generate + PEFT, per request *':<44}{b:>10.0f}{per_req * args.requests:>17.2f}")
    print(f"ratio engine / baseline: {e / b:.2f}x   target >= 5x: {'MET' if e / b >= 5 else 'NOT MET'}")
    print(f"  * measured on {n_base} of the {args.requests} requests per round ({med(base_req) * 1000:.0f} ms "
          f"per request), extrapolated: one request after another, throughput does not depend on the count")
    print()
    print("Time to first token (ms)")
    hdr = f"{'path':<44}{'1 request':>11}{'64 concurrent: median':>23}{'max':>8}"
    print(hdr)
    print("-" * len(hdr))
    print(f"{'built-in engine':<44}{1000 * med(ttft1_eng):>11.1f}{1000 * med(ttft64_med):>23.1f}"
          f"{1000 * med(ttft64_max):>8.1f}")
    # Request k (0-based) of 64 served one by one waits for k whole requests, then its first token.
    t1b = med(ttft1_base)
    waits = [k * per_req + t1b for k in range(args.requests)]
    print(f"{'transformers generate + PEFT, per request **':<44}{1000 * t1b:>11.1f}{1000 * med(waits):>23.1f}"
          f"{1000 * max(waits):>8.1f}")
    print("  engine: submitted together with max_tokens=1, from submission to each request's on_done")
    print("  ** 1 request measured (max_new_tokens=1); 64 concurrent derived: the k-th request waits "
          "for k whole requests first")
    if stall0 is not None and stall1 is not None:
        pressure = (stall1 - stall0) / 1e6 / wall
        print(f"\nCPU pressure: {100 * pressure:.0f}% of the time some task waited for a CPU"
              + (" -- the machine was busy with other work; ratios are noisier than on an idle box"
                 if pressure > 0.25 else ""))
    return 0


if __name__ == "__main__":
    sys.exit(main())
