"""Helpers shared by the benchmark scripts."""

from __future__ import annotations


def cpu_stall_us() -> float | None:
    """Linux PSI: total microseconds some runnable task waited for a CPU (None if unavailable)."""
    try:
        with open("/proc/pressure/cpu") as f:
            return float(f.readline().split("total=")[1])
    except (OSError, IndexError, ValueError):
        return None
