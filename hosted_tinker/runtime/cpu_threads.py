"""torch's CPU threads: one team, on the device loop's thread, of `--cpu-threads` threads.

torch's CPU kernels run their parallel regions on OpenMP (libgomp). libgomp keeps a team of
worker threads for every thread that ever ran a parallel region, for as long as that thread
lives, and once the teams' threads outnumber the CPUs it stops spinning between regions and
sleeps on a futex instead; a training step is thousands of short regions, each then paying a
wake-up. Measured on 2 CPUs (embedded-size model, hidden 256 x 4, one tenant, 4 x 96 tokens):
a step on the device loop's thread took 72 ms, and 143 ms once the fusion probe had run on the
main thread at start-up; through the SDK, 87 -> 163 ms.

So whatever computes at start-up (building the embedded model, loading a model, the fusion
probe) runs on a passing thread, whose team ends with it, and every later op runs on the device
loop's thread: the server keeps one team, as when everything runs on one thread.

How many threads that team has (`--cpu-threads`, `choose_threads`): every parallel op waits for
the team's slowest thread. A team as large as the CPUs leaves none to the server's own threads
(HTTP, SQLite, accounting) or to anything else on the host, and once one of its threads is off
the CPU every op waits a scheduler slice for it: on 2 CPUs with 2 CPU-bound processes beside
the server, 2 threads made 1,382 steps in 180 s (p99 4.2 s), 1 thread 3,791 (p99 0.44 s); every
tenant's step stalled together. A yielding wait policy (OMP_WAIT_POLICY=PASSIVE) kept under
half of one thread's steps there (benchmarks/busy_host.py, one run on a shared 2-CPU box). So `auto` keeps one CPU out of the team. The count is fixed
at start-up, never changed with the load: CPU kernels split work by thread count, so a count
that followed the load would make a run's bits depend on what else ran (runtime/invariance.py).
The count is set in the environment before torch is imported (libgomp sizes its teams from
$OMP_NUM_THREADS when it loads), and with `torch.set_num_threads` after.
"""

from __future__ import annotations

import contextlib
import math
import os
import threading
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Iterator, TypeVar

T = TypeVar("T")


def on_passing_thread(fn: Callable[..., T], *args, **kwargs) -> T:
    """`fn(*args, **kwargs)` on a new thread that ends when it returns; its result, or its exception."""
    out: dict[str, object] = {}

    def run() -> None:
        try:
            out["result"] = fn(*args, **kwargs)
        except BaseException as e:  # handed to the caller, re-raised there
            out["error"] = e

    thread = threading.Thread(target=run, name=f"start-up:{getattr(fn, '__name__', 'compute')}")
    thread.start()
    thread.join()
    if "error" in out:
        raise out["error"]  # type: ignore[misc]
    return out["result"]  # type: ignore[return-value]


@dataclass(frozen=True)
class ThreadChoice:
    threads: int
    why: str  # for the start-up log


def usable_cpus(cgroup_root: Path = Path("/sys/fs/cgroup")) -> int:
    """CPUs this process may run on: its affinity, capped by a cgroup v2 CPU quota (a container's --cpus)."""
    cpus = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    try:
        quota, period = (cgroup_root / "cpu.max").read_text().split()[:2]
        if quota != "max":
            cpus = min(cpus, max(1, math.floor(int(quota) / int(period))))
    except (OSError, ValueError):
        pass  # no cgroup v2 quota readable: the affinity is the bound
    return max(1, cpus)


def choose_threads(setting: str, environ: dict[str, str] | None = None, cpus: int | None = None) -> ThreadChoice:
    """The device loop's CPU threads for `--cpu-threads` (auto or N)."""
    environ = os.environ if environ is None else environ
    if setting != "auto":
        return ThreadChoice(int(setting), f"{setting} (--cpu-threads)")
    given = environ.get("OMP_NUM_THREADS", "").strip()
    if given.isdigit() and int(given) >= 1:
        return ThreadChoice(int(given), f"{given} ($OMP_NUM_THREADS)")
    cpus = usable_cpus() if cpus is None else cpus
    threads = max(1, cpus - 1)
    return ThreadChoice(threads, f"{threads} (auto: {cpus} CPU(s) usable, "
                                 f"{'one' if cpus > 1 else 'none'} kept for the server's other threads)")


@contextlib.contextmanager
def threads_in_environment(choice: ThreadChoice) -> Iterator[None]:
    """`choice.threads` in the environment while the block runs, then the environment put back:
    libgomp sizes its first teams from $OMP_NUM_THREADS when torch loads, so torch should load
    inside (and `apply_threads` then does the rest); child processes started after (a vLLM sidecar,
    a pool's ranks) choose their own. Nothing here imports torch: a start that a check refuses
    inside the block answers without the seconds torch takes to load."""
    saved = {k: os.environ.get(k) for k in ("OMP_NUM_THREADS", "MKL_NUM_THREADS")}
    os.environ.update(dict.fromkeys(saved, str(choice.threads)))
    try:
        yield
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


def apply_threads(threads: int) -> None:
    """Always set, even when torch already counts `threads` (from the environment): until it is set,
    a thread's first parallel op sizes its team from MKL's count, which $MKL_NUM_THREADS sets only
    if it is still there when MKL first reads it."""
    import torch

    torch.set_num_threads(threads)
