"""What the built-in engine answers from a prompt's logits, computed once at its prefill
(engine.py): the prompt tokens' logprobs and their top-k, `target_prompt_logprobs` and
`prompt_alt_tokens_k` (prompt_scoring.py). Row i of a prompt's logits predicts its token i + 1.
"""

from __future__ import annotations

from typing import NamedTuple

import numpy as np
import torch

from .jobs import SampleJob
from .pick import row_seed
from .prompt_scoring import alternatives_seed, draw_alternatives, score_targets


class PromptAnswers(NamedTuple):
    """What a sample result answers about its prompt, each None unless the job asked for it."""
    logprobs: np.ndarray | None = None  # [len(prompt)] float32, NaN where not scored
    topk_ids: np.ndarray | None = None  # [len(prompt), k]
    topk_logprobs: np.ndarray | None = None
    target_logprobs: object = None  # ScoredTargets (prompt_scoring.py)
    alternatives: object = None  # PromptAlternatives


def prompt_answers(job: SampleJob, logits: torch.Tensor) -> PromptAnswers:
    """All that `job` asks of its prompt's logits [len(prompt), vocab]."""
    lp = ids = vals = targets = alternatives = None
    if job.prompt_logprobs or job.topk_prompt_logprobs:
        lp, ids, vals = prompt_logprobs(job, logits)
    if job.prompt_targets is not None or job.prompt_alt_tokens_k:
        targets, alternatives = prompt_scores(job, logits)
    return PromptAnswers(lp, ids, vals, targets, alternatives)


def needs_prompt_logits(job: SampleJob) -> bool:
    return bool(job.prompt_logprobs or job.topk_prompt_logprobs or job.prompt_targets is not None
                or job.prompt_alt_tokens_k)


def prompt_scores(job: SampleJob, logits: torch.Tensor) -> tuple:
    """(target_prompt_logprobs, prompt_alt_tokens) of `job` from its prompt's logits [len(prompt), vocab]."""
    predicting = logits[:-1]  # row i predicts prompt[i + 1]; the last row predicts the first sample
    targets = alternatives = None
    if job.prompt_targets is not None:
        targets = score_targets(torch.log_softmax(predicting, dim=-1), job.prompt_targets)
    if job.prompt_alt_tokens_k:
        gen = torch.Generator(device="cpu")
        seed = alternatives_seed(job.seed)
        gen.manual_seed(row_seed(None, 0) if seed is None else seed)
        alternatives = draw_alternatives(predicting, job.prompt_alt_tokens_k, job.temperature, gen)
    return targets, alternatives


def prompt_logprobs(job: SampleJob, logits: torch.Tensor):
    """Per-position logprob of each prompt token given its prefix; NaN at 0 and outside last_n."""
    n = len(job.prompt)
    lps_all = torch.log_softmax(logits, dim=-1)  # [n, vocab]; row i predicts token i+1
    targets = torch.tensor(job.prompt[1:], device=logits.device)
    lp = np.full(n, np.nan, dtype=np.float32)
    if n > 1:
        lp[1:] = lps_all[:-1].gather(-1, targets[:, None])[:, 0].cpu().numpy()
    first_scored = 1 if job.prompt_logprobs_last_n is None else max(1, n - job.prompt_logprobs_last_n)
    lp[:first_scored] = np.nan
    ids = vals = None
    if job.topk_prompt_logprobs:
        k = job.topk_prompt_logprobs
        ids = np.zeros((n, k), dtype=np.int64)
        vals = np.full((n, k), -99999.0, dtype=np.float32)
        if n > 1:
            top = torch.topk(lps_all[:-1], k, dim=-1)
            ids[1:] = top.indices.cpu().numpy()
            vals[1:] = top.values.cpu().numpy()
        ids[:first_scored], vals[:first_scored] = 0, -99999.0
    return (lp if job.prompt_logprobs else None), ids, vals
