"""The worker pool (issue 16): real `serve --workers 2` servers (rank 0 + one torchrun rank, gloo
on CPU), driven through the real SDK.

- A mixed multi-tenant workload (four tenants; LoRA ranks 4 and 8; cross_entropy with (N,) and
  with (N, K) targets, importance_sampling, ppo; 5-, 4-, 3- and 1-datum requests; a forward-only
  request; sampling) gives on 2 ranks the losses, logprobs and adapter weights it gives on 1 rank
  (fp32, <= 1e-5).
- The same with the base model sharded over the 2 ranks by FSDP2 (--shard-base).
- A rank killed (SIGKILL, by a fault point, mid-pass: its gradients already summed into rank
  0's, its outputs not yet sent) fails that request with category `server`; the pool is
  relaunched; a rank killed while the pool is idle fails nothing; the retried step, the rest of
  training, and a run resumed from the last checkpoint all give what an uninterrupted run gives.
- Forming the pool never takes the server longer than --pool-timeout-s.
"""

from __future__ import annotations

import os
import socket
import subprocess
import sys

import numpy as np
import pytest
import tinker
import torch
from tinker import types
from tinker.types.request_error_category import RequestErrorCategory

from helpers import BASE_MODEL, assert_one_line_error, logprobs_of, read_adapter, rl_datum, serve, sft_batch
from pool_ranks import GONE, kill_rank_before_sending, torchrun_of
from server_process import ServerProcess, free_port

pytestmark = pytest.mark.e2e
WAIT = 300  # bound on any one result: a hung future fails the test here
START = 300  # two Python processes importing torch on a busy 2-core machine
ADAM = types.AdamParams(learning_rate=1e-2, weight_decay=0.01)
TOL = dict(rtol=1e-5, atol=1e-5)
# (LoRA settings, loss, datums per request): requests of 5, 4, 3 and 1 datums split unevenly over
# 2 ranks; "top_k" is cross_entropy with (N, 3) targets and weights (LOSS_FN).
TENANTS = [
    (dict(rank=4, seed=1), "cross_entropy", 5),
    (dict(rank=8, seed=2, train_attn=False), "importance_sampling", 3),
    (dict(rank=4, seed=3, train_mlp=False), "ppo", 1),
    (dict(rank=8, seed=4), "top_k", 4),
]
LOSS_FN = {"top_k": "cross_entropy"}
PROMPT = [5, 17, 3, 99, 42, 7]


def batch(loss: str, n: int, step: int) -> list:
    if loss == "cross_entropy":
        return sft_batch(n, seed=100 * step + n)
    rng = np.random.default_rng(100 * step + n)
    if loss == "top_k":
        return [types.Datum(model_input=types.ModelInput.from_ints(rng.integers(0, 1000, length).tolist()),
                            loss_fn_inputs={"target_tokens": torch.as_tensor(rng.integers(0, 1000, (length, 3))),
                                            "weights": torch.as_tensor(rng.random((length, 3)), dtype=torch.float32)})
                for length in rng.integers(6, 30, n)]
    out = []
    for _ in range(n):
        tokens = rng.integers(0, 1000, int(rng.integers(6, 30))).tolist()
        out.append(rl_datum(tokens, (-rng.random(len(tokens) - 1) * 5).tolist(),
                            rng.normal(size=len(tokens) - 1).tolist()))
    return out


def run_workload(server: ServerProcess) -> dict:
    """Two steps of every tenant, their requests posted together (they share cycles), then a
    forward-only request, each adapter's weights, and sampler prompt logprobs."""
    got: dict = {"loss": [], "logprobs": []}
    with tinker.ServiceClient(base_url=server.base_url, api_key="tml-pool") as sc:
        clients = [sc.create_lora_training_client(base_model=BASE_MODEL, **lora).result(timeout=WAIT)
                   for lora, _, _ in TENANTS]
        for step in range(2):
            fbs = [tc.forward_backward(batch(loss, n, step), LOSS_FN.get(loss, loss))
                   for tc, (_, loss, n) in zip(clients, TENANTS)]
            for fb in fbs:
                out = fb.result(timeout=WAIT)
                got["loss"].append(out.metrics["loss:sum"])
                got["logprobs"] += logprobs_of(out)
            for opt in [tc.optim_step(ADAM) for tc in clients]:
                opt.result(timeout=WAIT)
        got["forward"] = logprobs_of(clients[0].forward(sft_batch(3, seed=7), "cross_entropy").result(timeout=WAIT))
        # The first tenant again, alone: the exactness rule (its bits alone = its bits co-batched).
        lora, loss, n = TENANTS[0]
        solo = sc.create_lora_training_client(base_model=BASE_MODEL, **lora).result(timeout=WAIT)
        for step in range(2):
            solo.forward_backward(batch(loss, n, step), loss).result(timeout=WAIT)
            solo.optim_step(ADAM).result(timeout=WAIT)
        got["weights"] = [read_adapter(server, tc.save_weights_for_sampler("w").result(timeout=WAIT).path)
                          for tc in [*clients, solo]]
        sampler = clients[1].save_weights_and_get_sampling_client().result(timeout=WAIT)
        sample = sampler.sample(types.ModelInput.from_ints(PROMPT), 2, types.SamplingParams(max_tokens=6, seed=3),
                                include_prompt_logprobs=True).result(timeout=WAIT)
        got["prompt_logprobs"] = np.array(sample.prompt_logprobs[1:], dtype=np.float32)
        got["sampled"] = [len(s.tokens) for s in sample.sequences]
    return got


def assert_same(got: dict, want: dict) -> None:
    co_batched, alone = got["weights"][0], got["weights"][-1]
    assert all(torch.equal(co_batched[k], alone[k]) for k in alone), "a tenant's bits changed with its co-tenants"
    np.testing.assert_allclose(got["loss"], want["loss"], **TOL)
    for a, b in zip(got["logprobs"] + got["forward"], want["logprobs"] + want["forward"], strict=True):
        np.testing.assert_allclose(a, b, **TOL)
    for mine, theirs in zip(got["weights"], want["weights"], strict=True):
        assert mine.keys() == theirs.keys()
        for key in mine:
            np.testing.assert_allclose(mine[key].numpy(), theirs[key].numpy(), **TOL, err_msg=key)
    np.testing.assert_allclose(got["prompt_logprobs"], want["prompt_logprobs"], **TOL)
    assert got["sampled"] == want["sampled"] == [6, 6]


def served(path, *args: str, env: dict | None = None) -> ServerProcess:
    return ServerProcess(path, args=args, env=env).start(timeout=START)


@pytest.fixture(scope="module")
def one_rank(tmp_path_factory) -> dict:
    srv = served(tmp_path_factory.mktemp("one_rank"))
    try:
        return run_workload(srv)
    finally:
        srv.stop()


@pytest.mark.parametrize("sharded, recompute", [(False, False), (True, False), (True, True)],
                         ids=["replicated", "fsdp2_sharded", "fsdp2_sharded_recomputed"])
def test_two_ranks_give_what_one_rank_gives(tmp_path, one_rank, sharded, recompute):
    srv = served(tmp_path / "pool", "--workers", "2", *(["--shard-base"] if sharded else []),
                 *(["--activation-checkpointing", "on"] if recompute else []))
    try:
        got = run_workload(srv)
    finally:
        srv.stop()
    assert_same(got, one_rank)
    log = srv.log_path.read_text()
    assert "worker pool epoch 1: 2 rank(s) on 1 machine(s) joined (gloo)" in log
    assert f"base {'sharded (FSDP2)' if sharded else 'replicated'}" in log
    assert ("rank 1 of 2 ready (epoch 1, cpu, activation checkpointing on)" in log) == recompute
    assert "rank 1 stopped" in log  # told to stop at shutdown, not killed


def train_steps(tc, steps) -> None:
    """Step by step, waiting for each forward_backward before its optim_step: an optim_step after
    a failed forward_backward would step on nothing and shift AdamW's bias correction."""
    for step in steps:
        tc.forward_backward(sft_batch(4, seed=step), "cross_entropy").result(timeout=WAIT)
        tc.optim_step(ADAM).result(timeout=WAIT)


def interrupted_training(srv: ServerProcess, ranks_host: int) -> None:
    """Two steps, a checkpoint, then a step whose pass loses a rank (the server was started with
    `pool.rank_mid_pass@3` armed: rank 1 is killed in its third pass, after its gradients were
    summed into rank 0's and before its outputs were sent). That request fails with category
    `server`; retried, it counts once. Then rank 1 is killed while the pool is idle (`ranks_host`:
    the process whose torchrun runs it), and the next step fails nothing. An uninterrupted run and
    a run resumed from the checkpoint end with the same weights."""
    with tinker.ServiceClient(base_url=srv.base_url, api_key="tml-pool") as sc:
        tc = sc.create_lora_training_client(base_model=BASE_MODEL, rank=4, seed=5).result(timeout=WAIT)
        train_steps(tc, [0, 1])
        checkpoint = tc.save_state("after-two").result(timeout=WAIT).path
        with pytest.raises(tinker.RequestFailedError) as failed:
            tc.forward_backward(sft_batch(4, seed=2), "cross_entropy").result(timeout=WAIT)
        assert failed.value.category is RequestErrorCategory.Server
        assert "worker pool" in failed.value.message
        train_steps(tc, [2])  # the pool is relaunched before this pass
        fb = kill_rank_before_sending(torchrun_of(ranks_host), lambda: tc.forward_backward(sft_batch(4, seed=3),
                                                                                          "cross_entropy"),
                                      lambda: srv.log(tail=None))
        fb.result(timeout=WAIT)  # rank 0 found the rank gone as the pass went out, and relaunched first
        tc.optim_step(ADAM).result(timeout=WAIT)
        interrupted = read_adapter(srv, tc.save_weights_for_sampler("end").result(timeout=WAIT).path)

        reference = sc.create_lora_training_client(base_model=BASE_MODEL, rank=4, seed=5).result(timeout=WAIT)
        train_steps(reference, [0, 1, 2, 3])
        uninterrupted = read_adapter(srv, reference.save_weights_for_sampler("end").result(timeout=WAIT).path)

        resumed = sc.create_training_client_from_state_with_optimizer(checkpoint).result(timeout=WAIT)
        train_steps(resumed, [2, 3])
        from_checkpoint = read_adapter(srv, resumed.save_weights_for_sampler("end").result(timeout=WAIT).path)
    for key, want in uninterrupted.items():
        np.testing.assert_allclose(interrupted[key].numpy(), want.numpy(), **TOL, err_msg=key)
        np.testing.assert_allclose(from_checkpoint[key].numpy(), want.numpy(), **TOL, err_msg=key)


@pytest.mark.parametrize("sharded", [False, True], ids=["replicated", "fsdp2_sharded"])
def test_a_rank_killed_mid_pass_fails_the_pass_and_training_goes_on(tmp_path, sharded):
    # With a sharded base rank 0's shards belong to the dead group: the relaunch re-shards them.
    srv = served(tmp_path / "pool", "--workers", "2", *(["--shard-base"] if sharded else []),
                 env={"HOSTED_TINKER_FAULTS": "pool.rank_mid_pass@3"})
    try:
        interrupted_training(srv, srv.proc.pid)
    finally:
        srv.stop()
    log = srv.log_path.read_text()
    assert "worker pool: back (epoch 2, relaunch 1)" in log and "worker pool: back (epoch 3, relaunch 2)" in log
    assert "rank 1 of 2 ready (epoch 3" in log and GONE in log


def test_two_machines_launched_as_documented(tmp_path):
    """docs/scale.md's two-machine launch, both "machines" here: the server (machine 0, rank 0)
    and `hosted-tinker pool-node` (machine 1: torchrun, rank 1, with its own data directory). When
    rank 1 is killed, its torchrun starts it again, it asks rank 0 for a new epoch, and training
    goes on as on one machine."""
    srv = ServerProcess(tmp_path / "machine0")  # its HTTP port is chosen here; the store's must differ
    port = next(p for p in iter(free_port, None) if p != srv.port)
    srv.args = ("--workers", "1", "--nnodes", "2", "--master-addr", "127.0.0.1", "--master-port", str(port))
    node_log = open(tmp_path / "node.log", "wb")
    node = subprocess.Popen(
        [sys.executable, "-m", "hosted_tinker", "pool-node", "--nnodes", "2", "--node-rank", "1",
         "--master-addr", "127.0.0.1", "--master-port", str(port), "--workers", "1",
         "--data-dir", str(tmp_path / "machine1")],
        stdout=node_log, stderr=subprocess.STDOUT, env={**os.environ, "HOSTED_TINKER_FAULTS": "pool.rank_mid_pass@3"})
    try:
        srv.start(timeout=START)
        try:
            interrupted_training(srv, node.pid)
        finally:
            srv.stop()
        assert node.wait(WAIT) == 0  # told to stop: machine 1's torchrun ends with the pool
    finally:
        if node.poll() is None:
            node.terminate()
            node.wait(WAIT)
        node_log.close()
    assert "worker pool: back (epoch 3, relaunch 2)" in srv.log_path.read_text()
    machine1 = (tmp_path / "node.log").read_text()
    assert all(f"rank 1 of 2 ready (epoch {epoch}" in machine1 for epoch in (1, 2, 3))


@pytest.mark.parametrize("args, pattern", [
    (("--shard-base",), r"--shard-base shards the base model across the pool's ranks: give it more than one "
                        r"\(--workers N and/or --nnodes M\)"),
    (("--workers", "2", "--nnodes", "2"), r"--nnodes 2: the other machines need a fixed --master-port \(and a "
                                          r"--master-addr they can reach\) to join the pool"),
    (("--workers", "2", "--pool-interface", "nosuch0"),
     r"--pool-interface nosuch0: this machine has no network interface nosuch0 \(it has .*lo.*\)"),
    (("--workers", "2", "--port", "8123", "--master-port", "8123"),
     r"--master-port 8123: the HTTP server listens on that port; give the pool's rendezvous store another one"),
    (("--workers", "2", "--base-model", BASE_MODEL, "--base-model", "/elsewhere/model"),
     r"--workers / --nnodes: a worker pool serves one base model \(torch.distributed has one process group per "
     r"process\) and 2 were given; run a server per model"),
])
def test_a_pool_that_cannot_work_is_one_line_before_anything_starts(tmp_path, args, pattern):
    out = serve(tmp_path, *args)
    assert_one_line_error(out, pattern)


def test_a_rendezvous_port_in_use_is_one_line(tmp_path):
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        out = serve(tmp_path, "--workers", "2", "--master-port", str(port))
    assert_one_line_error(out, rf"--master-port {port}: cannot listen on 127\.0\.0\.1:{port} \(.*\); choose another "
                               r"port, or a --master-addr of this machine")


def test_forming_the_pool_never_takes_the_server_longer_than_its_timeout(tmp_path):
    """Rank 1 says it is ready and then never joins the group (held at a fault point): the server
    gives up at --pool-timeout-s from the start of forming the pool, in one line (which names the
    ranks that never came, where rank 1 loads slower than that)."""
    gates = tmp_path / "gates"
    gates.mkdir()
    os.mkfifo(gates / "pool.rank_before_join")  # never opened by the test: rank 1 waits there
    out = serve(tmp_path, "--workers", "2", "--pool-timeout-s", "20",
                env={"HOSTED_TINKER_FAULTS": "pool.rank_before_join", "HOSTED_TINKER_GATES": str(gates)})
    assert out.returncode == 2, out.stderr
    errors = [line for line in out.stderr.splitlines() if "error:" in line]
    assert len(errors) == 1 and errors[0].startswith(
        "hosted-tinker serve: error: the worker pool did not form within 20s (--pool-timeout-s): "), out.stderr
    assert "PoolUnavailable" not in out.stderr  # no traceback of the server's (torchrun prints one when stopped)
