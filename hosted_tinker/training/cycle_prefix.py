"""What a cycle may take of one training run's ready requests: the prefix rule.

A cycle takes, from a run's requests in `seq_id` order, the longest prefix of the form

    (forward | forward_backward)*  optim_step?  (create | save | load | unload)*

so per-run order is never violated: an optim_step runs after all of the run's earlier compute, a
save sees exactly the weights its `seq_id` position implies, and compute that follows a save or
load waits for the next cycle.

A part of a request in parts (`Request.more`) is its run's only compute in its cycle (the run's
earlier compute runs a cycle before the first part, its later compute a cycle after the last), so
that a failed part can put back exactly the gradients from before the request (request_parts.py).

A compute request whose images are not decoded yet ends the prefix: its decode is asked for
(image_decodes.py, whose end rings the scheduler's `on_work`), and so is that of the run's next
compute requests that one cycle's budget holds with it.
"""

from __future__ import annotations

import itertools
from enum import IntEnum

from .cycle_plan import COMPUTE, Request
from ..requests.kinds import FBWork, RequestKind


class _Stage(IntEnum):
    """Where a run's prefix of a cycle stands: its compute, then at most one optim_step, then
    its tail requests (create, save, load, unload)."""
    COMPUTE = 0
    OPTIM = 1
    TAIL = 2


def cycle_prefix(ready: list[Request], max_tokens_per_cycle: int) -> list[Request]:
    """The longest prefix of the module docstring's form of a run's `ready` requests."""
    take: list[Request] = []
    stage = _Stage.COMPUTE
    for i, r in enumerate(ready):
        if r.kind in COMPUTE:
            if stage > _Stage.COMPUTE or (r.in_parts and take) or (take and take[-1].in_parts):
                break
            if not _images_ready(ready, i, max_tokens_per_cycle):
                break
        elif r.kind == RequestKind.OPTIM_STEP:
            if stage > _Stage.COMPUTE:
                break
            stage = _Stage.OPTIM
        else:
            stage = _Stage.TAIL
        take.append(r)
        if r.more:  # a split request: nothing after it until its last part
            break
    return take


def waits_for_images(r: Request, ask: bool = False) -> bool:
    """Whether a compute request's images are not decoded yet (`ask`: asking for their decode)."""
    if not isinstance(r.payload, FBWork) or not r.payload.images:
        return False
    if ask:
        return not all([p.ready() for p in r.payload.images])  # a list: every one is asked, not only the first
    return any(p.waiting for p in r.payload.images)


def _images_ready(ready: list[Request], i: int, max_tokens_per_cycle: int) -> bool:
    """Whether compute request `ready[i]`'s images (those of its part to plan) are decoded. If not,
    their decode is asked for, and so is that of the run's next compute requests that one cycle's
    budget holds with it: they decode side by side while other runs' cycles run, and nothing queued
    further back is decoded yet."""
    if not waits_for_images(ready[i], ask=True):
        return True
    tokens = ready[i].tokens
    for later in itertools.islice(ready, i + 1, None):
        tokens += later.tokens
        if later.kind not in COMPUTE or later.in_parts or tokens > max_tokens_per_cycle:
            break
        waits_for_images(later, ask=True)
    return False
