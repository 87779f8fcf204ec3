"""Fault points for tests: a named point raises `InjectedFault` when the test armed it.

Tests arm points through the environment of the server process they start:
`HOSTED_TINKER_FAULTS="after_forward_backward:1,other_point"` makes `after_forward_backward` fail
once and `other_point` every time. Nothing else sets the variable; an unarmed point costs one
dict lookup.
"""

from __future__ import annotations

import os
import threading

ENV_VAR = "HOSTED_TINKER_FAULTS"


class InjectedFault(RuntimeError):
    pass


def _parse(spec: str) -> dict[str, int | None]:
    armed: dict[str, int | None] = {}
    for item in filter(None, (part.strip() for part in spec.split(","))):
        name, _, times = item.partition(":")
        armed[name] = int(times) if times else None  # None: every time
    return armed


_armed = _parse(os.environ.get(ENV_VAR, ""))
_lock = threading.Lock()


def check(point: str) -> None:
    """Raise `InjectedFault` if a test armed this point (and it has firings left)."""
    if point not in _armed:
        return
    with _lock:
        left = _armed.get(point, 0)
        if left == 0:
            return
        if left is not None:
            _armed[point] = left - 1
    raise InjectedFault(f"fault injected at {point!r} (${ENV_VAR})")
