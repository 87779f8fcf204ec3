"""Multi-tenant clock cycles through the real SDK (issue 3: tests 1, 3, 4).

Several SDK clients train their own models on one server at once; their requests are fused
into shared cycles, and each model's results must be exactly those of a solo run.
"""

from __future__ import annotations

import threading

import httpx
import pytest
from safetensors.torch import load_file
from tinker import types

from helpers import BASE_MODEL, checkpoint_dir, metric, queued, sft_batch
from server_process import ServerProcess

pytestmark = pytest.mark.e2e
ADAM = types.AdamParams(learning_rate=1e-2, weight_decay=0.01)
WARM_UP_STEPS = 20  # bound on the steps the server may need to learn that a client pipelines (1 or 2)


def train(server, key: str, rank: int, seed: int, steps: int, barrier: threading.Barrier | None = None,
          data_seed: int = 0) -> tuple[list[float], dict]:
    """One client's loop (pipelined fb + optim); returns its losses and saved training state."""
    with server.client(key) as sc:
        tc = sc.create_lora_training_client(base_model=BASE_MODEL, rank=rank, seed=seed).result()
        losses = []
        for step in range(steps):
            if barrier is not None:
                barrier.wait()
            fb = tc.forward_backward(sft_batch(2 + seed % 3, seed=data_seed * 1000 + step), "cross_entropy")
            opt = tc.optim_step(ADAM)
            losses.append(fb.result().metrics["loss:sum"])
            opt.result()
        path = tc.save_state("final").result().path
    d = checkpoint_dir(server, path)
    state = {**load_file(str(d / "adapter_model.safetensors")), **load_file(str(d / "optimizer.safetensors"))}
    return losses, state, tc.model_id


def run_concurrently(server, configs: list[tuple[int, int]], steps: int, gate=None) -> list:
    """Each config's client trains at once, a barrier before each step. With `gate` (the server's
    `device_loop.before_plan`), their first steps' forward_backwards are queued while the device
    loop is parked before planning, so that one cycle plans them together: a shared pass by
    construction, not by the luck of arriving together."""
    first_step = threading.Event()

    def park_the_loop() -> None:  # the barrier's action: run once all clients wait, before any posts
        if gate is None or first_step.is_set():
            return
        first_step.set()
        depth = metric(server, "hosted_tinker_queue_depth")
        gate.close()
        threading.Thread(target=lambda: (queued(server, depth + len(configs)), gate.open()), daemon=True).start()

    barrier = threading.Barrier(len(configs), action=park_the_loop)
    results: list = [None] * len(configs)
    errors: list = []

    def worker(i, rank, seed):
        try:
            results[i] = train(server, f"tml-tenant-{i}", rank, seed, steps, barrier, data_seed=i)
        except BaseException as e:  # surfaced below
            errors.append(e)
            barrier.abort()

    threads = [threading.Thread(target=worker, args=(i, r, s)) for i, (r, s) in enumerate(configs)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(300)
    if gate is not None:
        gate.open()
    assert not errors, errors
    return results


def assert_same_state(a: dict, b: dict) -> None:
    assert a.keys() == b.keys()
    for k in a:
        assert a[k].equal(b[k]), k


def test_isolation_bit_identical_with_or_without_a_neighbour(server, server_gate):
    solo_losses, solo_state, _ = train(server, "tml-iso-a", rank=8, seed=1, steps=5, data_seed=0)
    fused_before = metric(server, "hosted_tinker_fused_passes_total")
    (a_losses, a_state, _), (_, _, b_model) = run_concurrently(server, [(8, 1), (4, 2)], steps=5, gate=server_gate)
    assert metric(server, "hosted_tinker_fused_passes_total") > fused_before  # they did share passes
    assert a_losses == solo_losses
    assert_same_state(a_state, solo_state)  # adapter and AdamW moments, bit for bit

    # unloading B leaves A's served model intact
    r = httpx.post(f"{server.base_url}/api/v1/unload_model", json={"model_id": b_model},
                   headers={"X-API-Key": "tml-tenant-1"}, timeout=30)
    assert r.status_code == 200
    r = httpx.post(f"{server.base_url}/api/v1/retrieve_future", json={"request_id": r.json()["request_id"]},
                   headers={"X-API-Key": "tml-tenant-1"}, timeout=60)
    assert r.json()["model_id"] == b_model
    again_losses, again_state, _ = train(server, "tml-iso-a", rank=8, seed=1, steps=5, data_seed=0)
    assert again_losses == solo_losses
    assert_same_state(again_state, solo_state)


def test_eight_concurrent_clients_match_their_solo_runs(server, server_gate):
    configs = [(4, 0), (8, 1), (16, 2), (2, 3), (8, 4), (32, 5), (4, 6), (1, 7)]
    steps = 20
    fused_before = metric(server, "hosted_tinker_fused_passes_total")
    concurrent = run_concurrently(server, configs, steps, gate=server_gate)
    assert metric(server, "hosted_tinker_fused_passes_total") > fused_before
    for i, (rank, seed) in enumerate(configs):
        solo_losses, solo_state, _ = train(server, f"tml-solo-{i}", rank, seed, steps, data_seed=i)
        losses, state, _ = concurrent[i]
        assert len(losses) == steps
        assert losses == solo_losses, i  # every step applied once, in order
        assert_same_state(state, solo_state)


def test_pipelined_client_uses_one_cycle_per_step(tmp_path):
    """A client that posts optim_step right after forward_backward costs one cycle per step; one
    that waits for each result, two. Nothing here depends on timing: with an hour-long gather
    window, once the server has learned that a client pipelines (on /metrics; the warm-up goes
    on until then) each of its fbs is held until its optim_step arrives; a client that waits for
    its results is never taken for a pipelining one; and a cycle counts before it answers, so a
    count read after the last result includes that result's cycle."""
    srv = ServerProcess(tmp_path / "srv", args=("--gather-window-s", "3600")).start()
    try:
        sc = srv.client("tml-cycles")
        tc = sc.create_lora_training_client(base_model=BASE_MODEL, rank=4).result()

        def pipelined_step(batch) -> None:
            fb, opt = tc.forward_backward(batch, "cross_entropy"), tc.optim_step(ADAM)
            fb.result(), opt.result()

        # The server learns that a client pipelines from an optim_step that arrives while its fb
        # runs: a long pass (~7k tokens) makes that the rule; a warm-up step that missed is retried.
        long_pass = sft_batch(64, seed=1, min_len=100, max_len=128)
        for _ in range(WARM_UP_STEPS):
            pipelined_step(long_pass)
            if metric(srv, "hosted_tinker_pipelining_training_runs") == 1:
                break
        else:
            pytest.fail(f"the server did not learn in {WARM_UP_STEPS} steps that the client pipelines")
        batch = sft_batch(4)
        steps = 8
        before = metric(srv, "hosted_tinker_cycles_total")
        for _ in range(steps):
            pipelined_step(batch)
        pipelined = metric(srv, "hosted_tinker_cycles_total") - before

        naive_tc = sc.create_lora_training_client(base_model=BASE_MODEL, rank=4).result()
        before = metric(srv, "hosted_tinker_cycles_total")
        for _ in range(steps):
            naive_tc.forward_backward(batch, "cross_entropy").result()
            naive_tc.optim_step(ADAM).result()
        naive = metric(srv, "hosted_tinker_cycles_total") - before
    finally:
        srv.stop()
    assert pipelined == steps
    assert naive == 2 * steps
