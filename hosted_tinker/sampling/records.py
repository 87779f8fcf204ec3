"""Recorded samples: what the sampler produced, kept so that `stable_reinforce` can train on it.

A sample request with `record_stability_info=True` makes the server keep, per returned sequence,
the sampled tokens and their float32 sampler logprobs (bit-identical to the returned ones), and
per request the prompt, the weights it sampled from and temperature / top_k / top_p. Nothing of it
is returned: the SDK gets only the `sequence_id`s, fixed when the request is submitted, and names
them later in a datum's provenance (see services/provenance.py).

Records live in SQLite (they survive restarts) and belong to the API key and the Tinker session
that sampled them. They last `ttl_s` (a day) from their last use: every training or forward
request that names one restarts its day. Expired records are deleted at most every
`sweep_every_s`, when new ones are stored; until then a lookup already treats them as expired.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Callable, Iterable

import numpy as np

from ..store.tables import Store
from .jobs import SampleJob, SampleResult

DAY_S = 24 * 3600.0
RECORD_HINT = "stable_reinforce trains only on samples taken with record_stability_info=True"


def sequence_ids(sampling_session_id: str, seq_id: int, num_samples: int) -> list[str]:
    """The ids of one sample request's sequences, fixed at submission.

    They name the sampling session (itself unique to one Tinker session) and the request's seq_id,
    so a deduplicated re-POST of the same request hands out the same ids, and an id says where it
    came from even when nothing was recorded for it.
    """
    return [f"{sampling_session_id}:{seq_id}:{i}" for i in range(num_samples)]


def _request_of(sequence_id: str) -> tuple[str, int] | None:
    """(sampling_session_id, seq_id) of an id made by `sequence_ids`, or None."""
    parts = sequence_id.rsplit(":", 2)
    if len(parts) != 3 or not parts[1].isdigit() or not parts[2].isdigit():
        return None
    return parts[0], int(parts[1])


@dataclass(frozen=True)
class SampleRecord:
    sequence_id: str
    session_id: str
    prompt: np.ndarray  # int32 [P], the request's prompt tokens
    tokens: np.ndarray  # int32 [S], the sampled tokens as returned
    logprobs: np.ndarray  # float32 [S], the sampler logprobs as returned
    weights: str  # tinker:// sampler path, or "base:<model>"
    weights_version: float | None  # the sampler checkpoint's creation time (None for the base model)
    temperature: float
    top_k: int
    top_p: float


@dataclass(frozen=True)
class Unusable:
    """Why a named sequence cannot be trained on; `not_found` ones are a 404 (unknown, or another key's)."""

    reason: str
    not_found: bool = False


class SampleRecords:
    def __init__(self, store: Store, *, ttl_s: float = DAY_S, clock: Callable[[], float] = time.time,
                 sweep_every_s: float = 600.0):
        self.store = store
        self.ttl_s = ttl_s
        self.clock = clock
        self.sweep_every_s = sweep_every_s
        self._last_sweep = clock()

    # -- sampling side ------------------------------------------------------------------------------
    def request_was_recorded(self, sampling_session_id: str, seq_id: int) -> bool:
        return self.store.samples.request_exists(sampling_session_id, seq_id)

    def recorder(self, *, request_id: str, owner: str, session_id: str, sampling_session_id: str, seq_id: int,
                 weights: str, weights_version: float | None, job: SampleJob) -> Callable[[SampleResult], None]:
        """A callback that stores a finished request's records (called before its answer exists)."""
        prompt = np.asarray(job.prompt, np.int32).tobytes()
        ids = sequence_ids(sampling_session_id, seq_id, job.num_samples)

        def record(result: SampleResult) -> None:
            now = self.clock()
            rows = [(sid, i, np.asarray(s.tokens, np.int32).tobytes(), np.asarray(s.logprobs, np.float32).tobytes())
                    for i, (sid, s) in enumerate(zip(ids, result.sequences, strict=True))]
            self.store.samples.insert(
                dict(request_id=request_id, owner=owner, session_id=session_id,
                     sampling_session_id=sampling_session_id, seq_id=seq_id, weights=weights,
                     weights_version=weights_version, prompt=prompt, temperature=job.temperature,
                     top_k=job.top_k, top_p=job.top_p, created_at=now), rows, now)
            self._maybe_sweep(now)

        return record

    # -- training side ------------------------------------------------------------------------------
    def for_training(self, owner: str, session_id: str, ids: Iterable[str]) -> dict[str, SampleRecord | Unusable]:
        """Every id's record if `owner`'s session `session_id` may train on it, else why not.

        The usable ones start a new day of life.
        """
        wanted = sorted(set(ids))
        now = self.clock()
        rows = {r.sequence_id: r for r in self.store.samples.get(wanted)}
        out: dict[str, SampleRecord | Unusable] = {}
        for sid in wanted:
            row = rows.get(sid)
            if row is None or row.owner != owner:
                out[sid] = self._unrecorded(owner, sid)
            elif row.last_used_at + self.ttl_s <= now:
                out[sid] = Unusable(f"its record expired: records last {self.ttl_s:g} s from their last use; "
                                    "sample again and train on it sooner")
            elif row.session_id != session_id:
                out[sid] = Unusable(f"it was sampled in session {row.session_id!r}; a training request can "
                                    f"only name sequences sampled in its own session ({session_id!r})")
            else:
                out[sid] = SampleRecord(
                    sequence_id=sid, session_id=row.session_id, prompt=np.frombuffer(row.prompt, np.int32),
                    tokens=np.frombuffer(row.tokens, np.int32), logprobs=np.frombuffer(row.logprobs, np.float32),
                    weights=row.weights, weights_version=row.weights_version, temperature=row.temperature,
                    top_k=row.top_k, top_p=row.top_p)
        self.store.samples.touch([sid for sid, r in out.items() if isinstance(r, SampleRecord)], now)
        return out

    def _unrecorded(self, owner: str, sequence_id: str) -> Unusable:
        """No record this key may see: say whether the id is one of its own unrecorded samples."""
        request = _request_of(sequence_id)
        session = self.store.sampling_sessions.get(request[0]) if request else None
        if session is None or session.owner != owner:
            return Unusable(f"not found: no sample request of this API key returned it ({RECORD_HINT})",
                            not_found=True)
        return Unusable(f"it has no record: it was sampled without record_stability_info=True, or its record "
                        f"expired after {self.ttl_s:g} s unused ({RECORD_HINT})")

    # -- expiry ---------------------------------------------------------------------------------------
    def _maybe_sweep(self, now: float) -> None:
        if now - self._last_sweep >= self.sweep_every_s:
            self.sweep(now)

    def sweep(self, now: float | None = None) -> int:
        """Delete every expired record; returns how many went."""
        now = self.clock() if now is None else now
        self._last_sweep = now
        return self.store.samples.delete_unused_since(now - self.ttl_s)
