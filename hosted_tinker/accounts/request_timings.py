"""`RequestTimings`: each request of a session on its way through the server (arrived, ran, answered), kept
in memory until the accounting's next flush; `trace_builder.py` draws a session's trace from them.

Only requests of a session are timed: a training run's, or a sample through a sampling session.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass

from ..training.cycle_plan import Request
from ..store.accounting import RequestTiming


@dataclass(frozen=True)
class CycleSpan:
    """One clock cycle of a base model's device loop, as its requests' timings show it."""

    base_model: str
    number: int  # the model's clock cycle, counted from the server's start
    started: float  # unix seconds
    ended: float
    ended_monotonic: float  # `ended` on the monotonic clock (requests' arrivals are stamped on it)
    co_tenants: int  # the other adapters in the cycle


class RequestTimings:
    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._timings: list[RequestTiming] = []

    def add_training(self, session_id: str, cycle: CycleSpan, req: Request, answered_at: float | None,
                     outcome: str) -> None:
        """`req` (or a part of it: outcome `part`, not answered yet) ran in `cycle`."""
        arrived = cycle.ended - (cycle.ended_monotonic - req.arrived_at)
        self._add(RequestTiming(session_id, cycle.base_model, req.request_id, str(req.kind), req.model_id, arrived,
                                cycle.started, cycle.ended, answered_at, cycle.number, cycle.co_tenants, req.tokens,
                                outcome))

    def add_sample(self, session_id: str, base_model: str, request_id: str, sampling_session_id: str,
                   arrived: float, first_token: float | None, ended: float, tokens: int, outcome: str) -> None:
        """A sample that ended (and was answered) at `ended`, its first token at `first_token` (None: none)."""
        self._add(RequestTiming(session_id, base_model, request_id, "sample", sampling_session_id, arrived,
                                first_token, ended, ended, None, None, tokens, outcome))

    def take(self) -> list[RequestTiming]:
        """What was added since the last take."""
        with self._lock:
            timings, self._timings = self._timings, []
        return timings

    def put_back(self, timings: list[RequestTiming]) -> None:
        """Timings taken but not written (the write failed): kept for the next flush, before newer ones."""
        with self._lock:
            self._timings[:0] = timings

    def _add(self, timing: RequestTiming) -> None:
        if not timing.session_id:  # a request of no session is in no trace
            return
        with self._lock:
            self._timings.append(timing)
