"""Per-step overhead of the HTTP/SDK path versus the bare runtime.

The same forward_backward + optim_step loop, on the same model and batch, run

  (a) in-process: the runtime's pass and AdamW step launched, one wait for the device, both read:
      what one server cycle does (``launch_forward_backward``, ``launch_optim_steps``, ``wait``);
  (b) through the real ``tinker`` SDK against a ``hosted_tinker serve`` process on loopback,
      pipelined as the Tinker docs recommend (post fb, post optim, then wait on both);
  (b') the same with a "naive" client that waits for fb before posting optim_step;
  (c) the pipelined SDK against a server that does no work (no_work_server.py): it answers from
      memory, its pass a timer as long as the last (a) step. What (c) adds over (a) is the SDK's
      and loopback HTTP's own share of a step on this machine, under any server: the floor of (b).

Modes are interleaved step by step ((a), (b), (b'), (c), then (b), (b'), (c), (a), ...) after a warm-up
of each, and never run concurrently: the server is idle while (a) runs, and (a)'s process is
idle while (b) runs. Prints median / p90 step time of each, the median overhead (b - a) in ms
(difference of medians, and median of the paired per-round differences, which is steadier
on a busy machine), the ratio median(b) / median(a), and a server-side breakdown from
/metrics (cycles per step, time in cycles, time outside cycles). Targets (issue 42, on an idle
2-core CPU): the pipelined step at most 5 ms over the in-process one (paired median), each POST
answered in <= 0.5 ms of server time, a cycle <= 1 ms over the same work in process.

    .venv/bin/python benchmarks/overhead.py [--steps 40] [--hidden 256] [--layers 4] \
        [--batch 4] [--seq-len 96]

A benchmark, not a test: it asserts nothing about time and exits 0.
"""

from __future__ import annotations

import argparse
import os
import re
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

os.environ.setdefault("TINKER_TELEMETRY", "0")

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "tests"))

import httpx  # noqa: E402
import numpy as np  # noqa: E402
import torch  # noqa: E402

from hosted_tinker.models.embedded import TinyModelSpec, build_tiny_model  # noqa: E402
from hosted_tinker.models.loading import load_base_model, pick_device, pick_dtype  # noqa: E402
from hosted_tinker.requests.kinds import DatumWork, FBWork  # noqa: E402
from hosted_tinker.runtime.adapters import AdamParams, LoRAConfig  # noqa: E402
from hosted_tinker.runtime.losses import resolve_loss_config  # noqa: E402
from hosted_tinker.runtime.trainer import TrainingRuntime  # noqa: E402
from server_process import ServerProcess  # noqa: E402
from bench_common import cpu_stall_us, cycle_step, sdk_datums  # noqa: E402

API_KEY = "tml-bench"
RANK = 32
LR = 1e-4
BUSY_PRESSURE = 0.25  # above this CPU pressure (PSI) other work distorted the timings


def pct(xs: list[float], q: float) -> float:
    s = sorted(xs)
    if not s:
        return float("nan")
    k = (len(s) - 1) * q
    lo, hi = int(k), min(int(k) + 1, len(s) - 1)
    return s[lo] + (s[hi] - s[lo]) * (k - lo)


def scrape(base_url: str) -> dict[str, float]:
    """Every series of /metrics, keyed by name and labels."""
    text = httpx.get(f"{base_url}/metrics", timeout=10).text
    out: dict[str, float] = {}
    for line in text.splitlines():
        if line.startswith("#") or not line.strip():
            continue
        m = re.match(r'^(\w+)(\{[^}]*\})?\s+(\S+)$', line)
        if m:
            out[m.group(1) + (m.group(2) or "")] = float(m.group(3))
    return out


class SdkRequestClock:
    """When each HTTP request of the SDK left and its answer was in (httpx.AsyncClient.send, which
    every SDK request goes through), to split a step into the SDK's own time and the rest: the SDK
    builds and sends the first request, and after the last answer parses it and hands the result to
    the caller; no server can take those off a step."""

    def __init__(self):
        self.sent: list[tuple[float, float]] = []  # (left, answered), perf_counter seconds
        self._send = httpx.AsyncClient.send
        clock = self

        async def timed_send(client, request, *args, **kwargs):
            left = time.perf_counter()
            try:
                return await clock._send(client, request, *args, **kwargs)
            finally:
                if request.url.path in STEP_ROUTES:
                    clock.sent.append((left, time.perf_counter()))

        httpx.AsyncClient.send = timed_send

    def own_time(self, start: float, end: float) -> tuple[float, float] | None:
        """(before the first request left, after the last answer came) of a step from start to end."""
        inside = [(a, b) for a, b in self.sent if start <= a and b <= end]
        if not inside:
            return None
        return min(a for a, _ in inside) - start, end - max(b for _, b in inside)


STEP_ROUTES = {"/api/v1/forward_backward", "/api/v1/optim_step", "/api/v1/retrieve_future"}


def body_spec(hidden: int, layers: int) -> TinyModelSpec:
    """The model of `--hidden` and `--layers` (256 x 4 by default; 64 x 1 the tiny body)."""
    head_dim = 64 if hidden >= 256 else 16
    heads = max(1, hidden // head_dim)
    return TinyModelSpec(hidden_size=hidden, num_layers=layers, num_heads=heads,
                         num_kv_heads=max(1, heads // 2) if heads % 2 == 0 else heads,
                         head_dim=head_dim, intermediate_size=3 * hidden)


def make_batch(batch: int, seq_len: int, vocab: int, seed: int = 0) -> list[list[int]]:
    rng = np.random.default_rng(seed)
    return [rng.integers(0, vocab, seq_len + 1).tolist() for _ in range(batch)]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--steps", type=int, default=40, help="measured steps per mode (default 40)")
    ap.add_argument("--warmup", type=int, default=3, help="warm-up steps per mode (default 3)")
    ap.add_argument("--block", type=int, default=1,
                    help="steps of one mode before switching to the next (default 1)")
    ap.add_argument("--hidden", type=int, default=256)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--batch", type=int, default=4, help="datums per forward_backward (default 4)")
    ap.add_argument("--seq-len", type=int, default=96, help="tokens per datum (default 96)")
    ap.add_argument("--server-arg", action="append", default=[], metavar="ARG",
                    help="extra argument for `hosted_tinker serve`, repeatable, e.g. "
                         "--server-arg=--gather-window-s=0 (default: none, the server's defaults)")
    args = ap.parse_args()
    # (a) computes on as many threads as the server's device loop (--cpu-threads, default auto: the
    # CPUs less one), so that the difference is the HTTP/SDK path and not the thread count.
    from hosted_tinker.runtime.cpu_threads import choose_threads

    given = [a.split("=", 1)[1] for a in args.server_arg if a.startswith("--cpu-threads=")]
    torch.set_num_threads(choose_threads(given[-1] if given else "auto").threads)

    tmp = Path(tempfile.mkdtemp(prefix="ht-overhead-"))
    model_dir = build_tiny_model(tmp / "model", body_spec(args.hidden, args.layers))
    base_model = str(model_dir)

    t0 = time.perf_counter()
    server = ServerProcess(tmp / "server", base_model=base_model, args=tuple(args.server_arg))
    no_work = None
    try:
        server.start()
        print(f"server up in {time.perf_counter() - t0:.1f}s at {server.base_url} "
              f"({' '.join(args.server_arg) or 'default settings'})")
        no_work, no_work_url = start_no_work_server(server.base_url)
        return run(args, server, no_work_url, base_model, model_dir)
    finally:
        if no_work is not None:
            no_work.terminate()
            no_work.wait(timeout=30)
        server.stop()
        shutil.rmtree(tmp, ignore_errors=True)


def start_no_work_server(upstream: str) -> tuple[subprocess.Popen, str]:
    """Mode (c)'s server (no_work_server.py), in a process of its own as a real server is."""
    proc = subprocess.Popen([sys.executable, str(ROOT / "benchmarks" / "no_work_server.py"), "--upstream", upstream],
                            stdout=subprocess.PIPE, text=True)
    port = int(proc.stdout.readline().split()[-1])
    if proc.stdout.readline().strip() != "accepting connections":
        raise RuntimeError("the no-work server did not start")
    return proc, f"http://127.0.0.1:{port}"


def run(args, server: ServerProcess, no_work_url: str, base_model: str, model_dir: Path) -> int:
    import tinker

    # ---- (a) in-process runtime, loaded the way the server loads it ----
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()
    # Same device and dtype as the server's defaults (--device auto --dtype auto).
    device = pick_device("auto")
    model, _tok = load_base_model(base_model, server.data_dir, device, pick_dtype("auto", device))
    runtime = TrainingRuntime(model, base_model, device=device)
    runtime.create_adapter("bench", LoRAConfig(rank=RANK, seed=0))
    seqs = make_batch(args.batch, args.seq_len, min(runtime.vocab_size, 1000))
    works = [FBWork(model_id="bench", loss_fn="cross_entropy",
                    loss_config=resolve_loss_config("cross_entropy", {}), forward_only=False,
                    data=[DatumWork(np.asarray(s[:-1], dtype=np.int64),
                                    {"target_tokens": np.asarray(s[1:], dtype=np.int64),
                                     "weights": np.ones(len(s) - 1, dtype=np.float32)})
                          for s in seqs])]
    adam = AdamParams(learning_rate=LR)

    step_a = InProcessStep(runtime, works, adam)
    print(f"model: hidden {args.hidden} x {args.layers} layers, "
          f"{sum(p.numel() for p in model.parameters()) / 1e6:.1f}M params, "
          f"LoRA rank {RANK}; batch {args.batch} x {args.seq_len} tokens; "
          f"device {device}, torch threads {torch.get_num_threads()}, {os.cpu_count()} CPUs")

    # ---- (b) the real SDK over loopback ----
    # One training client (one adapter) per SDK mode: the server adapts to how a client posts
    # (it learns that a model pipelines), so the naive loop gets a model of its own.
    sdk_clock = SdkRequestClock()
    sc = tinker.ServiceClient(base_url=server.base_url, api_key=API_KEY)
    tc_pipe = sc.create_lora_training_client(base_model=base_model, rank=RANK, seed=0).result()
    tc_naive = sc.create_lora_training_client(base_model=base_model, rank=RANK, seed=0).result()
    sc_floor = tinker.ServiceClient(base_url=no_work_url, api_key=API_KEY)
    tc_floor = sc_floor.create_lora_training_client(base_model=base_model, rank=RANK, seed=0).result()
    try:
        return measure(args, server, no_work_url, step_a, sdk_clock, (tc_pipe, tc_naive, tc_floor), seqs)
    finally:
        sc_floor.holder.close()
        sc.holder.close()


class InProcessStep:
    """Mode (a): one step on the runtime in this process, done as a server cycle does it
    (bench_common.cycle_step), so that (b) is held to what the server's own cycle could do. The
    last one's seconds are (c)'s pass."""

    def __init__(self, runtime: TrainingRuntime, works: list[FBWork], adam: AdamParams):
        self.runtime, self.works, self.adam = runtime, works, adam
        self.last = 0.0

    def __call__(self) -> float:
        t = time.perf_counter()
        cycle_step(self.runtime, self.works, [("bench", self.adam)])
        self.last = time.perf_counter() - t
        return self.last


def measure(args, server: ServerProcess, no_work_url: str, step_a: InProcessStep, sdk_clock: SdkRequestClock,
            clients, seqs: list[list[int]]) -> int:
    """Every mode's steps, interleaved, and the report."""
    from tinker import types

    tc_pipe, tc_naive, tc_floor = clients
    datums = sdk_datums(seqs)
    sdk_adam = types.AdamParams(learning_rate=LR)

    def pipelined(tc) -> float:
        t = time.perf_counter()
        fb = tc.forward_backward(datums, "cross_entropy")
        opt = tc.optim_step(sdk_adam)
        fb.result()
        opt.result()
        return time.perf_counter() - t

    floor_passes: list[float] = []  # each (c) step's timer pass

    def step_floor() -> float:
        reply = httpx.post(f"{no_work_url}/_pass_seconds", content=str(step_a.last), timeout=10)
        reply.raise_for_status()
        if floor_passes and not reply.json()["answering_from_memory"]:  # past its first step
            raise RuntimeError("the no-work server still passes the steps on to the real server")
        floor_passes.append(step_a.last)
        return pipelined(tc_floor)

    def step_naive() -> float:
        t = time.perf_counter()
        tc_naive.forward_backward(datums, "cross_entropy").result()
        tc_naive.optim_step(sdk_adam).result()
        return time.perf_counter() - t

    sdk_own: dict[str, list[tuple[float, float]]] = {"pipelined": [], "naive": [], "floor": []}

    def sdk_timed(step, mode):
        def timed() -> float:
            start = time.perf_counter()
            seconds = step()
            own = sdk_clock.own_time(start, start + seconds)
            if own is not None:
                sdk_own[mode].append(own)
            return seconds
        return timed

    modes = {"a": step_a, "pipelined": sdk_timed(lambda: pipelined(tc_pipe), "pipelined"),
             "naive": sdk_timed(step_naive, "naive"), "floor": sdk_timed(step_floor, "floor")}
    times: dict[str, list[float]] = {m: [] for m in modes}
    # Per measured SDK step: (cycles, seconds in cycles, {route: http seconds}) from /metrics,
    # scraped between steps (outside the timed region).
    server_steps: dict[str, list[tuple[float, float, dict[str, float]]]] = {"pipelined": [], "naive": []}

    for fn in modes.values():
        for _ in range(args.warmup):
            fn()
    print(f"warm-up done; one in-process step takes ~{1000 * statistics.median(step_a() for _ in range(3)):.0f} ms")

    # Rounds of `block` steps of each mode, the order rotating every round: a burst of load
    # from elsewhere on the machine then hits all modes alike, and step i of each mode comes
    # from the same round (the paired differences below compare neighbours in time).
    order = list(modes)
    done = 0
    stall0, wall0 = cpu_stall_us(), time.monotonic()
    while done < args.steps:
        n = min(args.block, args.steps - done)
        for m in order:
            before = scrape(server.base_url) if m in server_steps else None
            for _ in range(n):
                times[m].append(modes[m]())
                if before is not None:
                    after = scrape(server.base_url)
                    server_steps[m].append(_delta(before, after))
                    before = after
        order.append(order.pop(0))
        done += n
    stall1 = cpu_stall_us()
    busy = False
    if stall0 is not None and stall1 is not None:
        pressure = (stall1 - stall0) / 1e6 / (time.monotonic() - wall0)
        busy = pressure > BUSY_PRESSURE
        print(f"CPU pressure during the measured steps: {100 * pressure:.0f}% of the time some task "
              f"waited for a CPU (this benchmark alone causes ~5-10%)")
        if busy:
            print("WARNING: the machine was busy with other work; these timings are not reliable, "
                  "run again when it is idle")

    for m in sdk_own:  # the warm-up's steps are not measured
        sdk_own[m] = sdk_own[m][-len(times[m]):] if times[m] else []
    floor_passes[:] = floor_passes[-len(times["floor"]):]  # the warm-up's are not measured
    report(args, times, server_steps, sdk_own, busy, floor_passes)
    return 0


def _delta(before: dict[str, float], after: dict[str, float]) -> tuple[float, float, dict[str, float]]:
    def d(k: str) -> float:  # summed over the served models (a base_model label)
        return sum(v - before.get(key, 0.0) for key, v in after.items()
                   if key == k or key.startswith(k + '{base_model="'))

    prefix = 'hosted_tinker_http_request_seconds_total{route="'
    http = {k[len(prefix):-2]: d(k) for k in after if k.startswith(prefix)}
    return d("hosted_tinker_cycles_total"), d("hosted_tinker_cycle_seconds_total"), http


def report(args, times: dict[str, list[float]], server_steps, sdk_own, busy: bool, floor_passes: list[float]) -> None:
    ms = {m: [1000 * t for t in ts] for m, ts in times.items()}
    med_a = statistics.median(ms["a"])
    print()
    print(f"{'mode':<22}{'steps':>6}{'median ms':>11}{'p90 ms':>9}{'overhead ms':>13}{'paired ms':>11}"
          f"{'ratio':>8}")
    rows = [("(a) in-process", "a"), ("(b) SDK pipelined", "pipelined"), ("(b') SDK naive", "naive"),
            ("(c) no-work server", "floor")]
    pairs = {m: ms["a"] for m in ms}
    pairs["floor"] = [1000 * t for t in floor_passes]  # (c)'s own timer: the (a) step just before it
    for label, m in rows:
        med, p90 = statistics.median(ms[m]), pct(ms[m], 0.9)
        over = "" if m == "a" else f"{med - med_a:+.1f}"
        paired = "" if m == "a" else f"{statistics.median(b - a for a, b in zip(pairs[m], ms[m])):+.1f}"
        ratio = "" if m == "a" else f"{med / med_a:.3f}"
        print(f"{label:<22}{len(ms[m]):>6}{med:>11.1f}{p90:>9.1f}{over:>13}{paired:>11}{ratio:>8}")
    paired_b = statistics.median(b - a for a, b in zip(ms["a"], ms["pipelined"]))
    verdict = "not judged (busy machine)" if busy else ("MET" if paired_b <= 5.0 else "NOT MET")
    print(f"target (pipelined): paired overhead <= 5 ms -> {verdict}")
    print("  overhead = median(b) - median(a); paired = median over rounds of (b_i - a_i)")
    floor = statistics.median(b - a for a, b in zip(pairs["floor"], ms["floor"]))
    print(f"  (c): paired against its own timer pass. The SDK and loopback HTTP alone add {floor:+.1f} ms to a step"
          f" on this machine: no server can add less; (b) - (c) = {paired_b - floor:+.1f} ms is this server's share")

    print()
    print("where (b)'s time goes, per step, medians over steps (server /metrics scraped between steps):")
    print(f"{'mode':<22}{'cycles':>8}{'in cycles':>11}{'- (a)':>8}{'outside':>9}{'fb http':>9}{'optim http':>12}"
          f"{'SDK first':>11}{'SDK last':>10}")
    for label, m in rows[1:3]:
        steps = server_steps[m]
        if not steps:
            continue
        cycles = statistics.mean(c for c, _, _ in steps)
        in_cyc = [1000 * s for _, s, _ in steps]
        outside = [t - c for t, c in zip(ms[m], in_cyc)]
        fb = statistics.median(1000 * h.get("/api/v1/forward_backward", 0.0) for _, _, h in steps)
        op = statistics.median(1000 * h.get("/api/v1/optim_step", 0.0) for _, _, h in steps)
        med_in = statistics.median(in_cyc)
        own = sdk_own.get(m) or [(float("nan"), float("nan"))]
        first = statistics.median(1000 * a for a, _ in own)
        last = statistics.median(1000 * b for _, b in own)
        print(f"{label:<22}{cycles:>8.2f}{med_in:>11.1f}{med_in - med_a:>+8.1f}{statistics.median(outside):>9.1f}"
              f"{fb:>9.1f}{op:>12.1f}{first:>11.1f}{last:>10.1f}")
    print("  cycles: scheduler cycles per step (1 = fb and optim fused into one cycle)")
    print("  in cycles: server time inside clock cycles (fused fb + optim + resolving futures);"
          " '- (a)': minus (a)'s median")
    print("  outside: client step time minus in-cycle time (HTTP, SDK, (de)serialisation, waits"
          " before a cycle starts, long-poll wake-up)")
    print("  fb/optim http: server time answering those POSTs (decode, validate, enqueue); targets: <= 0.5 ms each,"
          " '- (a)' <= 1 ms")
    print("  SDK first / last: the SDK's own time before its first request leaves and after its last answer is in"
          " (part of 'outside' that no server removes)")


if __name__ == "__main__":
    sys.exit(main())
