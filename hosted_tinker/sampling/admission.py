"""Which waiting sample jobs the built-in engine starts, and which running ones it pauses for them.

The KV cache the running jobs hold is bounded by a budget in tokens (kv_budget.py), whoever sent
them: a job reserves its worst case, every live row's prompt plus its max_tokens (`JobState.need`),
from its start until it ends, and a finished row gives its part back. Each API key's running jobs
may hold at most its share of the budget (`max_sampling_kv_share_per_key`), and the engine runs at
most `max_rows` rows at once.

Jobs are served in arrival order, without letting a large job hold back small ones:

- a waiting job starts as soon as it fits beside the running ones (its key's share, the free
  budget, the free rows): a small job never waits behind a large one that does not fit yet;
- a waiting job is never delayed by younger ones that started meanwhile: as soon as pausing
  running jobs younger than it would make room for it, they are paused (preempted: their cache is
  swapped out of the pool, kv_cache.py) and it starts. A paused job waits in its arrival place,
  so it resumes before anything that came after it, with its cache as it was: its samples are the
  ones it would have had uninterrupted;
- a job over its key's share waits for that key's own jobs to end (or pauses that key's younger
  ones), holding back no other key.

A job with images starts once they are decoded (image_decodes.py): the first time it would start,
their decode is asked for and it waits, holding no room, while the jobs behind it may start; its
images are decoded no sooner, so a queued job holds them as sent.

Every started job finishes: only younger jobs are paused, so the oldest running job always runs
on. A job larger than its key's share could never start and is refused before it is queued
(`SamplingEngine.refusal`).
"""

from __future__ import annotations

import bisect
from dataclasses import dataclass, field

from .rows import JobState


@dataclass
class AdmissionPlan:
    start: list[JobState] = field(default_factory=list)  # waiting jobs to start, oldest first
    pause: list[JobState] = field(default_factory=list)  # running jobs to pause first (younger than what starts)


@dataclass
class _Room:
    tokens: int  # of the whole budget
    rows: int
    held: dict[str, int]  # per key: what its running jobs reserve

    def shortfall(self, job: JobState, per_key: int) -> tuple[int, int, int]:
        """What `job` lacks to start: (budget tokens, its key's tokens, rows); all <= 0 when it fits."""
        return (job.need - self.tokens, self.held.get(job.owner, 0) + job.need - per_key,
                job.rows_left - self.rows)

    def take(self, job: JobState, sign: int = 1) -> None:
        self.tokens -= sign * job.need
        self.rows -= sign * job.rows_left
        self.held[job.owner] = self.held.get(job.owner, 0) + sign * job.need


class Admission:
    """The waiting and running jobs, in arrival order, and the rule above."""

    def __init__(self, budget_tokens: int, tokens_per_key: int, max_rows: int):
        self.budget_tokens = budget_tokens
        self.tokens_per_key = tokens_per_key
        self.max_rows = max_rows
        self.waiting: list[JobState] = []
        self.running: list[JobState] = []

    def reserved(self) -> int:
        return sum(job.need for job in list(self.running))

    def reserved_of(self, owner: str) -> int:
        return sum(job.need for job in list(self.running) if job.owner == owner)

    def wait(self, job: JobState) -> None:
        """Queue `job` in its arrival place."""
        at = len(self.waiting)
        while at and self.waiting[at - 1].number > job.number:
            at -= 1
        self.waiting.insert(at, job)

    def plan(self) -> AdmissionPlan:
        """Oldest first: each waiting job starts if it fits, or if pausing running jobs younger
        than it makes it fit; otherwise it waits, and the younger ones behind it may still start."""
        held: dict[str, int] = {}
        for job in self.running:
            held[job.owner] = held.get(job.owner, 0) + job.need
        room = _Room(self.budget_tokens - sum(held.values()),
                     self.max_rows - sum(job.rows_left for job in self.running), held)
        plan = AdmissionPlan()
        by_age = sorted(self.running, key=lambda j: j.number)  # a job's younger ones: a suffix
        numbers = [j.number for j in by_age]
        for job in self.waiting:
            paused: list[JobState] = []
            if max(room.shortfall(job, self.tokens_per_key)) > 0:
                younger = by_age[bisect.bisect_right(numbers, job.number):]
                paused = self._make_room(job, room, [j for j in reversed(younger) if j not in plan.pause])
                if paused is None:
                    continue
            if job.request.pixels is not None and not job.request.pixels.ready():
                for other in paused:  # nobody is paused for a job that cannot start yet
                    room.take(other)
                continue
            plan.pause += paused
            room.take(job)
            plan.start.append(job)
        return plan

    def waits_for_images(self) -> bool:
        """Whether every waiting job waits for its images (no job to start or run otherwise)."""
        return all(job.request.pixels is not None and job.request.pixels.waiting for job in self.waiting)

    def _make_room(self, job: JobState, room: _Room, younger: list[JobState]) -> list[JobState] | None:
        """Of `younger` (running jobs younger than `job`, youngest first), those whose pausing makes
        it fit, their room given back to `room`; None where pausing all of them would not."""
        if not younger:
            return None
        tokens, key, rows = room.shortfall(job, self.tokens_per_key)
        chosen: list[JobState] = []
        for other in younger:
            if tokens <= 0 and key <= 0 and rows <= 0:
                break
            if tokens > 0 or rows > 0 or (key > 0 and other.owner == job.owner):  # it helps
                chosen.append(other)
                tokens, rows = tokens - other.need, rows - other.rows_left
                key -= other.need if other.owner == job.owner else 0
        if tokens > 0 or key > 0 or rows > 0:
            return None
        for other in chosen:
            room.take(other, sign=-1)
        return chosen
