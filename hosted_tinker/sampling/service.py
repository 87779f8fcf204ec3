"""`SamplingService`: turns validated sample requests into engine jobs and results into futures.

The API thread builds jobs and wakes the clock-cycle thread; the cycle thread runs the engine
(`run_round`) after its training work and encodes each finished request as the protobuf
`SampleResponse` the SDK expects.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Callable

import numpy as np

from ..futures import FutureStore
from ..wire.codec import SampledSequenceOut, TopkOut, encode_sample_response
from .engine import SampleJob, SampleResult, SamplingEngine
from .snapshots import SnapshotCache

log = logging.getLogger(__name__)


class SamplingService:
    def __init__(self, engine: SamplingEngine, snapshots: SnapshotCache, futures: FutureStore,
                 wake: Callable[[], None], training_waiting: Callable[[], bool], *, round_seconds: float = 0.25,
                 last_cycle_seconds: Callable[[], float] = lambda: 0.0):
        self.engine = engine
        self.snapshots = snapshots
        self.futures = futures
        self._wake = wake
        self._training_waiting = training_waiting
        self.round_seconds = round_seconds
        self._last_cycle_seconds = last_cycle_seconds

    def has_work(self) -> bool:
        return self.engine.has_work()

    def submit(self, request_id: str, job: SampleJob,
               record: Callable[[SampleResult], None] | None = None) -> None:
        """Queue a job whose result resolves future `request_id`.

        The job's own on_done/on_error run first (the API layer releases the key's sampling
        allowance there); `record` (see records.py) stores its samples before the answer exists, so
        a client that sees the answer can train on them at once.
        """
        own_done, own_error = job.on_done, job.on_error

        def done(result: SampleResult) -> None:
            own_done(result)
            if record is not None:
                record(result)
            self.futures.resolve(request_id, encode_result(result), is_proto=True)

        def error(message: str) -> None:
            own_error(message)
            self.futures.fail(request_id, message, "server")

        job.on_done, job.on_error = done, error
        self.submit_job(job)

    def submit_job(self, job: SampleJob) -> None:
        """Queue a job with the caller's own callbacks (on_done, on_error, on_token), left untouched.

        They run on the cycle thread: keep them short and hand results to other threads.
        """
        self.engine.submit(job)
        self._wake()

    def run_round(self) -> None:
        """Called on the cycle thread after each cycle's training work."""
        if not self.engine.has_work():
            return
        active = self.engine.active_adapter_ids()

        def resolve(job: SampleJob) -> str | None:
            if job.adapter_id is None:
                return None
            return self.snapshots.ensure(Path(job.adapter_id), keep=active)

        # When training waits, sampling still gets as long as the last training cycle took (capped
        # by the round length): an even share of the device, so neither side stalls the other.
        share = min(self._last_cycle_seconds(), self.round_seconds)
        self.engine.run(self._training_waiting, max(self.round_seconds, share), resolve, min_seconds=share)


def encode_result(result: SampleResult) -> bytes:
    seqs = []
    for s in result.sequences:
        topk = None
        if s.topk_ids is not None:
            topk = TopkOut(token_ids=np.asarray(s.topk_ids, dtype=np.int64),
                           logprobs=np.asarray(s.topk_logprobs, dtype=np.float32))
        seqs.append(SampledSequenceOut(tokens=s.tokens, logprobs=np.asarray(s.logprobs, dtype=np.float32),
                                       stop_reason=s.stop_reason, topk_sampled_logprobs=topk))
    topk_prompt = None
    if result.topk_prompt_ids is not None:
        topk_prompt = TopkOut(token_ids=result.topk_prompt_ids, logprobs=result.topk_prompt_logprobs)
    return encode_sample_response(seqs, prompt_logprobs=result.prompt_logprobs, topk_prompt_logprobs=topk_prompt)
