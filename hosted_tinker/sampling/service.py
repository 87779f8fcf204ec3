"""`SamplingService`: the API's door to sampling. A validated request becomes a `SampleJob` for
the sampling backend; its result becomes the protobuf `SampleResponse` the SDK expects, stored
as the request's future.
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np

from ..requests.futures import FutureStore
from ..wire.codec import SampledSequenceOut, TensorOut, TopkOut, encode_sample_response
from .backend import SamplingBackend
from .jobs import SampleJob, SampleResult, UserFailure


class SamplingService:
    def __init__(self, backend: SamplingBackend, futures: FutureStore):
        self.backend = backend
        self.futures = futures

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
            self.futures.fail(request_id, message, "user" if isinstance(message, UserFailure) else "server")

        job.on_done, job.on_error = done, error
        self.submit_job(job)

    def submit_job(self, job: SampleJob) -> None:
        """Queue a job with the caller's own callbacks (on_done, on_error, on_token), left untouched.

        They run on the backend's thread: keep them short and hand results to other threads.
        """
        self.backend.submit(job)

    def submit_jobs(self, jobs: list[SampleJob]) -> None:
        """Queue the jobs of one request together (see `submit_job`)."""
        self.backend.submit_all(jobs)

    def refusal(self, job: SampleJob) -> str | None:
        """Why `job` could never run on this model's sampler (see `SamplingBackend.refusal`), or None."""
        return self.backend.refusal(job)

    def cancel(self, job: SampleJob) -> None:
        """Nobody waits for this job any more (its client left): the backend stops it."""
        self.backend.cancel(job)

    def current_weights_ref(self, model_id: str) -> str | None:
        """What the jobs of one request take as `adapter_id` to sample training model `model_id`'s current
        weights, if it is loaded (see `SamplingBackend.current_weights_ref`)."""
        return self.backend.current_weights_ref(model_id)

    def session_opened(self, adapter_dir: str) -> None:
        self.backend.session_opened(adapter_dir)


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
    targets = alternatives = None
    if result.target_prompt_logprobs is not None:
        scored = result.target_prompt_logprobs
        layout = None if scored.layout is None else (scored.layout.crow, scored.layout.col)
        targets = TensorOut(scored.logprobs, layout)
    if result.prompt_alt_tokens is not None:
        alternatives = (result.prompt_alt_tokens.tokens, result.prompt_alt_tokens.logprobs)
    return encode_sample_response(seqs, prompt_logprobs=result.prompt_logprobs, topk_prompt_logprobs=topk_prompt,
                                  target_prompt_logprobs=targets, prompt_alt_tokens=alternatives)
