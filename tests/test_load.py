"""Load: 32 concurrent SDK clients on loopback against one real server, for a bounded time.

24 training clients (each its own API key and model, distinct data) run K pipelined
forward_backward + optim_step steps while 8 sampling clients (4 on the base model, 4 on a
saved adapter) sample over and over. Checked afterwards:

* every training client got exactly K forward_backward and K optim_step results, with metrics;
* the server's futures table has exactly one row per (model_id, seq_id), all done, with no
  gap: no step lost or applied twice; and a solo replay of some clients gives the same losses;
* the server's resident memory after the load is within a generous bound of its level after a
  warm-up, sampled throughout;

and printed (run with `pytest -s`): p50/p99 of future completion latency per kind (server side,
completed_at - created_at), of forward_backward/optim_step results as the SDK saw them, of the
step time per client, and the mean time per `retrieve_future` call from /metrics.
"""

from __future__ import annotations

import re
import sqlite3
import threading
import time
from collections import Counter, defaultdict

import httpx
import numpy as np
import pytest
from tinker import types

from helpers import BASE_MODEL, database, sft_batch
from hosted_tinker.accounts.auth import anonymous_owner
from server_process import ServerProcess

pytestmark = pytest.mark.e2e

N_TRAIN, N_SAMPLE = 24, 8
STEPS = 8  # K
LOAD_S = 90.0  # the sampling clients stop then at the latest; training must be done well before
TRAIN_DEADLINE_S = 240.0  # a training client still running then has hung
RSS_GROWTH = 1.30  # generous: allocator slack, 24 new adapters and their optimizer state
ADAM = types.AdamParams(learning_rate=1e-2)
PROMPT_VOCAB = 1000


def rss_kib(pid: int) -> int:
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1])
    raise RuntimeError("no VmRSS")


def pct(values, q: float) -> float:
    return float(np.percentile(np.asarray(values, dtype=np.float64), q)) if len(values) else float("nan")


def fmt_ms(values) -> str:
    return f"p50 {pct(values, 50) * 1000:7.1f} ms  p99 {pct(values, 99) * 1000:7.1f} ms  (n={len(values)})"


def train_key(i: int) -> str:
    return f"tml-load-train-{i}"


def batch_for(i: int, step: int) -> list:
    return sft_batch(2 + i % 3, seed=10_000 * (i + 1) + step)


def run_training(srv, key: str, i: int, steps: int, out: dict, start: threading.Barrier | None = None) -> None:
    with srv.client(key) as sc:
        tc = sc.create_lora_training_client(base_model=BASE_MODEL, rank=2 + 2 * (i % 4), seed=i).result()
        out.update(model_id=tc.model_id, losses=[], fb=[], opt=[], step_s=[], fb_s=[], opt_s=[])
        if start is not None:
            start.wait()
        for step in range(steps):
            t0 = time.perf_counter()
            fb = tc.forward_backward(batch_for(i, step), "cross_entropy")
            opt = tc.optim_step(ADAM)
            fb_res = fb.result()
            t_fb = time.perf_counter()
            opt_res = opt.result()
            t_opt = time.perf_counter()
            out["fb"].append(fb_res)
            out["opt"].append(opt_res)
            out["losses"].append(fb_res.metrics["loss:sum"])
            out["step_s"].append(t_opt - t0)
            out["fb_s"].append(t_fb - t0)
            out["opt_s"].append(t_opt - t0)
        out["final_loss"] = tc.forward(batch_for(i, 0), "cross_entropy").result().metrics["loss:sum"]


def make_sampler(srv, key: str, j: int):
    """A sampling client that stays open until the server stops."""
    sc = srv.client(key)
    if j % 2 == 0:
        return sc.create_sampling_client(base_model=BASE_MODEL).result(), None
    tc = sc.create_lora_training_client(base_model=BASE_MODEL, rank=4, seed=100 + j).result()
    tc.forward_backward(sft_batch(3, seed=500 + j), "cross_entropy").result()
    tc.optim_step(types.AdamParams(learning_rate=5e-2)).result()
    path = tc.save_weights_for_sampler(f"load-adapter-{j}").result().path
    return sc.create_sampling_client(model_path=path).result(), path


def run_sampling(client, j: int, stop: threading.Event, out: dict) -> None:
    rng = np.random.default_rng(j)
    out.update(n=0, latency_s=[])
    while not stop.is_set():
        n, max_tokens = int(rng.integers(2, 5)), int(rng.integers(1, 17))
        prompt = types.ModelInput.from_ints(rng.integers(0, PROMPT_VOCAB, int(rng.integers(3, 20))).tolist())
        t0 = time.perf_counter()
        res = client.sample(prompt, num_samples=n, sampling_params=types.SamplingParams(
            max_tokens=max_tokens, temperature=1.0, seed=int(rng.integers(0, 2**31)))).result()
        out["latency_s"].append(time.perf_counter() - t0)
        assert len(res.sequences) == n
        assert all(1 <= len(s.tokens) <= max_tokens for s in res.sequences)
        out["n"] += 1


def metrics_text(base_url: str) -> str:
    return httpx.get(f"{base_url}/metrics", timeout=30).text


def route_stats(text: str, route: str) -> tuple[int, float]:
    """(requests, seconds spent) on one route, all statuses, from /metrics."""
    n = sum(float(m.group(1)) for m in re.finditer(
        rf'^hosted_tinker_http_requests_total{{route="{re.escape(route)}",status="\d+"}} (\S+)$', text, re.M))
    m = re.search(rf'^hosted_tinker_http_request_seconds_total{{route="{re.escape(route)}"}} (\S+)$', text, re.M)
    return int(n), float(m.group(1)) if m else 0.0


def metric(text: str, name: str) -> float:
    """Summed over its label sets (a served model's series carry its base_model)."""
    return sum(float(v) for v in re.findall(rf"^{name}(?:\{{[^}}]*\}})? (\S+)$", text, re.M))


@pytest.fixture(scope="module")
def srv(tmp_path_factory):
    proc = ServerProcess(tmp_path_factory.mktemp("load")).start()
    yield proc
    proc.stop()


def test_32_concurrent_clients(srv):
    base = srv.base_url
    pid = srv.proc.pid

    # -- warm-up: samplers set up (adapters saved), a few throwaway training runs ------------------
    samplers: list = [None] * N_SAMPLE
    errors: list = []

    def setup_sampler(j):
        try:
            samplers[j] = make_sampler(srv, f"tml-load-sample-{j}", j)
        except BaseException as e:
            errors.append(e)

    warm_outs = [{} for _ in range(4)]
    threads = [threading.Thread(target=setup_sampler, args=(j,)) for j in range(N_SAMPLE)]
    threads += [threading.Thread(target=run_training, args=(srv, f"tml-load-warm-{i}", i, 3, warm_outs[i]))
                for i in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(180)
    assert not errors, errors
    for client, _ in samplers:
        client.sample(types.ModelInput.from_ints([1, 2, 3]), num_samples=2,
                      sampling_params=types.SamplingParams(max_tokens=4)).result()
    rss_warm = rss_kib(pid)

    # -- the load ------------------------------------------------------------------------------------
    rss_samples: list[tuple[float, int]] = []
    stop_sampling, stop_rss = threading.Event(), threading.Event()
    train_outs = [{} for _ in range(N_TRAIN)]
    sample_outs = [{} for _ in range(N_SAMPLE)]
    start = threading.Barrier(N_TRAIN)

    def trainer(i):
        try:
            run_training(srv, train_key(i), i, STEPS, train_outs[i], start)
        except BaseException as e:
            errors.append(("train", i, e))
            start.abort()

    def sampler(j):
        try:
            run_sampling(samplers[j][0], j, stop_sampling, sample_outs[j])
        except BaseException as e:
            errors.append(("sample", j, e))

    def watch_rss(t0):
        while not stop_rss.wait(2.0):
            rss_samples.append((time.monotonic() - t0, rss_kib(pid)))

    before = metrics_text(base)
    t0 = time.monotonic()
    watcher = threading.Thread(target=watch_rss, args=(t0,), daemon=True)
    watcher.start()
    trainers = [threading.Thread(target=trainer, args=(i,), name=f"train-{i}") for i in range(N_TRAIN)]
    sampling = [threading.Thread(target=sampler, args=(j,), name=f"sample-{j}") for j in range(N_SAMPLE)]
    for t in trainers + sampling:
        t.start()
    for t in trainers:
        t.join(max(1.0, TRAIN_DEADLINE_S - (time.monotonic() - t0)))
    train_s = time.monotonic() - t0
    hung = [t.name for t in trainers if t.is_alive()]
    # The sampling clients go on until the load window closes, then stop.
    stop_sampling.wait(max(0.0, min(LOAD_S, train_s + 5.0) - (time.monotonic() - t0)))
    stop_sampling.set()
    for t in sampling:
        t.join(60)
    load_s = time.monotonic() - t0
    stop_rss.set()
    watcher.join(10)
    rss_after = rss_kib(pid)
    after = metrics_text(base)

    assert not hung, f"training clients still running after {TRAIN_DEADLINE_S}s: {hung}"
    assert not [t.name for t in sampling if t.is_alive()], "a sampling client hung"
    assert not errors, errors[:5]
    assert srv.proc.poll() is None, srv.log()

    # -- every step answered once ----------------------------------------------------------------------
    for i, out in enumerate(train_outs):
        assert len(out["fb"]) == STEPS and len(out["opt"]) == STEPS, i
        assert all(r.metrics and "loss:sum" in r.metrics for r in out["fb"]), i
        assert all(r.metrics is not None for r in out["opt"]), i
        assert all(np.isfinite(out["losses"])), i
    model_ids = [out["model_id"] for out in train_outs]
    assert len(set(model_ids)) == N_TRAIN

    db = sqlite3.connect(f"file:{database(srv.data_dir)}?mode=ro", uri=True, timeout=30)
    rows = db.execute(
        f"SELECT model_id, seq_id, kind, status, created_at, completed_at, owner FROM futures "
        f"WHERE model_id IN ({','.join('?' * N_TRAIN)})", model_ids).fetchall()
    dup = db.execute(
        f"SELECT model_id, seq_id, COUNT(*) FROM futures WHERE model_id IN ({','.join('?' * N_TRAIN)}) "
        "AND seq_id IS NOT NULL GROUP BY model_id, seq_id HAVING COUNT(*) > 1", model_ids).fetchall()
    assert not dup, dup
    by_model = defaultdict(list)
    for mid, seq, kind, status, *_ in rows:
        by_model[mid].append((seq, kind, status))
    for i, mid in enumerate(model_ids):
        seqs = sorted(r for r in by_model[mid] if r[0] is not None)
        assert [s for s, _, _ in seqs] == list(range(len(seqs))), (i, seqs)  # no gap, no repeat
        kinds = Counter(k for _, k, _ in seqs)
        assert kinds["forward_backward"] == STEPS and kinds["optim_step"] == STEPS, (i, kinds)
        assert all(status == "done" for _, _, status in seqs), (i, seqs)
        # pipelined order: create, then (fb, optim) x K, then the final forward
        assert [k for _, k, _ in seqs[1:2 * STEPS + 1]] == ["forward_backward", "optim_step"] * STEPS, i

    # -- latencies --------------------------------------------------------------------------------------
    owners = {anonymous_owner(train_key(i)) for i in range(N_TRAIN)}
    owners |= {anonymous_owner(f"tml-load-sample-{j}") for j in range(N_SAMPLE)}
    lat = defaultdict(list)
    for kind, created, completed in db.execute(
            "SELECT kind, created_at, completed_at FROM futures WHERE created_at >= ? AND completed_at IS NOT NULL "
            "AND owner IN (%s)" % ",".join("?" * len(owners)), (time.time() - load_s - 1, *owners)):
        lat[kind].append(completed - created)
    db.close()
    samples = sum(o["n"] for o in sample_outs)
    print(f"\n[load] {N_TRAIN} training clients x {STEPS} steps + {N_SAMPLE} sampling clients ({samples} sample "
          f"calls): training took {train_s:.1f}s, load window {load_s:.1f}s")
    print("[load] future completion latency, server side (completed_at - created_at):")
    for kind in sorted(lat):
        print(f"[load]   {kind:18s} {fmt_ms(lat[kind])}")
    all_fb = [x for o in train_outs for x in o["fb_s"]]
    all_opt = [x for o in train_outs for x in o["opt_s"]]
    all_step = [x for o in train_outs for x in o["step_s"]]
    all_sample = [x for o in sample_outs for x in o["latency_s"]]
    print("[load] as the SDK saw them (submit -> .result(), through retrieve_future):")
    print(f"[load]   forward_backward   {fmt_ms(all_fb)}")
    print(f"[load]   optim_step         {fmt_ms(all_opt)}")
    print(f"[load]   sample             {fmt_ms(all_sample)}")
    print(f"[load]   step (fb + optim)  {fmt_ms(all_step)}")
    print("[load] step time per training client:")
    for i, out in enumerate(train_outs):
        print(f"[load]   client {i:2d}: {fmt_ms(out['step_s'])}")
    for route in ("/api/v1/retrieve_future", "/api/v1/forward_backward", "/api/v1/optim_step", "/api/v1/asample"):
        n0, s0 = route_stats(before, route)
        n1, s1 = route_stats(after, route)
        if n1 > n0:
            print(f"[load] /metrics {route}: {n1 - n0} calls, mean {(s1 - s0) / (n1 - n0) * 1000:.1f} ms")
    cycles = metric(after, "hosted_tinker_cycles_total") - metric(before, "hosted_tinker_cycles_total")
    cycle_s = metric(after, "hosted_tinker_cycle_seconds_total") - metric(before, "hosted_tinker_cycle_seconds_total")
    print(f"[load] {cycles:.0f} clock cycles, mean {cycle_s / max(cycles, 1) * 1000:.0f} ms, "
          f"{metric(after, 'hosted_tinker_fused_passes_total') - metric(before, 'hosted_tinker_fused_passes_total'):.0f}"
          " fused multi-model passes")
    peak = max([r for _, r in rss_samples] + [rss_after])
    print(f"[load] server RSS: after warm-up {rss_warm / 1024:.0f} MiB, peak {peak / 1024:.0f} MiB, "
          f"after load {rss_after / 1024:.0f} MiB; samples (s, MiB): "
          + ", ".join(f"({t:.0f}, {r / 1024:.0f})" for t, r in rss_samples[::max(1, len(rss_samples) // 8)]))
    assert rss_after <= rss_warm * RSS_GROWTH, (rss_warm, rss_after)
    assert peak <= rss_warm * RSS_GROWTH * 1.2, (rss_warm, peak)

    # -- a solo replay of a few clients gives exactly the same losses -------------------------------
    for i in (0, 7, 13):
        solo: dict = {}
        run_training(srv, f"tml-load-solo-{i}", i, STEPS, solo)
        assert solo["losses"] == train_outs[i]["losses"], i
        assert solo["final_loss"] == train_outs[i]["final_loss"], i
    assert srv.proc.poll() is None
