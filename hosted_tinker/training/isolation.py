"""A fused pass that raises fails only the request that made it raise.

A clock cycle runs many tenants' forward / forward_backward requests as one fused pass. When it
raises, the error is one request's (a datum the model cannot take) or nobody's (a transient
fault). `run_isolating` then reruns the pass's requests in halves -- every model's requests kept
together while several models are left, so a tenant's gradient adds up as in one pass -- until
each request has its results or failed in a pass of its own (the culprit). Two facts make the
others' results exact: a failed pass leaves every gradient as it was before it
(`runtime.adapters.GradientPass`), and a tenant's bits do not depend on who shares its pass. So
each request that succeeds gets what it would have got had the culprit never been sent. (A
culprit model's own other requests of the cycle are split from it: their gradients add up as
if each had come in a cycle of its own.)

Cost: a pass of n models that one request fails reruns at most 2·log2(n) smaller passes, their
tokens at most the failed pass's per level of halving. A key whose request was found failing
alone is held in `Quarantine`: for its next `clean_passes` passes its requests run in a pass of
their own, so a key that fails every cycle pays for its failures itself and never makes the
others' requests run twice.

`MachineFault` is a failure that no request caused (a rank of a worker pool died, the pool is
down): it fails the pass's requests at once, with nothing rerun.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Hashable, Sequence
from dataclasses import dataclass, field
from typing import Generic, TypeVar

from ..errors import MachineFault

log = logging.getLogger(__name__)

W = TypeVar("W")  # one request's work, as the pass takes it
O = TypeVar("O")  # its outcome

QUARANTINE_PASSES = 8  # clean passes a key runs apart after one of its requests failed a pass alone


@dataclass
class IsolatedPass(Generic[O]):
    """Each request's outcome, or the error of the smallest pass it failed in (None where it has
    an outcome), and what finding that cost."""

    outcomes: list[O | None]
    errors: list[BaseException | None]
    failed_passes: int = 0  # passes that raised, the first one included
    reruns: int = 0  # passes run after the first one raised
    culprits: list[int] = field(default_factory=list)  # requests that failed a pass of their own


def run_isolating(run: Callable[[list[W]], list[O]], works: Sequence[W], groups: Sequence[Hashable]
                  ) -> IsolatedPass[O]:
    """`run(works)` (one fused pass), and where it raises, the reruns that find which request made
    it raise. `groups[i]` is request i's model: a model's requests are split only once it is
    the last one left in a failing pass (then into halves, in their order)."""
    result: IsolatedPass[O] = IsolatedPass([None] * len(works), [None] * len(works))
    pending = [list(range(len(works)))]
    first = True
    while pending:
        idx = pending.pop(0)
        if not first:
            result.reruns += 1
        first = False
        try:
            outs = run([works[i] for i in idx])
        except MachineFault as e:
            result.failed_passes += 1
            for i in idx:
                result.errors[i] = e
            continue
        except Exception as e:
            result.failed_passes += 1
            if len(idx) == 1:
                result.errors[idx[0]] = e
                result.culprits.append(idx[0])
                continue
            log.warning("a pass of %d requests failed (%s: %s); running them again in halves to find the one "
                        "that failed it", len(idx), type(e).__name__, e)
            pending[:0] = halves(idx, groups)
            continue
        for i, out in zip(idx, outs):
            result.outcomes[i] = out
    return result


def halves(idx: list[int], groups: Sequence[Hashable]) -> list[list[int]]:
    """`idx` in two: by whole models while it holds several, else its requests in order."""
    models = list(dict.fromkeys(groups[i] for i in idx))
    if len(models) == 1:
        return [idx[:len(idx) // 2], idx[len(idx) // 2:]]
    left = set(models[:len(models) // 2])
    return [[i for i in idx if groups[i] in left], [i for i in idx if groups[i] not in left]]


class Quarantine:
    """Keys whose request failed a pass of its own; each runs its requests apart (a pass per key)
    until it has run `clean_passes` passes in a row that did not fail."""

    def __init__(self, clean_passes: int = QUARANTINE_PASSES):
        self.clean_passes = clean_passes
        self._left: dict[str, int] = {}

    def __contains__(self, key: str) -> bool:
        return key in self._left

    def convict(self, key: str) -> None:
        self._left[key] = self.clean_passes

    def passed(self, key: str) -> None:
        """A held key's pass ran without a failure."""
        left = self._left.get(key)
        if left is not None:
            if left <= 1:
                del self._left[key]
            else:
                self._left[key] = left - 1

    def __len__(self) -> int:
        return len(self._left)
