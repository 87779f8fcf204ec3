"""Prompt scoring beyond `prompt_logprobs`, as SDK 0.38 lays it out (`tinker/types/sample_request.py`):

- `target_prompt_logprobs`: the logprobs of chosen tokens at chosen prompt positions, asked for as
  an int64 `[len(prompt) - 1, K]` tensor (dense, or sparse CSR listing only the cells asked for;
  -1 = nothing asked) and answered as a float32 tensor of the same shape and layout, 0.0 where
  nothing was asked;
- `prompt_alt_tokens_k`: K independent draws, with replacement and at the request's temperature
  (no top-k or top-p: the SDK documents the temperature only), from the next-token distribution at
  every prompt position after the first, with the model's logprob of each.

Row i of either is about prompt position i + 1: the distribution over `prompt[i + 1]` given
`prompt[:i + 1]`. Logprobs are the model's own (log-softmax of the raw logits), like every other
logprob the samplers return.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

MAX_PROMPT_K = 100  # K of target_prompt_logprobs and prompt_alt_tokens_k, as topk_prompt_logprobs


@dataclass(frozen=True)
class CsrLayout:
    """Which cells of a 2-D tensor a sparse CSR one lists: `crow` [rows + 1] and `col` [nnz], int64."""

    crow: np.ndarray
    col: np.ndarray

    def cells(self) -> tuple[np.ndarray, np.ndarray]:
        """(row, col) of every listed cell, in CSR order."""
        rows = np.repeat(np.arange(self.crow.size - 1), np.diff(self.crow))
        return rows, self.col


@dataclass(frozen=True)
class PromptTargets:
    """A request's `target_prompt_logprobs`: `ids` int64 [len(prompt) - 1, K], -1 where nothing is
    asked; `layout` the sparse cells it listed (None: it was dense), for the answer to match."""

    ids: np.ndarray
    layout: CsrLayout | None = None

    def requested_rows(self) -> list[int]:
        return np.flatnonzero((self.ids >= 0).any(axis=1)).tolist()


@dataclass(frozen=True)
class ScoredTargets:
    """The answer to `target_prompt_logprobs`: float32 [len(prompt) - 1, K], 0.0 where nothing was
    asked, sent in `layout` (None: dense)."""

    logprobs: np.ndarray
    layout: CsrLayout | None = None


@dataclass(frozen=True)
class PromptAlternatives:
    """The answer to `prompt_alt_tokens_k`: `tokens` int64 and `logprobs` float32, both [len(prompt) - 1, k]."""

    tokens: np.ndarray
    logprobs: np.ndarray


def score_targets(logprobs: torch.Tensor, targets: PromptTargets) -> ScoredTargets:
    """`logprobs`: [len(prompt) - 1, vocab], row i the log-softmax predicting prompt[i + 1]."""
    ids = torch.as_tensor(targets.ids, device=logprobs.device)
    picked = logprobs.gather(-1, ids.clamp(min=0)).masked_fill(ids < 0, 0.0)
    return ScoredTargets(picked.float().cpu().numpy(), targets.layout)


def draw_alternatives(logits: torch.Tensor, k: int, temperature: float,
                      generator: torch.Generator) -> PromptAlternatives:
    """`k` draws per row of `logits` ([len(prompt) - 1, vocab], raw) at `temperature`; 0 = the argmax."""
    logprobs = torch.log_softmax(logits.float(), dim=-1)
    if temperature <= 0.0:
        tokens = logits.argmax(dim=-1, keepdim=True).expand(-1, k)
    else:
        # float64, as the engine's own pick: a tiny temperature sharpens, never overflows
        probs = torch.softmax(logits.double() / temperature, dim=-1).cpu()
        tokens = torch.multinomial(probs, k, replacement=True, generator=generator).to(logits.device)
    return PromptAlternatives(tokens.cpu().numpy().astype(np.int64),
                              logprobs.gather(-1, tokens).cpu().numpy().astype(np.float32))


def alternatives_seed(seed: int | None) -> int | None:
    """The seed of a request's prompt draws, apart from its samples' streams (None: unseeded)."""
    if seed is None:
        return None
    return (int(seed) * 1_000_003 + (1 << 40)) & ((1 << 63) - 1)
