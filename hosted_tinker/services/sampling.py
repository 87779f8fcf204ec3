"""`SamplingRequests`: sample requests of both APIs (Tinker `asample`, OpenAI) on their way to the sampler.

Each request is bounded on its own (prompts, `n`, requested tokens, stop strings, image pixels, and each job's KV
cache against the sampler's whole KV-cache budget: a `UserError`, a 400, naming the setting) and each API key's
sampling work in flight (requests, requested tokens, waiting or running, and image pixels, in the key's budget shared
with its training requests: images.py) is bounded too: beyond it the key gets `Busy`, a 429 naming the limit, which
the SDK treats as back-pressure and retries. So one key's flood waits at its own door instead of queueing ahead of everyone else.
A key's allowance is given back when its job ends: done, failed, or cancelled because its client
went away. A request's images are checked only once its allowance is taken (a refused request decoded none), and
processed only shortly before its prefill (image_decodes.py).
"""

from __future__ import annotations

import threading
from pathlib import Path
from typing import Callable

from ..accounts.access import Access
from ..errors import Busy, UserError
from ..sampling.jobs import SampleJob, SampleResult
from ..server.core import Server
from ..server.served_models import ServedModel
from ..models.vision import total_pixels
from . import checkpoint_base_model, served_model
from .images import ImagePixelBudget


def sample_job(served: ServedModel, prompt: list[int], *, max_tokens: int | None, default_max_tokens: int, top_k: int,
               stop_strings: tuple[str, ...], **fields) -> SampleJob:
    """The job of a sample request of either API (Tinker `asample`, OpenAI), `prompt` checked against `served`'s
    vocabulary and context and the parameters both APIs share: the same mistake gets the same message from
    both. `max_tokens` None asks for up to `default_max_tokens`, as many as fit; `fields` are the job's
    others (`SampleJob`)."""
    runtime = served.runtime
    if not prompt:
        raise UserError("the prompt is empty")
    bad = [t for t in prompt if not 0 <= t < runtime.vocab_size]
    if bad:
        raise UserError(f"prompt token {bad[0]} is outside the vocabulary [0, {runtime.vocab_size})")
    room = runtime.max_context - len(prompt)
    if room < 1:
        raise UserError(f"the prompt has {len(prompt)} tokens: no room left in the model's context of "
                        f"{runtime.max_context} tokens")
    if max_tokens is not None and max_tokens > room:
        raise UserError(f"the prompt ({len(prompt)} tokens) plus max_tokens ({max_tokens}) exceeds the model's "
                        f"context of {runtime.max_context} tokens")
    if top_k == 0 or top_k < -1:
        raise UserError(f"top_k must be -1 (no limit) or >= 1, got {top_k}")
    if any(s == "" for s in stop_strings):
        raise UserError("stop strings must not be empty")
    return SampleJob(prompt=prompt, max_tokens=min(default_max_tokens, room) if max_tokens is None else max_tokens,
                     top_k=top_k, stop_strings=stop_strings, **fields)


def requested_tokens(job: SampleJob) -> int:
    """The most tokens a job can draw: its samples' and its prompt_alt_tokens_k draws at every prompt position."""
    return job.num_samples * job.max_tokens + (len(job.prompt) - 1) * job.prompt_alt_tokens_k


class SamplingAllowance:
    """Sampling requests and requested tokens in flight per API key, and their image pixels in the key's
    `images` budget (shared with its training requests)."""

    def __init__(self, max_requests: int, max_tokens: int, images: ImagePixelBudget):
        self.max_requests = max_requests
        self.max_tokens = max_tokens
        self.images = images
        self._lock = threading.Lock()
        # One entry per key with requests in flight (a refusal adds none), not per key ever seen.
        self.requests: dict[str, int] = {}
        self.tokens: dict[str, int] = {}

    def take(self, owner: str, jobs: list[SampleJob]) -> "Lease":
        """A lease on `jobs`' share of `owner`'s allowance, or `Busy` naming the limit it would pass."""
        tokens, pixels = sum(requested_tokens(j) for j in jobs), total_pixels(j.pixels for j in jobs)
        with self._lock:
            requests, held_tokens = self.requests.get(owner, 0), self.tokens.get(owner, 0)
            if requests + 1 > self.max_requests:
                raise Busy(f"this API key has {requests} sampling requests in flight "
                           f"(max_sampling_requests_per_key = {self.max_requests}); wait for some to finish")
            if held_tokens + tokens > self.max_tokens:
                raise Busy(f"this API key has sampling requests for {held_tokens} tokens in flight "
                           f"and this one asks for {tokens} more (max_sampled_tokens_per_key = "
                           f"{self.max_tokens}); wait for some to finish")
            self.images.take(owner, pixels)  # last: nothing is held when a check above refuses
            self.requests[owner] = requests + 1
            self.tokens[owner] = held_tokens + tokens
        return Lease(self, owner, tokens, pixels)

    def _give_back(self, owner: str, tokens: int, pixels: int) -> None:
        with self._lock:
            self.requests[owner] -= 1
            self.tokens[owner] -= tokens
            if not self.requests[owner]:
                del self.requests[owner], self.tokens[owner]
        self.images.give_back(owner, pixels)


class Lease:
    """One request's share of a key's allowance; released once, however many times asked."""

    def __init__(self, allowance: SamplingAllowance, owner: str, tokens: int, pixels: int):
        self._allowance, self._owner, self._tokens, self._pixels = allowance, owner, tokens, pixels
        self._lock = threading.Lock()
        self._held = True

    def release(self) -> None:
        with self._lock:
            held, self._held = self._held, False
        if held:
            self._allowance._give_back(self._owner, self._tokens, self._pixels)

    def release_when_done(self, jobs: list[SampleJob]) -> None:
        """Release once every one of `jobs` has ended (done, failed or cancelled), before its own callbacks."""
        running = set(range(len(jobs)))
        lock = threading.Lock()

        def ended(i: int) -> None:
            with lock:
                running.discard(i)  # a job may both finish and fail (its result failed to encode)
                last = not running
            if last:
                self.release()

        for i, job in enumerate(jobs):
            job.on_done = _mark_ended_then(ended, i, job.on_done)
            job.on_error = _mark_ended_then(ended, i, job.on_error)


def _mark_ended_then(ended, i: int, callback):
    def wrapped(arg):
        ended(i)
        callback(arg)

    return wrapped


class SamplingRequests:
    def __init__(self, server: Server, access: Access, images: ImagePixelBudget):
        """`images`: the per-key image pixel budget this service shares with `TrainingRequests`."""
        self.server = server
        self.config = server.config
        self.access = access
        self.allowance = SamplingAllowance(self.config.max_sampling_requests_per_key,
                                           self.config.max_sampled_tokens_per_key, images)

    def check_size(self, served: ServedModel, jobs: list[SampleJob]) -> None:
        """One request's own bounds (the prompt count and `n` are checked where they are parsed), and that
        each of its jobs fits `served`'s sampler at all (its KV-cache budget): else it would wait forever."""
        tokens = sum(requested_tokens(j) for j in jobs)
        limit = self.config.max_sampled_tokens_per_request
        if tokens > limit:
            raise UserError(f"this request asks for up to {tokens} sampled tokens (prompts x samples x "
                            f"max_tokens, plus prompt positions x prompt_alt_tokens_k); the limit is {limit} "
                            "(max_sampled_tokens_per_request): ask for fewer samples or fewer max_tokens "
                            "per request")
        self.allowance.images.check_size(total_pixels(j.pixels for j in jobs))
        for job in jobs:
            self._check_stops(job.stop_strings)
            reason = served.sampler.refusal(job)
            if reason is not None:
                raise UserError(reason)

    def _check_stops(self, stops: tuple[str, ...]) -> None:
        """Every generated token is checked against the stop strings: their number and length bound that work."""
        if len(stops) > self.config.max_stop_strings:
            raise UserError(f"this request has {len(stops)} stop strings; the limit is "
                            f"{self.config.max_stop_strings} (max_stop_strings)")
        size = sum(len(s.encode()) for s in stops)
        if size > self.config.max_stop_strings_bytes:
            raise UserError(f"this request's stop strings are {size} bytes together; the limit is "
                            f"{self.config.max_stop_strings_bytes} (max_stop_strings_bytes)")

    def open_session(self, owner: str, session_id: str, sampling_session_id: str, base_model: str | None,
                     model_path: str | None, checkpoint_dir: str | None) -> None:
        """A sampling session of a served base model, or of the checkpoint at model_path (access checked) on
        the base model it was trained on (`base_model`, if given too, must be that one)."""
        if checkpoint_dir is not None:
            trained_on = checkpoint_base_model(Path(checkpoint_dir), model_path)
            if base_model is not None and base_model != trained_on:
                raise UserError(f"checkpoint {model_path} was trained on base model {trained_on!r}, not "
                                f"{base_model!r}: it samples only on its own base model")
            base_model = trained_on
        served = served_model(self.server, base_model)
        self.server.store.sampling_sessions.create(sampling_session_id, session_id, owner, served.name,
                                                   model_path, checkpoint_dir)
        if checkpoint_dir is not None:
            served.sampler.session_opened(checkpoint_dir)

    def submit_for_future(self, owner: str, served: ServedModel, sampling_session_id: str, seq_id: int,
                          job: SampleJob,
                          record: Callable[[str], Callable[[SampleResult], None] | None] | None = None) -> str:
        """asample: queue `job` on `served`'s sampler under a new future (or find the one a retry already
        made); its request id.

        `record(request_id)` gives what stores the request's samples (records.py), or None."""
        job.owner = owner
        self.check_size(served, [job])
        lease = self._take(owner, served, [job])
        request_id, is_new = self.server.futures.create(owner, "sample", sampling_session_id, seq_id)
        if not is_new:  # a concurrent retry of the same seq_id got there first
            lease.release()
            return request_id
        lease.release_when_done([job])
        self.server.accounting.count_sample(job, owner, served.name, request_id, sampling_session_id)
        served.sampler.submit(request_id, job, record=None if record is None else record(request_id))
        return request_id

    def submit_jobs(self, owner: str, served: ServedModel, jobs: list[SampleJob]) -> None:
        """OpenAI: queue jobs on `served`'s sampler, their callbacks (on_done, on_error, on_token) set by the
        caller."""
        for job in jobs:
            job.owner = owner
        self.check_size(served, jobs)
        lease = self._take(owner, served, jobs)
        lease.release_when_done(jobs)
        for job in jobs:  # no session: usage goes to the key's owner alone
            self.server.accounting.count_sample(job, owner, served.name, request_id="")
        served.sampler.submit_jobs(jobs)

    def _take(self, owner: str, served: ServedModel, jobs: list[SampleJob]) -> Lease:
        """A lease on `jobs`' share of `owner`'s allowance, their images checked once it holds them (a
        request refused before decoded none; they are processed before the prefill); nothing is held
        if either refuses."""
        lease = self.allowance.take(owner, jobs)
        try:
            self.allowance.images.prepare(owner, served.images, [j.pixels for j in jobs if j.pixels is not None],
                                          served.loop.wake.set)
        except BaseException:
            lease.release()
            raise
        return lease
