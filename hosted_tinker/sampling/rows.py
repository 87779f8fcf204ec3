"""A sample job in the built-in engine (engine.py), from its arrival to its answer, and its rows:
each picked token recorded, streamed and checked against the job's stops, and each job answered
exactly once (`on_done` with every row's sequence, or `on_error`).

A job's prompt is prefilled into one sequence of the KV cache (kv_cache.py), in chunks; then each
of its num_samples rows decodes from its own copy of it (`Row.seq`). While it holds the device it
reserves its worst case of the KV-cache budget (admission.py): every live row's prompt and all it
may generate.

A job fails for its own reason alone: `failure` says what it is told, a `UserFailure` (category
"user", a 400) where its own request caused the error (`UserError`), the server's fault otherwise.
"""

from __future__ import annotations

import functools
import logging
from dataclasses import dataclass, field
from typing import Callable

import torch

from ..errors import UserError
from .jobs import SampleJob, SampleResult, SequenceResult, SequenceSoFar, UserFailure
from .kv_cache import Seq, Swapped
from .prompt_logits import PromptAnswers
from .pick import Picked, RowSampling, row_seed

log = logging.getLogger(__name__)


@dataclass(eq=False)
class JobState:
    """A sample request as the engine runs it: its rows, its place in the KV pool, its answers so far."""
    request: SampleJob
    rows_left: int
    results: list[SequenceResult | None]
    prompt: PromptAnswers = PromptAnswers()  # once prefilled, what the job asks of its prompt
    failed: bool = False
    number: int = 0  # arrival order: the older job goes first (admission.py)
    adapter_id: str | None = None  # resolved at its first admission
    resolved: bool = False
    prefill: Seq | None = None  # the prompt's sequence while it is prefilled
    prefilled: int = 0  # prompt tokens in the cache so far
    prompt_logits: list[torch.Tensor] = field(default_factory=list)  # per chunk, when the job asks for them
    rope_delta: int = 0  # a vision-language prompt's rotary offset (image_positions.py)
    rows: list["Row"] = field(default_factory=list)  # its live rows, once prefilled
    swapped: Swapped | None = None  # its cache while preempted

    @classmethod
    def of(cls, job: SampleJob, number: int = 0) -> "JobState":
        return cls(job, job.num_samples, [None] * job.num_samples, number=number)

    @property
    def owner(self) -> str:
        return self.request.owner

    @property
    def row_tokens(self) -> int:
        """The most KV-cache tokens one of its rows holds: its prompt and all it may generate."""
        return len(self.request.prompt) + self.request.max_tokens

    @property
    def need(self) -> int:
        """What it reserves of the KV-cache budget while it runs: every row still to finish, at its
        worst case (a finished row gives its part back)."""
        return self.rows_left * self.row_tokens

    @property
    def prefilling(self) -> bool:
        return not self.rows

    @property
    def started(self) -> bool:
        """Whether any of its rows has a token, or it was answered."""
        return self.failed or self.rows_left < self.request.num_samples

    def fail(self, reason: str) -> None:
        """Answer the job with `reason` (once); the caller drops its rows."""
        if not self.failed:
            self.failed = True
            self.request.on_error(reason)


@dataclass(kw_only=True, eq=False)
class Row(SequenceSoFar):
    job: JobState
    index: int
    sampling: RowSampling
    adapter_id: str | None = None
    seq: Seq | None = None  # its cache: the prompt, then every token it generated but the newest


def rows_of(state: JobState, seqs: list[Seq]) -> list[Row]:
    """The job's num_samples rows, each with its own noise stream and its copy of the prompt's cache
    (its prompt is in the cache now: its decoded images, if any, are let go)."""
    job = state.request
    if job.pixels is not None:
        job.pixels.release()
    return [Row(job=state, index=i, adapter_id=state.adapter_id, seq=seq,
                sampling=RowSampling(temperature=job.temperature, top_k=job.top_k, top_p=job.top_p,
                                     key=row_seed(job.seed, i), logprobs_k=job.topk_sample_logprobs))
            for i, seq in zip(range(job.num_samples), seqs)]


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
        job = row.job.request
        token = picked.token
        row.tokens.append(token)
        row.logprobs.append(picked.logprob)
        if job.topk_sample_logprobs:
            row.topk_ids.append(picked.topk_ids)
            row.topk_logprobs.append(picked.topk_logprobs)
        self.tokens_generated += 1
        job.generated_tokens += 1
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
        job = st.request
        st.results[row.index] = row.result(with_topk=job.topk_sample_logprobs > 0)
        st.rows_left -= 1
        if st.rows_left == 0 and not st.failed:
            prompt = st.prompt
            self.requests_done += 1
            try:
                job.on_done(SampleResult(sequences=st.results, prompt_logprobs=prompt.logprobs,
                                         topk_prompt_ids=prompt.topk_ids, topk_prompt_logprobs=prompt.topk_logprobs,
                                         target_prompt_logprobs=prompt.target_logprobs,
                                         prompt_alt_tokens=prompt.alternatives))
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
