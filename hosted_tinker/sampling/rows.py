"""A running sample job and its rows in the built-in engine (engine.py): each picked token
recorded, streamed and checked against the job's stops, and each job answered exactly once
(`on_done` with every row's sequence, or `on_error`).

A job fails for its own reason alone: `failure` says what it is told, a `UserFailure` (category
"user", a 400) where its own request caused the error (`UserError`), the server's fault otherwise.
"""

from __future__ import annotations

import functools
import logging
from dataclasses import dataclass
from typing import Callable

from ..errors import UserError
from .jobs import SampleJob, SampleResult, SequenceResult, SequenceSoFar, UserFailure
from .pick import Picked, RowSampling, row_seed

log = logging.getLogger(__name__)


@dataclass
class JobState:
    job: SampleJob
    rows_left: int
    results: list[SequenceResult | None]
    prompt_info: tuple = (None, None, None)
    prompt_scores: tuple = (None, None)  # (ScoredTargets, PromptAlternatives), each None unless asked
    failed: bool = False

    @classmethod
    def of(cls, job: SampleJob) -> "JobState":
        return cls(job, job.num_samples, [None] * job.num_samples)

    @property
    def started(self) -> bool:
        """Whether any of its rows has a token, or it was answered."""
        return self.failed or self.rows_left < self.job.num_samples

    def fail(self, reason: str) -> None:
        """Answer the job with `reason` (once); the caller drops its rows."""
        if not self.failed:
            self.failed = True
            self.job.on_error(reason)


@dataclass(kw_only=True)
class Row(SequenceSoFar):
    job: JobState
    index: int
    sampling: RowSampling
    adapter_id: str | None = None


def rows_of(state: JobState, adapter_id: str | None) -> list[Row]:
    """The job's num_samples rows, each with its own noise stream."""
    job = state.job
    return [Row(job=state, index=i, adapter_id=adapter_id,
                sampling=RowSampling(temperature=job.temperature, top_k=job.top_k, top_p=job.top_p,
                                     key=row_seed(job.seed, i), logprobs_k=job.topk_sample_logprobs))
            for i in range(job.num_samples)]


def failure(e: Exception) -> str:
    """What a job that `e` failed is told: a user error if its own request caused it (`UserError`)."""
    if isinstance(e, UserError):
        return UserFailure(str(e))
    return f"sampling failed on the server: {type(e).__name__}: {e}"


class RowRecorder:
    """Records rows' tokens and answers their jobs; counts what it answered."""

    def __init__(self, tokenizer, on_request_done: Callable[[SampleJob, int], None]):
        self.tokenizer = tokenizer
        self.on_request_done = on_request_done  # observation (api/metrics.py)
        self.tokens_generated = 0
        self.requests_done = 0

    def record(self, row: Row, picked: Picked) -> bool:
        """Record `row`'s next token; whether the row is finished."""
        job = row.job.job
        token = picked.token
        row.tokens.append(token)
        row.logprobs.append(picked.logprob)
        if job.topk_sample_logprobs:
            row.topk_ids.append(picked.topk_ids)
            row.topk_logprobs.append(picked.topk_logprobs)
        self.tokens_generated += 1
        if token in job.stop_token_ids or (job.stop_strings and self._hit_stop_string(row, job)):
            row.stop_reason = "stop"
        elif len(row.tokens) >= job.max_tokens:
            row.stop_reason = "length"
        if job.on_token is not None:
            _report_token(job, row)
        return row.stop_reason is not None

    def _hit_stop_string(self, row: Row, job: SampleJob) -> bool:
        """Whether a stop string ends in the row's newest token: only the tail that can hold one is
        decoded and scanned (the earlier text was scanned at earlier tokens), so a token costs the
        stop strings' length, not the row's."""
        tail = self.tokenizer.decode(row.tokens[-_stop_window(job.stop_strings):], skip_special_tokens=False)
        return any(s in tail for s in job.stop_strings)

    def finish_row(self, row: Row) -> None:
        """The row is done: its job is answered once its last row is."""
        st = row.job
        job = st.job
        st.results[row.index] = row.result(with_topk=job.topk_sample_logprobs > 0)
        st.rows_left -= 1
        if st.rows_left == 0 and not st.failed:
            lp, ids, lps = st.prompt_info
            targets, alternatives = st.prompt_scores
            self.requests_done += 1
            try:
                job.on_done(SampleResult(sequences=st.results, prompt_logprobs=lp, topk_prompt_ids=ids,
                                         topk_prompt_logprobs=lps, target_prompt_logprobs=targets,
                                         prompt_alt_tokens=alternatives))
            except Exception as e:  # encoding the answer failed: the request fails, others go on
                log.exception("delivering a sample result failed")
                job.on_error(failure(e))
            try:
                self.on_request_done(job, sum(len(r.tokens) for r in st.results))
            except Exception:  # an observer must not fail the requests
                log.exception("a sampling observer failed")


def _report_token(job: SampleJob, row: Row) -> None:
    """Hand a streaming consumer the token just chosen; its failure never stops the batch."""
    top = bool(job.topk_sample_logprobs)
    try:
        job.on_token(row.index, row.tokens[-1], row.logprobs[-1], row.topk_ids[-1] if top else None,
                     row.topk_logprobs[-1] if top else None, row.stop_reason)
    except Exception:
        log.exception("a streaming on_token callback failed")


@functools.lru_cache(maxsize=256)
def _stop_window(stop_strings: tuple[str, ...]) -> int:
    """Tokens whose text holds every stop string that ends in the last of them. A token decodes
    to at least one byte, so the last B + 1 tokens hold any B-byte span ending in the newest; a few
    more absorb a partial character or a stripped leading space at the window's start."""
    return max(len(s.encode()) for s in stop_strings) + 4
