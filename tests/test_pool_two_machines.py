"""A worker pool over two machines (issue 41), the machines being two Linux network namespaces
joined by a veth pair (tests/two_machines.py): each with its own address, hostname and
/etc/hosts. Machine A runs the server (rank 0); machine B runs `hosted-tinker pool-node` (rank 1)
with its own data directory (it builds the model itself). Gloo on CPU, one rank per machine.

Machine A's /etc/hosts maps its hostname to 127.0.1.1, as Debian's does, and machine B's hostname
does not resolve at all: the server names the veth as the pool's interface (--pool-interface),
and machine B's ranks take it from the server.

One pool serves the training run's checks (module-scoped): rank 1 is killed in flight once (a
fault point: its share done, its outputs not yet sent) and twice while the pool is idle -- once
with machine B's torchrun held (SIGSTOP) so that rank 0 can learn of it only from the closed
socket as the next pass goes out, and once after its successor has asked rank 0 for a new epoch
(gone, not yet back). Only the in-flight pass fails (category `server`); the run, that request
retried, ends with what one process gives. Where namespaces cannot be made (not root) the module
is skipped with the reason; CI runs as root.
"""

from __future__ import annotations

import os
import subprocess
import sys
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import pytest
import tinker
from tinker import types
from tinker.types.request_error_category import RequestErrorCategory

from helpers import BASE_MODEL, logprobs_of, read_adapter, sft_batch, wait_until
from server_process import REPO_ROOT, ServerProcess
from pool_ranks import GONE, kill_rank_before_sending, rank_of, torchrun_of
from two_machines import INTERFACE, PortForward, TwoMachines

pytestmark = pytest.mark.e2e
WAIT = 300  # bound on any one result: a hung future fails the test here
START = 300
MASTER_PORT = 29500  # inside machine A's own network namespace: nothing else listens there
ADAM = types.AdamParams(learning_rate=1e-2, weight_decay=0.01)
TOL = dict(rtol=1e-5, atol=1e-5)
DEBIAN_HOSTS = "127.0.0.1 localhost\n127.0.1.1 {name}\n"
ASKED = "asked rank 0 for a new epoch"  # machine B's restarted rank


@pytest.fixture(scope="module")
def machines():
    why = TwoMachines.unavailable()
    if why:
        pytest.skip(why)
    pair = TwoMachines()
    try:
        pair.create()
    except RuntimeError as e:
        pytest.skip(f"network namespaces cannot be made here: {e}")
    try:
        pair.a.write_hosts(DEBIAN_HOSTS.format(name=pair.a.hostname))
        pair.b.write_hosts("127.0.0.1 localhost\n")  # node-b resolves to nothing
        yield pair
    finally:
        pair.remove()


def pool_node(machine, data_dir: Path, log: Path, *extra: str, port: int = MASTER_PORT,
              env: dict | None = None) -> subprocess.Popen:
    """`hosted-tinker pool-node`, as a second machine runs it, for rank 1 on `machine`."""
    cmd = [sys.executable, "-m", "hosted_tinker", "pool-node", "--nnodes", "2", "--node-rank", "1",
           "--master-addr", "10.213.0.1", "--master-port", str(port), "--workers", "1", "--data-dir", str(data_dir),
           *extra]
    with open(log, "ab") as out:
        return subprocess.Popen(machine.command(cmd), stdout=out, stderr=subprocess.STDOUT, cwd=REPO_ROOT,
                                env={**os.environ, **(env or {})})


def server_on(machine, data_dir: Path, *args: str, port: int = MASTER_PORT) -> tuple[ServerProcess, PortForward]:
    """The server (rank 0) on `machine`, and the test's way to its HTTP port."""
    srv = ServerProcess(data_dir, wrap=machine.command,
                        args=("--workers", "1", "--nnodes", "2", "--master-addr", machine.address, "--master-port",
                              str(port), "--pool-interface", INTERFACE, *args))
    return srv, PortForward(machine.netns, srv.port)


def end(proc: subprocess.Popen) -> None:
    if proc.poll() is None:
        proc.terminate()
        try:
            proc.wait(WAIT)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(30)


def test_a_server_that_would_advertise_loopback_to_other_machines_is_one_line(machines, tmp_path):
    """Machine A's hostname maps to 127.0.1.1 (Debian's /etc/hosts): without --pool-interface gloo
    would advertise it, and machine B could never connect."""
    cmd = [sys.executable, "-m", "hosted_tinker", "serve", "--data-dir", str(tmp_path / "data"), "--workers", "1",
           "--nnodes", "2", "--master-addr", machines.a.address, "--master-port", str(MASTER_PORT),
           "--pool-timeout-s", "30"]
    out = subprocess.run(machines.a.command(cmd), capture_output=True, text=True, timeout=WAIT, cwd=REPO_ROOT)
    assert out.returncode == 2, out.stderr
    assert [line for line in out.stderr.splitlines() if "error:" in line] == [
        "hosted-tinker serve: error: rank 0 (this server) would advertise 127.0.1.1 (hostname node-a) to the worker "
        "pool, a loopback address that ranks on other machines cannot reach: give --pool-interface NAME, the network "
        "interface the machines reach each other on (it sets GLOO_SOCKET_IFNAME and NCCL_SOCKET_IFNAME), or map "
        "node-a to that interface's address in /etc/hosts"], out.stderr
    assert "Traceback" not in out.stderr and "loading base model" not in out.stderr


def test_a_machine_whose_ranks_would_advertise_loopback_is_one_line_there_and_on_the_server(machines, tmp_path):
    """Machine B's `pool-node` names an interface other machines cannot reach it on (lo): it says so
    in one line and exits, and the server, waiting for machine B's rank, stops waiting and says the
    same line (not "is pool-node running there?")."""
    port = MASTER_PORT + 1
    node = pool_node(machines.b, tmp_path / "machine-b", tmp_path / "node.log", "--pool-interface", "lo", port=port)
    srv, forward = server_on(machines.a, tmp_path / "machine-a", port=port)
    try:
        with pytest.raises(RuntimeError, match="server exited with 2"):
            srv.start(timeout=START)
        assert node.wait(WAIT) == 2
    finally:
        srv.stop()
        end(node)
        forward.close()
    line = ("machine 1 (node-b) would advertise 127.0.0.1 (interface lo) to the worker pool, a loopback address that "
            "ranks on other machines cannot reach: give --pool-interface NAME, the network interface the machines "
            "reach each other on (it sets GLOO_SOCKET_IFNAME and NCCL_SOCKET_IFNAME)")
    assert f"hosted-tinker pool-node: error: {line}" in (tmp_path / "node.log").read_text().splitlines()
    assert [s for s in srv.log(tail=None).splitlines() if "error:" in s] == [f"hosted-tinker serve: error: {line}"]


@dataclass
class Pool:
    server: ServerProcess
    node: subprocess.Popen  # machine B's pool-node, which became its torchrun
    node_log: Path

    def node_says(self) -> str:
        return self.node_log.read_text(errors="replace")


@pytest.fixture(scope="module")
def pool(machines, tmp_path_factory):
    root = tmp_path_factory.mktemp("two_machines")
    node = pool_node(machines.b, root / "machine-b", root / "node-b.log",
                     env={"HOSTED_TINKER_FAULTS": "pool.rank_mid_pass@3"})
    srv, forward = server_on(machines.a, root / "machine-a", "--pool-timeout-s", "240")
    try:
        srv.start(timeout=START)
        yield Pool(srv, node, root / "node-b.log")
        srv.stop()
        assert node.wait(WAIT) == 0  # told to stop: machine B's torchrun ends with the pool
    finally:
        srv.stop()
        end(node)
        forward.close()


@dataclass
class Run:
    losses: list = field(default_factory=list)
    logprobs: list = field(default_factory=list)
    failed: tinker.RequestFailedError | None = None
    weights: dict = field(default_factory=dict)


def train(sc, before_step=lambda tc, s, batch: None, loses_a_pass: bool = False) -> Run:
    """Steps 0..4 of one tenant, each forward_backward answered before its optim_step (one after a
    failed pass would step on nothing). `before_step(tc, s, batch)` may start step s's
    forward_backward itself (returning its future). With `loses_a_pass`, step 2's first try is the
    pass in which machine B's rank dies (the pool's third): it must fail, and is tried again."""
    run = Run()
    tc = sc.create_lora_training_client(base_model=BASE_MODEL, rank=4, seed=5).result(timeout=WAIT)
    for s in range(5):
        batch = sft_batch(4, seed=s)
        if s == 2 and loses_a_pass:
            with pytest.raises(tinker.RequestFailedError) as failed:
                tc.forward_backward(batch, "cross_entropy").result(timeout=WAIT)
            run.failed = failed.value
        future = before_step(tc, s, batch) or tc.forward_backward(batch, "cross_entropy")
        out = future.result(timeout=WAIT)
        run.losses.append(out.metrics["loss:sum"])
        run.logprobs += logprobs_of(out)
        tc.optim_step(ADAM).result(timeout=WAIT)
    run.weights = tc.save_weights_for_sampler("end").result(timeout=WAIT).path
    return run


def kill_while_idle(pool: Pool, tc, s: int, batch):
    """Before step 3: machine B's rank killed with its torchrun held, step 3's pass sent: rank 0 can
    learn of the death only from the rank's closed socket as the pass goes out. Before step 4: the
    rank killed, and its successor started and asking to rejoin (before it loads the model)."""
    torchrun = torchrun_of(pool.node.pid)
    if s == 3:
        return kill_rank_before_sending(torchrun, lambda: tc.forward_backward(batch, "cross_entropy"),
                                        lambda: pool.server.log(tail=None))
    if s == 4:
        asked = pool.node_says().count(ASKED)
        rank_of(torchrun).kill()
        wait_until(lambda: pool.node_says().count(ASKED) > asked, "the restarted rank asks to rejoin")
    return None


@pytest.fixture(scope="module")
def on_the_pool(pool) -> Run:
    with pool.server.client("tml-pool") as sc:
        run = train(sc, lambda tc, s, batch: kill_while_idle(pool, tc, s, batch), loses_a_pass=True)
    run.weights = read_adapter(pool.server, run.weights)
    return run


@pytest.fixture(scope="module")
def in_one_process(tmp_path_factory) -> Run:
    srv = ServerProcess(tmp_path_factory.mktemp("one_process")).start(timeout=START)
    try:
        with srv.client("tml-pool") as sc:
            run = train(sc)
        run.weights = read_adapter(srv, run.weights)
    finally:
        srv.stop()
    return run


def test_training_over_two_machines_equals_one_process(on_the_pool, in_one_process):
    np.testing.assert_allclose(on_the_pool.losses, in_one_process.losses, **TOL)
    for a, b in zip(on_the_pool.logprobs, in_one_process.logprobs, strict=True):
        np.testing.assert_allclose(a, b, **TOL)
    assert on_the_pool.weights.keys() == in_one_process.weights.keys()
    for key, want in in_one_process.weights.items():
        np.testing.assert_allclose(on_the_pool.weights[key].numpy(), want.numpy(), **TOL, err_msg=key)


def test_a_rank_killed_in_flight_fails_that_pass_only(on_the_pool):
    """Step 2's first pass lost machine B's rank: it failed, for the client to resubmit; every other
    request of the run (that retry too) succeeded."""
    assert on_the_pool.failed is not None
    assert on_the_pool.failed.category is RequestErrorCategory.Server
    assert "worker pool" in on_the_pool.failed.message and "resubmit" in on_the_pool.failed.message
    assert len(on_the_pool.losses) == 5


def test_a_rank_killed_while_idle_fails_nothing(on_the_pool, pool):
    """Steps 3 and 4 followed a kill of machine B's rank while the pool was idle, and succeeded:
    rank 0 found the rank gone (step 3: as the pass went out; step 4: from its successor's request
    to rejoin, before anything went out), waited for it, relaunched, then ran the pass."""
    log = pool.server.log(tail=None)
    assert log.count(GONE) == 1
    assert log.count("relaunching the other ranks") == 3
    assert "worker pool: back (epoch 4, relaunch 3)" in log
    assert pool.node_says().count("rank 1 of 2 ready (epoch") == 4


def test_every_rank_logs_the_address_it_advertises(on_the_pool, pool):
    assert "worker pool: rank 0 advertises 10.213.0.1 (interface ht0)" in pool.server.log(tail=None)
    assert "rank 1 advertises 10.213.0.2 (interface ht0) to the worker pool" in pool.node_says()
