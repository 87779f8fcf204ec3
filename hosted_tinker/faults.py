"""Deterministic crash injection, for tests: a real kill -9 at a known point, not a lucky one.

`HOSTED_TINKER_FAULT_POINT=<point>` in the server's environment makes the process SIGKILL itself
the first time it reaches `crash_point(<point>)`; `<point>@<n>` the n-th time (so a test can
let a first save through and kill the overwrite that follows). Unset (always, outside tests), a
crash point costs one comparison. Every point is declared in `POINTS`, so a test can walk all of
them, and a misspelled one fails at start-up instead of never firing.
"""

from __future__ import annotations

import os
import signal

ENV_VAR = "HOSTED_TINKER_FAULT_POINT"

# The moments inside a checkpoint write (save, overwrite, import, delete, TTL sweep) where a
# kill -9 leaves a distinct state on disk; `checkpoints.recovery` repairs each of them.
POINTS = {
    "checkpoint.after_tensors": "adapter weights written into the temporary folder, the rest not yet",
    "checkpoint.before_rename": "the temporary folder complete and synced, not renamed into place",
    "checkpoint.between_renames": "overwrite: the old folder moved aside, the new one not yet in place",
    "checkpoint.before_old_removed": "overwrite: the new folder in place, the old one not yet removed",
    "checkpoint.before_record": "the new folder in place, its record not yet written",
    "checkpoint.after_record_deleted": "delete: the record gone, the folder still in place",
    "checkpoint.in_trash": "delete: the folder renamed to .trash-*, not yet removed",
}


def _armed(spec: str | None) -> tuple[str | None, int]:
    if not spec:
        return None, 0
    point, _, nth = spec.partition("@")
    if point not in POINTS or not (nth or "1").isdigit() or int(nth or "1") < 1:
        raise RuntimeError(f"{ENV_VAR}={spec!r}: expected <point> or <point>@<n>, a point among {sorted(POINTS)}")
    return point, int(nth or "1")


_POINT, _LEFT = _armed(os.environ.get(ENV_VAR))


def crash_point(name: str) -> None:
    global _LEFT
    if name not in POINTS:
        raise KeyError(f"crash point {name!r} is not declared in faults.POINTS")
    if name == _POINT:
        _LEFT -= 1
        if _LEFT == 0:
            os.kill(os.getpid(), signal.SIGKILL)
