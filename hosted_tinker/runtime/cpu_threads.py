"""Keep torch's CPU thread pool on one thread: start-up compute runs on a thread that then ends.

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
"""

from __future__ import annotations

import threading
from typing import Callable, TypeVar

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
