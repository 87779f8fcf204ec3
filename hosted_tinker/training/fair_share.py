"""`FairShare`: which training runs a cycle takes, in what order, and how much of each.

A cycle packs compute up to `max_tokens_per_cycle` tokens and `max_models_per_cycle` runs
(`CycleBudget`), taking runs in round-robin order; a run left out (or cut short) for lack of room
goes first in the next cycle, and the runs that ran go last, so a tenant with a huge queue cannot
starve small ones. A plan stops looking once the budget is full: with a thousand busy runs it
still visits about `max_models_per_cycle` of them.

The order holds only the runs that may have work (`wake`); a run with nothing ready `leave`s it
until something wakes it again, so idle runs cost a plan nothing. Not thread-safe: the scheduler
calls it under its lock.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass, field

from .cycle_plan import COMPUTE, Request


@dataclass
class CycleBudget:
    """A cycle's fair share: compute up to `max_tokens` tokens and `max_models` models, whole
    requests only, and at least one compute request per cycle however large."""
    max_tokens: int
    max_models: int
    tokens: int = 0
    models: set[str] = field(default_factory=set)

    @property
    def full(self) -> bool:
        """No other model's compute fits: the plan need look at no more models."""
        return self.tokens >= self.max_tokens or len(self.models) >= self.max_models

    def admit(self, mid: str, take: list[Request]) -> int:
        """How many of `take`'s leading compute requests fit, counted in."""
        admitted = 0
        for r in take:
            if r.kind not in COMPUTE:
                break
            over = (self.tokens + r.tokens > self.max_tokens
                    or (mid not in self.models and len(self.models) >= self.max_models))
            if over and (self.tokens > 0 or admitted > 0):
                break
            self.tokens += r.tokens
            admitted += 1
            self.models.add(mid)
        return admitted


class Turn:
    """One plan's walk over the round-robin order: the runs it visits while the budget has room,
    and where each goes in the next order."""

    def __init__(self, order: list[str], budget: CycleBudget):
        self.order = order
        self.budget = budget
        self.deferred: list[str] = []  # runs cut short by the budget: first in line next cycle
        self.unvisited: list[str] = []  # runs the plan did not reach: they keep their place
        self.waiting: list[str] = []  # runs whose next request waits for its images: they keep their place
        self.ran: list[str] = []  # runs with work in this plan: last in line next cycle

    def runs(self) -> Iterator[str]:
        """The runs to visit, in order, until the budget is full."""
        for i, mid in enumerate(self.order):
            if self.budget.full:  # the rest keep their place, ahead of the runs that ran
                self.unvisited = self.order[i:]
                return
            yield mid

    def admit(self, mid: str, take: list[Request]) -> list[Request]:
        """What of the run's prefix `take` the budget holds (its leading compute that fits, and what
        follows it only if all of it fits)."""
        admitted = self.budget.admit(mid, take)
        if admitted < sum(r.kind in COMPUTE for r in take):
            take = take[:admitted]
            self.deferred.append(mid)
        elif take:
            self.ran.append(mid)
        return take

    def wait(self, mid: str) -> None:
        """The run has ready work it cannot start yet (its images are being processed)."""
        self.waiting.append(mid)

    def next_order(self) -> list[str]:
        return self.deferred + self.unvisited + self.waiting + self.ran


class FairShare:
    """The round-robin order of the runs that may have work, and each plan's `Turn` over it."""

    def __init__(self, max_tokens_per_cycle: int, max_models_per_cycle: int):
        self.max_tokens_per_cycle = max_tokens_per_cycle
        self.max_models_per_cycle = max_models_per_cycle
        self._order: dict[str, None] = {}  # rotated every cycle

    def __contains__(self, mid: str) -> bool:
        return mid in self._order

    def __iter__(self) -> Iterator[str]:
        return iter(self._order)

    def wake(self, mid: str) -> None:
        """The run may have work: it joins the order (at its end) if not in it."""
        self._order.setdefault(mid)

    def leave(self, mid: str) -> None:
        self._order.pop(mid, None)

    def turn(self) -> Turn:
        return Turn(list(self._order), CycleBudget(self.max_tokens_per_cycle, self.max_models_per_cycle))

    def rotate(self, turn: Turn, with_work: Callable[[list[str]], list[str]]) -> None:
        """After a plan with work: the order `turn` says, less the runs that left it and those that
        `with_work` leaves out (whose queue the plan emptied: they leave now, not at their next visit)."""
        self._order = dict.fromkeys(with_work([m for m in turn.next_order() if m in self._order]))
