"""Helpers shared by the benchmark scripts (run from the repository root: they import hosted_tinker)."""

from __future__ import annotations

import os
import statistics

import numpy as np


def cpu_stall_us() -> float | None:
    """Linux PSI: total microseconds some runnable task waited for a CPU (None if unavailable)."""
    try:
        with open("/proc/pressure/cpu") as f:
            return float(f.readline().split("total=")[1])
    except (OSError, IndexError, ValueError):
        return None


def process_cpu_ns(pid: int) -> int:
    """Nanoseconds the threads of process `pid` have run on a CPU (Linux schedstat, summed over its
    threads): psutil's CPU times tick in 10 ms, too coarse for a request's few."""
    total = 0
    for task in os.listdir(f"/proc/{pid}/task"):
        try:
            with open(f"/proc/{pid}/task/{task}/schedstat") as f:
                total += int(f.read().split()[0])
        except (OSError, IndexError, ValueError):  # a thread that ended meanwhile
            continue
    return total


def cpu_ms_per_post(http, pid: int, path: str, bodies: list[tuple[bytes, str]]) -> float:
    """POST each (body, content type) to `path` with `http` (an httpx.Client), one after another;
    the CPU that server process `pid` spent on them, in ms per POST."""
    before = process_cpu_ns(pid)
    for content, media in bodies:
        http.post(path, content=content, headers={"Content-Type": media}).raise_for_status()
    return (process_cpu_ns(pid) - before) / 1e6 / len(bodies)


def sdk_datums(seqs: list[list[int]]) -> list:
    """The SDK's cross-entropy datums of these token sequences: each predicts its own next tokens."""
    from tinker import types

    return [types.Datum(model_input=types.ModelInput.from_ints(s[:-1]),
                        loss_fn_inputs={"target_tokens": s[1:], "weights": [1.0] * (len(s) - 1)}) for s in seqs]


def forward_backward_message(datums: list):
    """A forward_backward of `datums` encoded as the SDK sends it (protobuf); set its model_id and seq_id
    before each `SerializeToString()`."""
    from tinker import types
    from tinker.proto.request_conv import forward_backward_request_to_proto

    return forward_backward_request_to_proto(types.ForwardBackwardRequest(
        model_id="", seq_id=0, forward_backward_input=types.ForwardBackwardInput(data=datums, loss_fn="cross_entropy")))


def cycle_step(runtime, works: list, steps: list[tuple[str, object]]) -> None:
    """One training step of `works` done as a server cycle does it: the fused pass and the AdamW
    steps launched, one wait for the device, then both read. On a GPU, `forward_backward` then
    `optim_steps` would wait twice and launch AdamW only after the pass (5-7 ms more a step on the
    1.4B body, H200). A revision older than the launch API (compare_revisions.py) runs those two."""
    if not hasattr(runtime, "launch_forward_backward"):
        runtime.forward_backward(works)
        runtime.optim_steps(steps)
        return
    fb = runtime.launch_forward_backward(works)
    pending = runtime.launch_optim_steps(steps)
    runtime.wait()
    fb.outcomes()
    pending.results()


def host_op_counts(fn) -> tuple[int, int]:
    """(all, top-level) aten ops that one call of fn dispatches (runtime/step_audit.py's count)."""
    from hosted_tinker.runtime.step_audit import host_op_counts as count

    return count(fn)


def matmul_peak_tflops(device, dtype, n: int | None = None, repeats: int = 5) -> float:
    """What one square matmul reaches on this device and dtype, in TFLOP/s (best of `repeats`):
    the yardstick for a training step's TFLOP/s, measured in the same run."""
    import time

    import torch

    n = n or (8192 if device.type == "cuda" else 1024)
    a = torch.randn(n, n, device=device, dtype=dtype)
    b = torch.randn(n, n, device=device, dtype=dtype)
    best = float("inf")
    for _ in range(repeats + 1):  # the first call warms up
        if device.type == "cuda":
            torch.cuda.synchronize()
        t = time.perf_counter()
        a @ b
        if device.type == "cuda":
            torch.cuda.synchronize()
        best = min(best, time.perf_counter() - t)
    return 2 * n ** 3 / best / 1e12


def tenant_rows(n_tenants: int, rows: int, seq_len: int, vocab: int, seed: int = 0) -> list[np.ndarray]:
    """Per tenant, a [rows, seq_len + 1] array of token ids (input = [:-1], target = [1:])."""
    rng = np.random.default_rng(seed)
    return [rng.integers(0, vocab, (rows, seq_len + 1)) for _ in range(n_tenants)]


def first_module(package: str, *names: str):
    """The first of `package`'s modules `names` that this revision has (modules moved between
    revisions: compare_revisions.py imports an older one under another name)."""
    import importlib

    for name in names:
        try:
            return importlib.import_module(f"{package}.{name}")
        except ModuleNotFoundError as e:
            if e.name is None or not f"{package}.{name}".startswith(e.name):
                raise  # the module is there but something it imports is not
    raise ModuleNotFoundError(f"{package} has none of {', '.join(names)}")


def fb_work(model_id: str, seqs: np.ndarray, package: str = "hosted_tinker"):
    """One tenant's cross_entropy request over `seqs` (rows of tenant_rows), as the runtime takes it.

    `package`: the runtime's package (compare_revisions.py imports an older revision under another name)."""
    import importlib

    # where this revision declares the request types (older ones: at the package root, or in the trainer)
    request_types = first_module(package, "requests.kinds", "request_types", "runtime.trainer")
    losses = importlib.import_module(f"{package}.runtime.losses")
    cfg = losses.resolve_loss_config("cross_entropy", {})
    data = [request_types.DatumWork(np.ascontiguousarray(s[:-1], dtype=np.int64),
                                    {"target_tokens": np.ascontiguousarray(s[1:], dtype=np.int64),
                                     "weights": np.ones(len(s) - 1, dtype=np.float32)}) for s in seqs]
    return request_types.FBWork(model_id=model_id, data=data, loss_fn="cross_entropy", loss_config=cfg, forward_only=False)


def paired_ratio(times: dict[str, list[float]], x: str, y: str) -> float:
    """Throughput of x over y: the median over rounds of time(y) / time(x) within each round.

    Each round runs every variant once, back to back, so a ratio taken inside a round cancels
    the slow drifts of a shared machine (its speed wanders by 10-20% over tens of seconds) that
    a ratio of two separate medians keeps.
    """
    return statistics.median(ty / tx for tx, ty in zip(times[x], times[y]))
