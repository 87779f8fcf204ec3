"""Fault points for tests: a failure at a known place, not a lucky one.

Tests arm points through the environment of the server process they start:
`HOSTED_TINKER_FAULTS="after_forward_backward:1,checkpoint.before_rename@2"`. Each entry is
`<point>[@<n>][:<times>]`: the point fires from its n-th reach on (default the first), `times`
times (default every time). What firing does is the point's kind:

- `check(point)` raises `InjectedFault` (a server fault in the middle of a cycle);
- `check_poisoned(point, rows)` raises `InjectedFault` where one of `rows` (datums' or prompts'
  tokens) holds the point's `POISONED` ids in a row: a request the model cannot take, raising
  wherever it is fused with others, as validation lets no real one through; only such reaches
  count. With `user=True` it raises `InjectedUserFault`, a `UserError` (a request the code below
  the API finds it cannot take);
- `crash_point(point)` kills the process with SIGKILL (a real kill -9 inside a checkpoint write);
- `gate(point)` holds the thread there until the test opens the point's gate (a FIFO in the
  folder `HOSTED_TINKER_GATES` names): work held in flight by construction, not by a race;
- `hold(point)`, for a point a thread passes again and again (the device loop's): every reach
  parks while the test keeps the point closed (a file `<point>.closed` in the same folder): it
  writes `<point>.held` and waits until the test removes `.closed` (open) or writes `<point>.step`
  (one reach through: the file is taken, and the next reach parks again). A test acts while the
  server is parked at a known moment (`helpers.Gate`); an armed point left open costs a file lookup.

Nothing else sets the variable; an unarmed point costs one dict lookup. Every point is declared
in `POINTS`, so a test can walk all of them and a misspelled one fails at start-up instead of
never firing.
"""

from __future__ import annotations

import os
import signal
import threading
import time
from dataclasses import dataclass
from pathlib import Path

from .errors import UserError

ENV_VAR = "HOSTED_TINKER_FAULTS"
GATES_VAR = "HOSTED_TINKER_GATES"
# What a datum or prompt poisoned for each check_poisoned() point holds (ids every test model has).
POISONED = {"pass.poisoned_datum": (4, 8, 15, 16, 23, 42),
            "cycle.poisoned_after_passes": (42, 23, 16, 15, 8, 4),
            "answer.poisoned": (8, 4, 42, 23, 15, 16),
            "sampling.prefill_poisoned": (666,),
            "sampling.decode_poisoned": (667,)}
HOLD_AT_MOST_S = 600.0  # a gate the test never opens lets go after this: a stuck test, not a stuck server

POINTS = {
    # check(): raises InjectedFault
    "after_forward_backward": "the fused pass done, its results not yet answered",
    "create_model.between_rows": "a new training run's row written, its first request's future not yet (one "
                                 "transaction: neither stands)",
    # check_poisoned(): raises InjectedFault where a datum holds the point's POISONED ids
    "pass.poisoned_datum": "a micro-batch (of any rank) holding a poisoned datum, in a forward or forward_backward "
                           "pass, after the pass's earlier micro-batches added their gradients",
    "cycle.poisoned_after_passes": "a cycle whose compute holds a poisoned datum, its passes done and not yet "
                                   "answered (a fault no rerun mends: the cycle fails)",
    "answer.poisoned": "a compute request holding a poisoned datum, its pass done and read, its answer being "
                       "made (it alone fails, its gradients already added: as a result that cannot be encoded)",
    # hold(): parks while the test's gate is closed
    "device_loop.before_plan": "the device loop, before it plans its next training cycle",
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
    # gate() in a rank > 0 of a worker pool (runtime/pool_worker.py)
    "pool.rank_before_join": "a rank has said it is ready to join the epoch's group and has not begun to join it",
    # In the built-in sampler (sampling/engine.py), reached once per forward that holds a job whose
    # prompt holds the point's POISONED ids: such a prompt breaks the forward, as a prompt the model
    # cannot take does (issue 33: a poisoned image prompt once failed every job prefilled beside it)
    "sampling.prefill_poisoned": "check_poisoned(user=True): a prefill holding a prompt poisoned for it",
    "sampling.decode_poisoned": "check_poisoned(): a decode step holding a row of a prompt poisoned for it",
    # trace_exports.py: a session trace's build
    "trace.build": "gate(): a session trace's build has started, nothing read yet",
    "trace.build_fails": "check(): a session trace's build fails",
    # image_decodes.py
    "image.decode": "gate(): a request's images about to be checked, one of its key's decode slots taken",
    "image.before_processing": "hold(): a request's images about to be processed for its pass or prefill, a "
                               "decode slot taken",
    # sqlite_db.py
    "db.user_query": "gate(): a query a user shaped (a search, a listing's page) at a check of its time budget: its "
                     "statement running, its read open on its thread's connection",
}


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


HOLDS = {"device_loop.before_plan", "image.before_processing"}  # the points that hold(): they need the gate dir
_armed: dict[str, _Armed] = {}
_lock = threading.Lock()


def arm_from_environment() -> None:
    """Arm the points $HOSTED_TINKER_FAULTS names: at import, and again in a process forked after
    the import with an environment of its own (the tests' servers: tests/server_process.py)."""
    global _armed
    armed = _parse(os.environ.get(ENV_VAR, ""))
    if HOLDS & set(armed) and not os.environ.get(GATES_VAR):
        raise RuntimeError(f"{ENV_VAR} arms {sorted(HOLDS & set(armed))}: set {GATES_VAR} to the test's gate dir")
    _armed = armed


arm_from_environment()


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


def check(point: str) -> None:
    """Raise `InjectedFault` if a test armed this point (and it has firings left)."""
    if _fires(point):
        raise InjectedFault(f"fault injected at {point!r} (${ENV_VAR})")


def check_poisoned(point: str, rows, *, user: bool = False) -> None:
    """Raise `InjectedFault` (`InjectedUserFault` with `user`) if a test armed this point and one of
    `rows` (token id sequences, read only when armed) holds the point's `POISONED` ids in a row."""
    if point not in _armed:
        return
    marker = POISONED[point]
    if any(_holds(row, marker) for row in rows) and _fires(point):
        raise (InjectedUserFault if user else InjectedFault)(
            f"fault injected at {point!r} (${ENV_VAR}): a request holding {list(marker)}")


def _holds(row, marker: tuple[int, ...]) -> bool:
    ids = [int(t) for t in row]
    return any(tuple(ids[i:i + len(marker)]) == marker for i in range(len(ids) - len(marker) + 1))


def hold(point: str) -> None:
    """If a test armed this point and closed its gate: park here until it opens the gate or lets one
    reach through (`.step`), saying so (`.held`)."""
    if point not in _armed:
        return
    gates = Path(os.environ[GATES_VAR])
    closed, held, step = (gates / f"{point}{suffix}" for suffix in (".closed", ".held", ".step"))
    if not closed.exists():
        return
    held.touch()  # once: the test removes it before it lets a reach through
    deadline = time.monotonic() + HOLD_AT_MOST_S
    while closed.exists() and time.monotonic() < deadline:
        try:
            step.unlink()
            return
        except FileNotFoundError:
            time.sleep(0.005)


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
