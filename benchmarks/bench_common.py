"""Helpers shared by the benchmark scripts."""

from __future__ import annotations


def cpu_stall_us() -> float | None:
    """Linux PSI: total microseconds some runnable task waited for a CPU (None if unavailable)."""
    try:
        with open("/proc/pressure/cpu") as f:
            return float(f.readline().split("total=")[1])
    except (OSError, IndexError, ValueError):
        return None


def host_op_counts(fn) -> tuple[int, int]:
    """(all, top-level) aten ops that one call of fn dispatches, by torch.profiler on the host.

    "All" counts ops nested inside others too (e.g. the per-tensor loops inside the CPU
    implementations of multi-tensor kernels such as `_fused_adamw_`); "top-level" counts what
    the Python side dispatches, which on a GPU is one or more kernel launches each.
    """
    import torch

    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        fn()
    ops = [e for e in prof.events() if e.name.startswith("aten::")]
    top = [e for e in ops if e.cpu_parent is None or not e.cpu_parent.name.startswith("aten::")]
    return len(ops), len(top)


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
