"""Shared helpers for tests: training the runtime in process, batches, reading a server's
checkpoints from disk and its /metrics, archives to import, waiting for what a server does on its
own, and `serve` run as a command that should refuse to start."""

from __future__ import annotations

import io
import json
import os
import re
import socket
import subprocess
import sys
import tarfile
import threading
import time
from pathlib import Path

import httpx
import numpy as np
import torch
from safetensors.torch import load_file

from hosted_tinker.checkpoints.paths import TinkerPath
from hosted_tinker.requests.kinds import DatumWork, FBWork
from hosted_tinker.runtime.adapters import AdamParams, LoRAConfig
from hosted_tinker.runtime.graphs import Entry
from hosted_tinker.runtime.losses import LOSSES, prepare_inputs, resolve_loss_config
from hosted_tinker.runtime.trainer import TrainingRuntime
from hosted_tinker.models.embedded import EMBEDDED_MODEL_NAME, ensure_embedded_model
from hosted_tinker.store.tables import db_path
from server_process import free_port

BASE_MODEL = EMBEDDED_MODEL_NAME
VOCAB = 1000  # ids used by tests stay below the embedded tokenizer's size
API_KEY = "tml-test-key-alice"  # the shared server's default key (conftest's `service_client`)
# The team server (conftest's `team_server`): owner -> API key, and who holds the admin role.
TEAM = {"alice": "tml-team-alice", "bob": "tml-team-bob", "root": "tml-team-root"}
TEAM_ADMINS = ("root",)
WAIT = 300.0  # hang guard for what a server does on its own (a TTL sweep...): never reached when all is well

# -- training the runtime in process (exactness tests: solo vs co-batched, eager vs graphed) -------
TENANTS = [  # (loss, config, rank, train flags)
    ("cross_entropy", {}, 8, dict()),
    ("importance_sampling", {}, 4, dict(train_mlp=False)),
    ("ppo", {}, 16, dict(train_unembed=False)),
    ("cispo", {}, 2, dict(train_attn=False)),
    ("dro", {"beta": 0.2}, 8, dict()),
    ("cross_entropy", {}, 32, dict(train_attn=False, train_unembed=False)),
    ("ppo", {"clip_low_threshold": 0.5, "clip_high_threshold": 1.5}, 4, dict()),
    ("importance_sampling", {}, 1, dict(train_mlp=False, train_unembed=False)),
    ("gspo", {}, 8, dict()),  # computes on the host: eager where the others are CUDA graphs
    ("cross_entropy", {}, 4, dict()),  # (N, 5) top-K targets (TOPK_TENANTS)
    ("cross_entropy", {}, 8, dict(train_mlp=False)),  # (N, 2) top-K targets
]
TOPK_TENANTS = {9: 5, 10: 2}  # tenant -> K of its (N, K) target_tokens and weights


def random_work(i: int, model_id: str, loss_fn: str, cfg: dict, lengths: tuple[int, ...] | None = None,
                targets_k: int = 0) -> FBWork:
    """A request of random datums; with `lengths`, of exactly those lengths (same shape for all);
    with `targets_k`, cross_entropy datums with (N, K) targets and weights."""
    rng = np.random.default_rng(1000 + i)
    data = []
    if lengths is None:  # lengths cross several padding buckets
        lengths = tuple(int(rng.integers(5, 90)) for _ in range(int(rng.integers(2, 5))))
    for n in lengths:
        shape = (n, targets_k) if targets_k else n
        inputs = {"target_tokens": rng.integers(0, 1000, shape)}
        if loss_fn == "cross_entropy":
            inputs["weights"] = rng.normal(0, 1, shape).astype(np.float32)
        else:
            inputs["logprobs"] = rng.normal(-7, 0.3, n).astype(np.float32)
            inputs["advantages"] = rng.normal(0, 1, n).astype(np.float32)
        data.append(DatumWork(tokens=rng.integers(0, 1000, n), inputs=inputs))
    resolved = resolve_loss_config(loss_fn, cfg)
    if LOSSES[loss_fn].inputs:  # what the API derives (gspo's ratio rows, per-row clip bounds)
        data = [DatumWork(d.tokens, prepare_inputs(k, loss_fn, resolved, d.inputs, len(data))) for k, d in enumerate(data)]
    return FBWork(model_id, data, loss_fn, resolved, forward_only=False)


class RerunCapture:
    """Stands in for CUDA graph capture (mock: no CUDA here). Capturing runs the step once on the
    static inputs to make its static outputs; a replay runs it again on those inputs and copies
    the new results into those outputs."""

    device = torch.device("cpu")

    def __init__(self):
        self.warm_ups = 0

    def warm_up(self, step, inputs):
        self.warm_ups += 1
        step(inputs)

    def __call__(self, step, inputs):
        outputs = step(inputs)

        def replay():
            with torch.no_grad():
                for static, new in zip(outputs, step(inputs)):
                    static.copy_(new)
        return Entry(inputs, outputs, replay)


def tenant_adam(i: int) -> AdamParams:
    """Tenant i's hyper-parameters: odd tenants clip their gradients (always, at this norm)."""
    return AdamParams(learning_rate=1e-2, weight_decay=0.01, grad_clip_norm=1e-3 if i % 2 else 0.0)


def split_batch_gap(runtime: TrainingRuntime, work: FBWork, learning_rate: float) -> float:
    """The same datums through two fresh adapters of one seed: all in one pass ("one"), or in two
    passes of half each ("two"); one AdamW step each; the largest difference of their logprobs then."""
    import dataclasses

    for name in ("one", "two"):
        runtime.create_adapter(name, LoRAConfig(rank=16, seed=4))
    half = len(work.data) // 2
    runtime.forward_backward([dataclasses.replace(work, model_id="one")])
    runtime.forward_backward([dataclasses.replace(work, model_id="two", data=work.data[:half])])
    runtime.forward_backward([dataclasses.replace(work, model_id="two", data=work.data[half:])])
    adam = AdamParams(learning_rate=learning_rate)
    runtime.optim_steps([("one", adam), ("two", adam)])
    out = runtime.forward_backward([dataclasses.replace(work, model_id=m, forward_only=True) for m in ("one", "two")])
    return max(float(np.abs(a["logprobs"] - b["logprobs"]).max()) for a, b in zip(out[0].outputs, out[1].outputs))


def train_tenants(runtime: TrainingRuntime, tenants: list[int], steps: int = 2, fused: bool = True):
    """Train the given tenants for `steps` steps: one fused pass and one multi-adapter AdamW step
    per step (as a server cycle does), or a pass and a step per tenant."""
    for mid in list(runtime.adapters):
        runtime.remove_adapter(mid)
    for i in tenants:
        loss_fn, cfg, rank, flags = TENANTS[i]
        runtime.create_adapter(f"t{i}", LoRAConfig(rank=rank, seed=i, **flags))
    history = {i: [] for i in tenants}
    for step in range(steps):
        works = [random_work(i * 10 + step, f"t{i}", TENANTS[i][0], TENANTS[i][1], targets_k=TOPK_TENANTS.get(i, 0))
                 for i in tenants]
        outs = runtime.forward_backward(works) if fused else [runtime.forward_backward([w])[0] for w in works]
        if fused:
            steps_out = runtime.optim_steps([(f"t{i}", tenant_adam(i)) for i in tenants])
        else:
            steps_out = [runtime.optim_step(f"t{i}", tenant_adam(i)) for i in tenants]
        for i, out, step_out in zip(tenants, outs, steps_out):
            history[i].append((out, step_out["grad_norm"]))
    state = {}
    for i in tenants:
        a = runtime.adapter(f"t{i}")
        state[i] = {k: v.detach().clone() for k, v in a.named_tensors().items()}
        for moment in ("exp_avg", "exp_avg_sq"):
            state[i].update({f"{k}.{moment}": a.optimizer.state[p][moment].clone()
                             for k, p in zip(a.named_tensors(), a.parameters())})
    return history, state


def assert_each_tenant_matches_solo(runtime: TrainingRuntime, tenants: list[int], fused_hist, fused_state,
                                    steps: int, outputs: tuple[str, ...] = ("logprobs",)) -> None:
    """Train each of `tenants` alone for `steps` steps and require its fused run's bits: loss:sum,
    grad_norm, the per-datum `outputs`, adapter weights and AdamW moments."""
    from hosted_tinker.runtime.invariance import same_bits

    for i in tenants:
        solo_hist, solo_state = train_tenants(runtime, [i], steps=steps)
        for (f, f_norm), (s, s_norm) in zip(fused_hist[i], solo_hist[i]):
            assert f.metrics["loss:sum"] == s.metrics["loss:sum"] and f_norm == s_norm
            for fo, so in zip(f.outputs, s.outputs):
                for name in outputs:
                    assert same_bits(torch.from_numpy(fo[name]), torch.from_numpy(so[name])), (i, name)
        for k in solo_state[i]:
            assert same_bits(fused_state[i][k], solo_state[i][k]), (i, k)


def forward_backward_body(model_id: str, seq_id: int, *data) -> bytes:
    """The protobuf body the SDK posts, for tests that send it by hand: their seq_ids, retries and
    request sizes are the test's, not the SDK's."""
    from tinker import types
    from tinker.proto.request_conv import forward_backward_request_to_proto

    request = types.ForwardBackwardRequest(model_id=model_id, seq_id=seq_id, forward_backward_input=(
        types.ForwardBackwardInput(data=list(data), loss_fn="cross_entropy")))
    return forward_backward_request_to_proto(request).SerializeToString()


def answered(http: httpx.Client, request_id: str) -> httpx.Response:
    """retrieve_future until the request is answered (a long poll says try_again while it waits)."""
    while True:
        r = http.post("/api/v1/retrieve_future", json={"request_id": request_id})
        if not r.headers["content-type"].startswith("application/json") or r.json().get("type") != "try_again":
            return r


def sft_datum(tokens: list[int], weights: list[float] | None = None):
    """A cross_entropy datum predicting tokens[1:] from tokens[:-1]."""
    from tinker import types

    inp, tgt = tokens[:-1], tokens[1:]
    w = weights if weights is not None else [1.0] * len(tgt)
    return types.Datum(model_input=types.ModelInput.from_ints(inp),
                       loss_fn_inputs={"target_tokens": tgt, "weights": w})


def sft_batch(n: int, seed: int = 0, min_len: int = 6, max_len: int = 24) -> list:
    rng = np.random.default_rng(seed)
    return [sft_datum(rng.integers(0, VOCAB, int(rng.integers(min_len, max_len))).tolist()) for _ in range(n)]


def rl_datum(tokens: list[int], sampling_logprobs: list[float], advantages: list[float]):
    from tinker import types

    return types.Datum(model_input=types.ModelInput.from_ints(tokens[:-1]),
                       loss_fn_inputs={"target_tokens": tokens[1:], "logprobs": sampling_logprobs,
                                       "advantages": advantages})


def database(data_dir: Path) -> Path:
    """A data dir's SQLite file (for tests that look at or tamper with records directly)."""
    return db_path(data_dir)


def checkpoint_dir(server, tinker_path: str) -> Path:
    path = TinkerPath.parse(tinker_path)
    return server.data_dir / "checkpoints" / path.run / path.kind / path.name


def read_adapter(server, tinker_path: str) -> dict[str, torch.Tensor]:
    return load_file(str(checkpoint_dir(server, tinker_path) / "adapter_model.safetensors"))


def model_dir(server) -> Path:
    return ensure_embedded_model(server.data_dir / "models")


def logprobs_of(result) -> list[np.ndarray]:
    return [np.asarray(o["logprobs"].to_numpy() if hasattr(o["logprobs"], "to_numpy") else o["logprobs"].data,
                       dtype=np.float32) for o in result.loss_fn_outputs]


def metric(server, name: str) -> float:
    """A /metrics series, summed over its label sets (a served model's series carry its base_model)."""
    text = httpx.get(f"{server.base_url}/metrics", timeout=30).text
    values = re.findall(rf"^{name}(?:\{{[^}}]*\}})? (\S+)$", text, re.M)
    assert values, f"{name} missing from /metrics"
    return sum(map(float, values))


def sampling_metrics(srv) -> dict[str, float]:
    """The sampling series by name, summed over their label sets (each carries its base_model)."""
    text = httpx.get(srv.base_url + "/metrics", timeout=30).text
    out: dict[str, float] = {}
    for line in text.splitlines():
        if line.startswith("hosted_tinker_sampl"):
            name, value = line.split("{")[0].split(" ")[0], float(line.rsplit(" ", 1)[1])
            out[name] = out.get(name, 0.0) + value
    return out


def wait_until(predicate, what: str, timeout: float = WAIT):
    """Poll until `predicate()` is truthy and return its value; the timeout only guards against a hang."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(0.05)
    raise AssertionError(f"never happened (waited {timeout:.0f} s): {what}")


def write_team_keys(path: Path, team: dict[str, str] = TEAM) -> Path:
    """A keys file of `team` (owner -> key)."""
    path.write_text("".join(f"{owner}: {key}\n" for owner, key in team.items()))
    return path


class Gate:
    """The test's side of a server's `hold` fault point (hosted_tinker/faults.py): the server is
    started with the point armed and `gates_env()` in its environment; while the gate is closed the
    server parks at the point, and the test lets it through one reach at a time or for good."""

    def __init__(self, folder: Path, point: str):
        self.folder, self.point = Path(folder), point
        self.folder.mkdir(parents=True, exist_ok=True)

    def gates_env(self) -> dict[str, str]:
        return {"HOSTED_TINKER_GATES": str(self.folder)}

    def _file(self, suffix: str) -> Path:
        return self.folder / f"{self.point}{suffix}"

    def close(self) -> None:
        self._file(".closed").touch()

    def wait_held(self) -> None:
        """Until the server is parked at the point (after something woke it to get there)."""
        wait_until(self._file(".held").exists, f"the server parks at {self.point}")

    def step(self) -> None:
        """Let the parked server through once, and wait until it is parked there again."""
        self._file(".held").unlink()
        self._file(".step").touch()
        self.wait_held()

    def open(self) -> None:
        self._file(".held").unlink(missing_ok=True)
        self._file(".closed").unlink(missing_ok=True)


def queued(server, n: int) -> None:
    """Until the server's training queues hold at least `n` requests."""
    wait_until(lambda: metric(server, "hosted_tinker_queue_depth") >= n, f"{n} training requests queued")


def in_one_cycle(server, gate: Gate, *posts) -> list:
    """Each `post()` sends one training request (an SDK call; its future is returned); all of them
    are queued while the device loop is parked before planning (`gate` is the server's
    `device_loop.before_plan`), so that its next cycle plans them together."""
    gate.close()
    depth = metric(server, "hosted_tinker_queue_depth")
    futures = [posts[0]()]
    queued(server, depth + 1)
    gate.wait_held()
    futures += [post() for post in posts[1:]]
    queued(server, depth + len(posts))
    gate.open()
    return futures


def tar_bytes(files: dict[str, bytes], extra: list[tarfile.TarInfo] = ()) -> bytes:
    """An uncompressed tar archive of `files` (name -> content), plus members given as TarInfo."""
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w") as tar:
        for name, data in files.items():
            info = tarfile.TarInfo(name)
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))
        for info in extra:
            tar.addfile(info)
    return buf.getvalue()


# -- `hosted_tinker serve` as a command: start-up checks ------------------------------------------
def serve(tmp_path: Path, *args: str, env: dict | None = None, cwd: Path | None = None,
          preexec_fn=None) -> subprocess.CompletedProcess:
    # An empty Hugging Face home: nothing cached, so model look-ups show what a fresh machine sees.
    base = {**os.environ, "HF_HOME": str(tmp_path / "hf"), "HF_HUB_DISABLE_TELEMETRY": "1"}
    base = {k: v for k, v in base.items() if not k.startswith("HOSTED_TINKER_") and k != "HF_HUB_OFFLINE"}
    return subprocess.run([sys.executable, "-m", "hosted_tinker", "serve", "--data-dir", str(tmp_path / "data"),
                           "--port", str(free_port()), *args], env={**base, **(env or {})},
                          capture_output=True, text=True, timeout=300, cwd=cwd,
                          preexec_fn=preexec_fn)


def assert_one_line_error(out: subprocess.CompletedProcess, pattern: str) -> None:
    assert out.returncode == 2, out.stderr
    errors = [line for line in out.stderr.splitlines() if "error:" in line]
    assert len(errors) == 1 and re.fullmatch(r"hosted-tinker serve: error: " + pattern, errors[0]), out.stderr
    assert "Traceback" not in out.stderr and "loading base model" not in out.stderr


def open_completion(srv, key: str, body: dict) -> socket.socket:
    """A /v1/completions request sent on a raw connection whose answer is never read (closing the
    socket is the client leaving: the server cancels the request)."""
    data = json.dumps(body).encode()
    sock = socket.create_connection(("127.0.0.1", srv.port))
    sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: test\r\nAuthorization: Bearer " + key.encode() +
                 b"\r\nContent-Type: application/json\r\nContent-Length: " + str(len(data)).encode() +
                 b"\r\n\r\n" + data)
    return sock


def open_gate(path) -> io.BufferedWriter:
    """The gate at `path` (faults.gate), once the server has reached it: the writer end of its FIFO,
    which lets the server go on when closed."""
    opened: list = []
    opener = threading.Thread(target=lambda: opened.append(open(path, "wb")), daemon=True)
    opener.start()
    opener.join(WAIT)  # a hang guard: the open returns as soon as the server's reader is there
    assert opened, f"the server never reached the gate {path}"
    return opened[0]
