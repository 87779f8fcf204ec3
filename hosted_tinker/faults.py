"""Fault points for tests: a failure at a known place, not a lucky one.

Tests arm points through the environment of the server process they start:
`HOSTED_TINKER_FAULTS="after_forward_backward:1,checkpoint.before_rename@2"`. Each entry is
`<point>[@<n>][:<times>]`: the point fires from its n-th reach on (default the first), `times`
times (default every time). What firing does is the point's kind:

- `check(point)` raises `InjectedFault` (a server fault in the middle of a cycle);
- `check_user(point)` raises `InjectedUserFault`, a `UserError` (a request the code below the
  API finds it cannot take);
- `crash_point(point)` kills the process with SIGKILL (a real kill -9 inside a checkpoint write);
- `gate(point)` holds the thread there until the test opens the point's gate (a FIFO in the
  folder `HOSTED_TINKER_GATES` names): work held in flight by construction, not by a race.

Nothing else sets the variable; an unarmed point costs one dict lookup. Every point is declared
in `POINTS`, so a test can walk all of them and a misspelled one fails at start-up instead of
never firing.
"""

from __future__ import annotations

import os
import signal
import threading
from dataclasses import dataclass

from .errors import UserError

ENV_VAR = "HOSTED_TINKER_FAULTS"
GATES_VAR = "HOSTED_TINKER_GATES"

POINTS = {
    # check(): raises InjectedFault
    "after_forward_backward": "the fused pass done, its results not yet answered",
    # crash_point(): SIGKILL. The moments inside a checkpoint write (save, overwrite, import,
    # delete, TTL sweep) where a kill leaves a distinct state on disk; checkpoints/recovery.py
    # repairs each of them.
    "checkpoint.after_tensors": "adapter weights written into the temporary folder, the rest not yet",
    "checkpoint.before_rename": "the temporary folder complete and synced, not renamed into place",
    "checkpoint.between_renames": "overwrite: the old folder moved aside, the new one not yet in place",
    "checkpoint.before_old_removed": "overwrite: the new folder in place, the old one not yet removed",
    "checkpoint.before_record": "the new folder in place, its record not yet written",
    "checkpoint.after_record_deleted": "delete: the record gone, the folder still in place",
    "checkpoint.in_trash": "delete: the folder renamed to .trash-*, not yet removed",
    # crash_point() in a rank > 0 of a worker pool's first epoch (its relaunched successors never
    # reach it): runtime/distributed.py
    "pool.rank_mid_pass": "a pass's share done and its gradients summed into rank 0's, its outputs not yet sent",
    # In the built-in sampler (sampling/engine.py), reached once per forward that holds a job whose
    # prompt has the point's POISON token: such a prompt breaks the forward, as a prompt the model
    # cannot take does (issue 33: a poisoned image prompt once failed every job prefilled beside it)
    "sampling.prefill_poisoned": "check_user(): a prefill holding a prompt poisoned for it",
    "sampling.decode_poisoned": "check(): a decode step holding a row of a prompt poisoned for it",
    # trace_exports.py: a session trace's build
    "trace.build": "gate(): a session trace's build has started, nothing read yet",
    "trace.build_fails": "check(): a session trace's build fails",
    # services/images.py
    "image.decode": "gate(): a request's images about to be decoded, one of its key's decode slots taken",
}

# The token that poisons a prompt for each sampling.* point (ids every test model's vocabulary has).
POISON = {"sampling.prefill_poisoned": 666, "sampling.decode_poisoned": 667}


class InjectedFault(RuntimeError):
    pass


class InjectedUserFault(UserError):
    pass


@dataclass
class _Armed:
    skip: int          # reaches to let through before the first firing
    left: int | None   # firings left; None: every time


def _parse(spec: str) -> dict[str, _Armed]:
    armed: dict[str, _Armed] = {}
    for item in filter(None, (part.strip() for part in spec.split(","))):
        head, _, times = item.partition(":")
        name, _, nth = head.partition("@")
        if name not in POINTS or not (nth or "1").isdigit() or int(nth or "1") < 1 or not (times or "1").isdigit():
            raise RuntimeError(f"{ENV_VAR}: {item!r} is not <point>[@<n>][:<times>] with a point among {sorted(POINTS)}")
        armed[name] = _Armed(skip=int(nth or "1") - 1, left=int(times) if times else None)
    return armed


_armed = _parse(os.environ.get(ENV_VAR, ""))
_lock = threading.Lock()


def _fires(point: str) -> bool:
    if point not in POINTS:
        raise KeyError(f"fault point {point!r} is not declared in faults.POINTS")
    if point not in _armed:
        return False
    with _lock:
        armed = _armed[point]
        if armed.skip > 0:
            armed.skip -= 1
            return False
        if armed.left == 0:
            return False
        if armed.left is not None:
            armed.left -= 1
        return True


def armed(point: str) -> bool:
    """Whether a test armed `point` (for points whose firing depends on what a request holds)."""
    if point not in POINTS:
        raise KeyError(f"fault point {point!r} is not declared in faults.POINTS")
    return point in _armed


def check(point: str) -> None:
    """Raise `InjectedFault` if a test armed this point (and it has firings left)."""
    if _fires(point):
        raise InjectedFault(f"fault injected at {point!r} (${ENV_VAR})")


def check_user(point: str) -> None:
    """Raise `InjectedUserFault` (a `UserError`) if a test armed this point (and it has firings left)."""
    if _fires(point):
        raise InjectedUserFault(f"fault injected at {point!r} (${ENV_VAR})")


def crash_point(point: str) -> None:
    """Kill this process with SIGKILL if a test armed this point: a real kill -9, right here."""
    if _fires(point):
        os.kill(os.getpid(), signal.SIGKILL)


def gate(point: str) -> None:
    """If a test armed this point, wait here until it opens the gate: the FIFO named `point` in the
    folder $HOSTED_TINKER_GATES. The test's open of it for writing returns once this thread has it
    open (the point is reached); its close lets this thread go on. Neither side polls."""
    if _fires(point):
        with open(os.path.join(os.environ[GATES_VAR], point), "rb") as fifo:
            fifo.read()  # until the test closes its end
