"""This checkout against an older revision, side by side in ONE run: training ratios and SDK overhead.

Comparing two separate runs of multi_tenant.py or overhead.py on a shared 2-core box compares the
box's moods: its speed drifts 10-20% over minutes, more than the changes being judged (two
revisions' overhead ratios, 5 separate runs each, differed by 4%; side by side they are equal).
Here both revisions' code runs in every round, in rotating order:

  training   one process holds both runtimes (the old revision's package imported under another
             name) and ONE plain-PEFT ideal shared by both; per (size, N) a round times the
             fused and the serial step of each revision and the ideal, as multi_tenant.py does.
             Prints a/c and a/b of each revision (medians of per-round ratios), and the fused
             step's speed new/old measured directly; then Table 2 (one tenant x 16 rows: runtime
             of each vs PEFT).
  overhead   one server per revision (each runs its own checkout's code) on one model, and both
             in-process runtimes here; a round is one step each of (a) in-process and (b) SDK
             pipelined for each revision. Prints each revision's ratio median(b)/median(a), as
             overhead.py does, and the paired differences new - old.
  images     one server per revision (each runs its own checkout's code) on a tiny Qwen3-VL; the
             requests issue 33 found costly although refused: one forward_backward of 17 flat
             4096 x 4096 PNGs over the key's image budget, 6 of them at once, and 64 such images
             over the model's context (with the budget raised). Prints, per revision and case, the
             status codes and the server process's CPU-seconds and peak-RSS growth.
  requests   one server per revision (each runs its own checkout's code) on one model; a round
             posts --per-round forward_backward bodies of each size to each server, queued behind
             a seq_id never sent (so no pass runs: what is measured is the host's work before a
             pass, HTTP, decoding, validation, the future's row, queueing), the servers in
             rotating order. Prints, per body, each server process's CPU per request (user +
             system, from its threads' schedstat; steadier than wall time on a shared box) and the median of per-round
             new/old ratios. Bodies: overhead.py's (4 x 96 tokens) and an RL batch's (64 x 1000).
  sampling   one process holds both revisions' SamplingEngine, each on its own copy of one model
             (sampling.py's preset) with the same adapters; a round runs sampling.py's load
             (--requests concurrent x --new-tokens, 4 adapters of rank --rank, temperature 1, seeded)
             through each engine, then the same requests with max_tokens=1 (the time until every
             request has its first token: prefill and first pick). Prints each revision's
             generated tokens per second of wall time and per second of the engine thread's CPU
             time (on a shared box the CPU time moves less with other work), that time (medians),
             and the medians of per-round new/old ratios.

    .venv/bin/python benchmarks/compare_revisions.py training --old REV [--sizes tiny,small,medium]
        [--tenants 1,2,4,8,16] [--rounds-scale 1.0] [--threads 1]
    .venv/bin/python benchmarks/compare_revisions.py overhead --old REV [--rounds 150] [--hidden 256 --layers 4]
    .venv/bin/python benchmarks/compare_revisions.py images --old REV
    .venv/bin/python benchmarks/compare_revisions.py requests --old REV [--rounds 7] [--per-round 20]
    .venv/bin/python benchmarks/compare_revisions.py sampling --old REV [--rounds 5] [--preset small]
        [--requests 64] [--new-tokens 64] [--rank 16] [--threads 1]

REV is any git revision of this repository (its code is taken with `git archive`). A benchmark,
not a test: it asserts nothing about time and exits 0.
"""

from __future__ import annotations

import argparse
import dataclasses
import importlib
import os
import re
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
import warnings
from pathlib import Path

warnings.filterwarnings("ignore", category=FutureWarning)
os.environ.setdefault("TINKER_TELEMETRY", "0")

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "tests"))
sys.path.insert(0, str(ROOT / "benchmarks"))

import numpy as np  # noqa: E402
import torch  # noqa: E402
from bench_common import cycle_step, first_module  # noqa: E402

PACKAGE = "hosted_tinker"
OLD_PACKAGE = "hosted_tinker_at_old_revision"


def checkout(rev: str, tmp: Path) -> Path:
    """REV's tree under tmp/src (to start its server from), and its package renamed under tmp/renamed."""
    src = tmp / "src"
    src.mkdir()
    archive = subprocess.run(["git", "-C", str(ROOT), "archive", rev], check=True, capture_output=True).stdout
    subprocess.run(["tar", "-x", "-C", str(src)], input=archive, check=True)
    renamed = tmp / "renamed" / OLD_PACKAGE
    shutil.copytree(src / PACKAGE, renamed)
    word = re.compile(rf"\b{PACKAGE}\b")
    for py in renamed.rglob("*.py"):
        if py.name.endswith("_pb2.py"):  # protoc's serialized descriptor: renaming inside it breaks its lengths,
            continue                     # and the same .proto registered twice is the same file to protobuf
        py.write_text(word.sub(OLD_PACKAGE, py.read_text()))
    sys.path.insert(0, str(tmp / "renamed"))
    return src


def modules(package: str):
    return [importlib.import_module(f"{package}.runtime.trainer"), importlib.import_module(f"{package}.runtime.adapters"),
            first_module(package, "models.loading", "model_loading")]  # the model loader moved in 43's layout


REVISIONS = (("old", OLD_PACKAGE), ("new", PACKAGE))


# ---- training -------------------------------------------------------------------------------------
def training(args, tmp: Path) -> None:
    import multi_tenant as mt
    from bench_common import fb_work, paired_ratio, tenant_rows
    torch.set_num_threads(args.threads)
    device, tenants = torch.device("cpu"), [int(n) for n in args.tenants.split(",")]
    print(f"training: old = {args.old}, new = this checkout; torch threads {args.threads}; "
          "a/c and a/b are medians of per-round ratios; 'fused new/old' is the fused step's speed ratio")
    for size in args.sizes.split(","):
        models = mt.build_models(size, tmp, device, torch.float32, copies=3)
        runtimes, adams = {}, {}
        for (tag, package), model in zip(REVISIONS, models):
            trainer, adapters, _ = modules(package)
            runtime = trainer.TrainingRuntime(model, size, device=device)
            lora = adapters.LoRAConfig(rank=mt.RANK, alpha=mt.ALPHA, train_unembed=False)
            for t in range(max(tenants)):
                adapter = runtime.create_adapter(f"tenant-{t}", dataclasses.replace(lora, seed=t))
                with torch.no_grad():  # non-zero B, as after a first step
                    for w in adapter.weights.values():
                        w.B.normal_(0, 1e-3)
            runtimes[tag], adams[tag] = runtime, adapters.AdamParams(learning_rate=mt.LR)
        peft_model, opt = mt.make_peft(models[2], moe=size in mt.MOE)
        vocab = min(runtimes["new"].vocab_size, 1000)
        rounds = max(3, int(mt.CPU_REPEATS[size] * args.rounds_scale))
        rows = tenant_rows(max(tenants), 2, 128, vocab)
        print(f"\n[{mt.LABELS[size]}] {rounds} rounds")
        print(f"  {'N':<4}{'a/c old':>9}{'a/c new':>9}{'a/b old':>9}{'a/b new':>9}{'fused new/old':>15}")
        for i, n in enumerate(sorted(tenants, reverse=True)):  # largest first: it grows the heap once
            works = {tag: [fb_work(f"tenant-{t}", rows[t], package) for t in range(n)]
                     for tag, package in REVISIONS}
            flat = np.concatenate(rows[:n])
            ids, targets = torch.as_tensor(flat[:, :-1]), torch.as_tensor(flat[:, 1:])
            variants = {}
            for tag, _ in REVISIONS:
                variants[f"fused {tag}"] = lambda tag=tag: mt.fused_step(runtimes[tag], works[tag], adams[tag])
                variants[f"serial {tag}"] = lambda tag=tag: mt.serial_step(runtimes[tag], works[tag], adams[tag])
            variants["ideal"] = lambda: mt.ideal_step(peft_model, opt, ids, targets)
            times = mt.measure(variants, 1 if i == 0 else 0, rounds, device)
            cells = [paired_ratio(times, f"fused {tag}", "ideal") for tag, _ in REVISIONS]
            cells += [paired_ratio(times, f"fused {tag}", f"serial {tag}") for tag, _ in REVISIONS]
            print(f"  {n:<4}" + "".join(f"{c:>9.3f}" for c in cells)
                  + f"{paired_ratio(times, 'fused new', 'fused old'):>15.3f}", flush=True)
        seqs = tenant_rows(1, 16, 128, vocab, seed=1)[0]
        works = {tag: [fb_work("tenant-0", seqs, package)] for tag, package in REVISIONS}
        ids, targets = torch.as_tensor(seqs[:, :-1]), torch.as_tensor(seqs[:, 1:])
        times = mt.measure({"runtime old": lambda: mt.fused_step(runtimes["old"], works["old"], adams["old"]),
                            "runtime new": lambda: mt.fused_step(runtimes["new"], works["new"], adams["new"]),
                            "peft": lambda: mt.ideal_step(peft_model, opt, ids, targets)}, 1, rounds, device)
        print(f"  Table 2, 1 tenant x 16 rows, runtime/PEFT: old {paired_ratio(times, 'runtime old', 'peft'):.3f}, "
              f"new {paired_ratio(times, 'runtime new', 'peft'):.3f}; "
              f"runtime new/old {paired_ratio(times, 'runtime new', 'runtime old'):.3f}", flush=True)


# ---- overhead -------------------------------------------------------------------------------------
def overhead(args, tmp: Path, old_tree: Path) -> None:
    from tinker import types

    from bench_common import fb_work, sdk_datums
    from hosted_tinker.models.embedded import build_tiny_model
    from hosted_tinker.runtime.cpu_threads import choose_threads
    from overhead import API_KEY, LR, RANK, body_spec, make_batch
    from server_process import ServerProcess

    # (a) computes on the threads the servers' device loops get (--cpu-threads auto), as in overhead.py:
    # on 2 cores torch's default of 2 made (a) ~90 ms against the servers' ~140 ms and the ratio meaningless.
    torch.set_num_threads(choose_threads("auto").threads)

    base_model = str(build_tiny_model(tmp / "model", body_spec(args.hidden, args.layers)))
    seqs = make_batch(4, 96, 1000)
    datums = sdk_datums(seqs)
    servers, steps = [], {}
    try:
        for tag, package in REVISIONS:
            server = ServerProcess(tmp / f"server-{tag}", base_model=base_model,
                                   checkout=old_tree if tag == "old" else ROOT)
            servers.append(server.start())
            trainer, adapters, loading = modules(package)
            device = loading.pick_device("auto")
            model, _ = loading.load_base_model(base_model, server.data_dir, device, loading.pick_dtype("auto", device))
            runtime = trainer.TrainingRuntime(model, base_model, device=device)
            runtime.create_adapter("bench", adapters.LoRAConfig(rank=RANK, seed=0))
            works = [fb_work("bench", np.asarray(seqs), package)]
            adam = adapters.AdamParams(learning_rate=LR)

            def in_process(runtime=runtime, works=works, adam=adam) -> None:
                cycle_step(runtime, works, [("bench", adam)])

            client = server.client(API_KEY).create_lora_training_client(
                base_model=base_model, rank=RANK, seed=0).result()

            def sdk_pipelined(client=client) -> None:
                fb = client.forward_backward(datums, "cross_entropy")
                opt = client.optim_step(types.AdamParams(learning_rate=LR))
                fb.result()
                opt.result()

            steps[f"a {tag}"], steps[f"b {tag}"] = in_process, sdk_pipelined
        for fn in steps.values():
            for _ in range(3):
                fn()
        times: dict[str, list[float]] = {m: [] for m in steps}
        order = list(steps)
        for _ in range(args.rounds):
            for m in order:
                t = time.perf_counter()
                steps[m]()
                times[m].append(1000 * (time.perf_counter() - t))
            order.append(order.pop(0))
    finally:
        for server in servers:
            server.stop()
    med = {m: statistics.median(v) for m, v in times.items()}
    print(f"overhead: old = {args.old}, new = this checkout; {args.rounds} rounds; hidden {args.hidden} x "
          f"{args.layers} layers; (a) in-process, (b) SDK pipelined")
    for tag, _ in REVISIONS:
        print(f"  {tag}: (a) {med['a ' + tag]:.1f} ms, (b) {med['b ' + tag]:.1f} ms, "
              f"ratio median(b)/median(a) {med['b ' + tag] / med['a ' + tag]:.3f}, "
              f"overhead {med['b ' + tag] - med['a ' + tag]:+.1f} ms")
    for mode in ("a", "b"):
        diffs = [new - old for old, new in zip(times[f"{mode} old"], times[f"{mode} new"])]
        print(f"  ({mode}) new - old, median of paired differences: {statistics.median(diffs):+.2f} ms")


# ---- images ---------------------------------------------------------------------------------------
IMAGE_KEY = "tml-bench-images"


def image_body(model_id: str, seq_id: int, image: bytes, n_images: int) -> bytes:
    """A forward_backward of one datum: `n_images` copies of `image`, a text token before each."""
    from tinker import types
    from tinker.proto.request_conv import forward_backward_request_to_proto

    chunks = [c for _ in range(n_images) for c in (types.EncodedTextChunk(tokens=[5]),
                                                    types.ImageChunk(data=image, format="png"))]
    datum = types.Datum(model_input=types.ModelInput(chunks=[*chunks, types.EncodedTextChunk(tokens=[6])]),
                        loss_fn_inputs={"target_tokens": [1], "weights": [1.0]})
    request = types.ForwardBackwardRequest(model_id=model_id, seq_id=seq_id, forward_backward_input=(
        types.ForwardBackwardInput(data=[datum], loss_fn="cross_entropy")))
    return forward_backward_request_to_proto(request).SerializeToString()


def refusal_costs(server, base_model: str, image: bytes, cases: dict[str, tuple[int, int]]) -> dict[str, str]:
    """Per case (concurrent requests, images each): their status codes, and the server's CPU-seconds
    and peak-RSS growth while it answered them."""
    import threading

    import httpx
    import psutil

    from helpers import metric

    proc, out = psutil.Process(server.proc.pid), {}
    with server.client(IMAGE_KEY) as sc, httpx.Client(base_url=server.base_url, timeout=900,
                                                      headers={"X-API-Key": IMAGE_KEY}) as http:
        model_id, seq = sc.create_lora_training_client(base_model=base_model, rank=4).result().model_id, 0
        for case, (concurrent, n_images) in cases.items():
            codes: list[int] = []
            bodies = [image_body(model_id, seq + i + 1, image, n_images) for i in range(concurrent)]
            seq += concurrent
            post = [threading.Thread(target=lambda b=b: codes.append(http.post(
                "/api/v1/forward_backward", content=b, headers={"Content-Type": "application/x-protobuf"}).status_code))
                for b in bodies]
            cpu, peak = sum(proc.cpu_times()[:2]), metric(server, "hosted_tinker_process_max_rss_bytes")
            for t in post:
                t.start()
            for t in post:
                t.join()
            grew = (metric(server, "hosted_tinker_process_max_rss_bytes") - peak) / 2**20
            out[case] = (f"status {sorted(codes)}, {sum(proc.cpu_times()[:2]) - cpu:.2f} CPU-s, "
                         f"peak RSS +{grew:.0f} MiB")
    return out


def images(args, tmp: Path, old_tree: Path) -> None:
    import io

    from PIL import Image

    from server_process import ServerProcess
    from tiny_vl_model import build_tiny_vl_model

    base_model = str(build_tiny_vl_model(tmp / "tiny-qwen3-vl"))
    buf = io.BytesIO()
    Image.new("RGB", (4096, 4096), (120, 30, 200)).save(buf, format="PNG")
    runs = [({}, {"17 images over the key's budget": (1, 17), "6 such requests at once": (6, 17)}),
            ({"HOSTED_TINKER_MAX_IMAGE_PIXELS_PER_KEY": str(1 << 31)}, {"64 images over the context": (1, 64)})]
    print(f"images: old = {args.old}, new = this checkout; a flat 4096 x 4096 PNG of {len(buf.getvalue())} bytes")
    for env, cases in runs:
        for tag, _ in REVISIONS:
            server = ServerProcess(tmp / f"images-{tag}-{len(cases)}", env=env, args=("--base-model", base_model),
                                   checkout=old_tree if tag == "old" else ROOT).start()
            try:
                for case, cost in refusal_costs(server, base_model, buf.getvalue(), cases).items():
                    print(f"  {tag}: {case}: {cost}")
            finally:
                server.stop()


# ---- requests -------------------------------------------------------------------------------------
REQUEST_BODIES = ((4, 96), (64, 1000))  # (datums, tokens each): overhead.py's default body; an RL batch's


def requests(args, tmp: Path, old_tree: Path) -> None:
    import httpx

    from bench_common import cpu_ms_per_post, forward_backward_message, sdk_datums
    from hosted_tinker.models.embedded import TinyModelSpec, build_tiny_model
    from overhead import API_KEY, RANK, make_batch
    from server_process import ServerProcess

    base_model = str(build_tiny_model(tmp / "model", TinyModelSpec()))
    # one encoded request per body, its model_id and seq_id set before each post
    messages = {(n, tokens): forward_backward_message(sdk_datums(make_batch(n, tokens, 1000)))
                for n, tokens in REQUEST_BODIES}
    servers, targets = [], {}
    try:
        for tag, _ in REVISIONS:
            server = ServerProcess(tmp / f"server-{tag}", base_model=base_model, args=("--gap-timeout-s", "3600"),
                                   checkout=old_tree if tag == "old" else ROOT)
            servers.append(server.start())
            model_id = server.client(API_KEY).create_lora_training_client(  # closed by server.stop()
                base_model=base_model, rank=RANK, seed=0).result().model_id
            http = httpx.Client(base_url=server.base_url, timeout=60, headers={"X-API-Key": API_KEY})
            targets[tag] = (http, server.proc.pid, model_id)
        seq = 1  # seq_id 1 is never sent: every request stays queued behind it
        cpu: dict[tuple, list[float]] = {}
        order = [tag for tag, _ in REVISIONS]
        for _ in range(args.rounds + 1):  # the first round warms up and is not kept
            for body, msg in messages.items():
                for tag in order:
                    http, pid, model_id = targets[tag]
                    posts = []
                    for _ in range(args.per_round):
                        seq += 1
                        msg.model_id, msg.seq_id = model_id, seq
                        posts.append((msg.SerializeToString(), "application/x-protobuf"))
                    cpu.setdefault((body, tag), []).append(cpu_ms_per_post(http, pid, "/api/v1/forward_backward", posts))
            order.reverse()
    finally:
        for http, _, _ in targets.values():
            http.close()
        for server in servers:
            server.stop()
    print(f"requests: old = {args.old}, new = this checkout; {args.rounds} rounds of {args.per_round} "
          "forward_backward POSTs per body and server, queued (no pass runs)")
    print(f"  {'body':<16}{'old CPU ms/req':>16}{'new CPU ms/req':>16}{'new/old':>9}")
    for body in messages:
        old, new = cpu[(body, "old")][1:], cpu[(body, "new")][1:]
        ratio = statistics.median(b / a for a, b in zip(old, new))
        print(f"  {f'{body[0]} x {body[1]}':<16}{statistics.median(old):>16.2f}{statistics.median(new):>16.2f}"
              f"{ratio:>9.3f}")


# ---- sampling -------------------------------------------------------------------------------------
SAMPLING_ADAPTERS = 4


def sampling_engines(args) -> dict:
    """Per revision: its engine module and a `SamplingEngine` on its own copy of one model, with
    the same adapters (rank --rank, non-zero B)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from transformers.utils import logging as hf_logging

    from hosted_tinker.models.embedded import SPEC_PRESETS, build_tiny_model

    hf_logging.disable_progress_bar()
    hf_logging.set_verbosity_error()
    cpu = torch.device("cpu")
    engines = {}
    with tempfile.TemporaryDirectory() as tmp:
        src = build_tiny_model(Path(tmp), SPEC_PRESETS[args.preset])
        tokenizer = AutoTokenizer.from_pretrained(src)
        for tag, package in REVISIONS:
            trainer, lora, _ = modules(package)
            engine = importlib.import_module(f"{package}.sampling.engine")
            runtime = trainer.TrainingRuntime(AutoModelForCausalLM.from_pretrained(src, dtype=torch.float32), "bench",
                                              device=cpu)
            for a in range(SAMPLING_ADAPTERS):
                adapter = runtime.create_adapter(f"a{a}", lora.LoRAConfig(rank=args.rank, seed=a))
                with torch.no_grad():  # non-zero B, as after training
                    for w in adapter.weights.values():
                        w.B.copy_(torch.randn(w.B.shape, generator=torch.Generator().manual_seed(a)) * 1e-2)
            engines[tag] = (engine, engine.SamplingEngine(runtime.model, runtime.routing, tokenizer, cpu))
    return engines


def sampling(args) -> None:
    torch.set_num_threads(args.threads)
    engines = sampling_engines(args)
    rng = np.random.default_rng(0)
    prompts = [rng.integers(0, 1000, int(rng.integers(28, 37))).tolist() for _ in range(args.requests)]

    def run(tag: str, max_tokens: int, seed0: int) -> tuple[float, float, float]:
        """(generated tokens per wall second, per CPU second of this thread, wall seconds) of every
        request at once, run to completion."""
        module, engine = engines[tag]
        done: list = []
        engine.submit_all([module.SampleJob(prompt=p, num_samples=1, max_tokens=max_tokens,
                                            adapter_id=f"a{i % SAMPLING_ADAPTERS}", temperature=1.0, seed=seed0 + i,
                                            on_done=done.append, on_error=done.append)
                           for i, p in enumerate(prompts)])
        t, cpu = time.perf_counter(), time.thread_time()
        engine.run(lambda: False, max_seconds=1e9)
        wall, cpu = time.perf_counter() - t, time.thread_time() - cpu
        tokens = sum(len(s.tokens) for r in done for s in r.sequences)
        if tokens != args.requests * max_tokens:
            raise RuntimeError(f"{tag}: {tokens} tokens generated, expected {args.requests * max_tokens}: {done[:1]}")
        return tokens / wall, tokens / cpu, wall

    for tag, _ in REVISIONS:
        run(tag, 4, seed0=10_000)  # warm-up
    runs: dict[str, list[tuple[float, float, float]]] = {tag: [] for tag, _ in REVISIONS}
    first: dict[str, list[float]] = {tag: [] for tag, _ in REVISIONS}  # all requests' first (only) token
    order = [tag for tag, _ in REVISIONS]
    for rnd in range(args.rounds):
        for tag in order:
            runs[tag].append(run(tag, args.new_tokens, seed0=1000 * rnd))
            first[tag].append(run(tag, 1, seed0=1000 * rnd)[2])
        order.reverse()
    report_sampling(args, runs, first)


def report_sampling(args, runs: dict, first: dict) -> None:
    med = statistics.median
    print(f"sampling: old = {args.old}, new = this checkout; model {args.preset}, {args.requests} concurrent x "
          f"{args.new_tokens} tokens, {SAMPLING_ADAPTERS} adapters of rank {args.rank}, temperature 1, torch threads "
          f"{args.threads}, "
          f"{args.rounds} rounds")
    for tag, _ in REVISIONS:
        print(f"  {tag}: {med(r[0] for r in runs[tag]):.0f} generated tokens/s (rounds: "
              + ", ".join(f"{r[0]:.0f}" for r in runs[tag]) + f"), {med(r[1] for r in runs[tag]):.0f} per CPU "
              f"second; {args.requests} requests' first token in {1000 * med(first[tag]):.0f} ms")
    ratio = {k: med(n[k] / o[k] for n, o in zip(runs["new"], runs["old"])) for k in (0, 1)}
    print(f"  new/old, median of per-round ratios: tokens/s {ratio[0]:.2f}x, tokens per CPU second {ratio[1]:.2f}x, "
          f"time to every first token {med(n / o for n, o in zip(first['new'], first['old'])):.2f}x")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("what", choices=("training", "overhead", "images", "requests", "sampling"))
    ap.add_argument("--old", required=True, help="the git revision to compare this checkout with")
    ap.add_argument("--sizes", default="tiny,small,medium",
                    help="training: sizes of multi_tenant.py (benchmarks/bodies.py; moe and tiny-moe too)")
    ap.add_argument("--tenants", default="1,2,4,8,16", help="training: tenant counts (default 1,2,4,8,16)")
    ap.add_argument("--rounds-scale", type=float, default=1.0,
                    help="training: multi_tenant.py's CPU rounds (25/7/5) times this (default 1)")
    ap.add_argument("--threads", type=int, default=1, help="training, sampling: torch intra-op threads (default 1)")
    ap.add_argument("--rounds", type=int, default=None,
                    help="overhead (default 150), requests (default 7), sampling (default 5): rounds")
    ap.add_argument("--hidden", type=int, default=256, help="overhead: the model's hidden size (default 256; "
                    "overhead.py's tiny body: 64)")
    ap.add_argument("--layers", type=int, default=4, help="overhead: the model's layers (default 4; tiny: 1)")
    ap.add_argument("--per-round", type=int, default=20, help="requests: POSTs per body and server a round (default 20)")
    ap.add_argument("--preset", default="small", help="sampling: the model, a preset of embedded_model (default small)")
    ap.add_argument("--requests", type=int, default=64, help="sampling: concurrent requests (default 64)")
    ap.add_argument("--new-tokens", type=int, default=64, help="sampling: tokens per request (default 64)")
    ap.add_argument("--rank", type=int, default=16, help="sampling: the adapters' LoRA rank (default 16)")
    args = ap.parse_args()
    tmp = Path(tempfile.mkdtemp(prefix="ht-compare-"))
    try:
        old_tree = checkout(args.old, tmp)
        if args.what == "training":
            training(args, tmp)
        elif args.what == "overhead":
            args.rounds = args.rounds or 150
            overhead(args, tmp, old_tree)
        elif args.what == "images":
            images(args, tmp, old_tree)
        elif args.what == "requests":
            args.rounds = args.rounds or 7
            requests(args, tmp, old_tree)
        else:
            args.rounds = args.rounds or 5
            sampling(args)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
