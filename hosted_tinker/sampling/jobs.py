"""A sample job and its answer: what the API side builds and every sampling backend runs.

Kept apart from the engines that run them (engine.py, vllm_backend.py), as vLLM keeps its requests
apart from its engine (`v1/request.py`): the API, the services and the KV-cache budget need the job,
not the machinery that decodes it.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Callable

import numpy as np

from ..models.vision import Pixels
from .prompt_scoring import PromptAlternatives, PromptTargets, ScoredTargets


class UserFailure(str):
    """An `on_error` message for a failure the job's own request caused (a `UserError` raised while it
    ran): its future fails with category "user" and the OpenAI routes answer 400, where any other
    message is the server's fault."""


@dataclass
class SampleJob:
    prompt: list[int]
    num_samples: int
    max_tokens: int
    adapter_id: str | None  # None = base model
    temperature: float = 1.0
    top_k: int = -1
    top_p: float = 1.0
    seed: int | None = None
    stop_token_ids: frozenset[int] = frozenset()
    stop_strings: tuple[str, ...] = ()
    prompt_logprobs: bool = False
    topk_prompt_logprobs: int = 0
    topk_sample_logprobs: int = 0
    prompt_logprobs_last_n: int | None = None
    prompt_targets: PromptTargets | None = None  # target_prompt_logprobs (prompt_scoring.py)
    prompt_alt_tokens_k: int = 0
    pixels: Pixels | None = None  # a vision-language model's images; their placeholder tokens are in `prompt`
    owner: str = ""  # the API key's owner: its running jobs share one part of the KV-cache budget
    on_done: Callable[["SampleResult"], None] = lambda r: None
    on_error: Callable[[str], None] = lambda msg: None
    # Streaming (optional): called on the cycle thread for every chosen token, before on_done, as
    # on_token(index, token, logprob, topk_ids | None, topk_logprobs | None, stop_reason | None);
    # stop_reason is set on a sequence's last token. None (the default) costs one check per token.
    on_token: Callable[[int, int, float, list[int] | None, list[float] | None, str | None], None] | None = None
    # Set from any thread when nobody waits for the result any more (its HTTP client left): the
    # engine drops the job at admission or before its next decode step, with its KV cache, and
    # calls on_error once.
    cancelled: bool = False
    # What its backend has computed of it so far, kept current as it runs (on the backend's thread):
    # a job that ends unfinished (cancelled, failed) is charged for these (accounting.py).
    prefilled_tokens: int = 0  # prompt tokens prefilled
    generated_tokens: int = 0  # tokens generated, over all its samples
    # Requests a backend sends for the job beyond its own prompt and samples (vLLM: one per prompt row
    # scored, vllm_backend.py), as it reports each one answered: charged on top, done or not.
    scoring_prefilled_tokens: int = 0  # prompt tokens computed
    scoring_cached_tokens: int = 0  # prompt tokens served from the backend's prefix cache
    scoring_generated_tokens: int = 0
    # For the time-to-first-token and tokens-per-second metrics (perf_counter seconds).
    submitted_at: float = field(default_factory=time.perf_counter)
    first_token_at: float | None = None


@dataclass
class SequenceResult:
    tokens: list[int]
    logprobs: list[float]
    stop_reason: str  # "stop" | "length"
    topk_ids: list[list[int]] | None = None
    topk_logprobs: list[list[float]] | None = None


@dataclass
class SequenceSoFar:
    """A sequence while it is generated (the engine) or arrives (vLLM, whole or streamed): its
    tokens with their logprobs and top-k, and why it stopped (None while it goes on)."""

    tokens: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    topk_ids: list[list[int]] = field(default_factory=list)
    topk_logprobs: list[list[float]] = field(default_factory=list)
    stop_reason: str | None = None

    def result(self, with_topk: bool) -> SequenceResult:
        return SequenceResult(tokens=self.tokens, logprobs=self.logprobs, stop_reason=self.stop_reason or "length",
                              topk_ids=self.topk_ids if with_topk else None,
                              topk_logprobs=self.topk_logprobs if with_topk else None)


@dataclass
class SampleResult:
    sequences: list[SequenceResult]
    prompt_logprobs: np.ndarray | None  # float32 [len(prompt)], NaN at 0 and at unscored positions
    topk_prompt_ids: np.ndarray | None  # int [len(prompt), k]
    topk_prompt_logprobs: np.ndarray | None
    target_prompt_logprobs: ScoredTargets | None = None
    prompt_alt_tokens: PromptAlternatives | None = None
