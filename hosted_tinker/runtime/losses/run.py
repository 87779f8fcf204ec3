"""The trainer's side of the losses: per-token losses of a micro-batch laid out as runs of
rows, one run per request, each through its `Loss` entry's function, and their metrics."""

from __future__ import annotations

import torch

from .builtin import LOSSES


def per_token_loss(
    loss_fn: str, config: dict[str, float], target_logprobs: torch.Tensor, inputs: dict[str, torch.Tensor],
) -> torch.Tensor:
    """Per-token loss (= -objective) of one datum or a padded block of datums.

    `target_logprobs` and every input are shaped alike ([N] or [rows, T]); padded positions must
    carry zero weights/advantages so they contribute exactly 0.
    """
    return LOSSES[loss_fn].fn(target_logprobs, inputs, config).loss


def topk_cross_entropy(lp: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
    """cross_entropy with (N, K) targets: per position, -sum over its K targets of weight x logprob.
    `lp` and `weights` are [..., K]; returns [...]."""
    return -(lp * weights).sum(-1)
def merge_metrics(into: dict[str, float], new: dict[str, float]) -> None:
    """Add one micro-batch's metrics of a request to its totals: max for ':max', else a sum
    (':mean' values arrive already divided by the request's datum count)."""
    for key, value in new.items():
        if key not in into:
            into[key] = value
        elif key.endswith(":max"):
            into[key] = max(into[key], value)
        else:
            into[key] += value


def run_losses(
    runs: list[tuple[str, dict[str, float], int, int]], logprobs: torch.Tensor, inputs: dict[str, torch.Tensor],
    mask: torch.Tensor,
) -> tuple[torch.Tensor, list[dict[str, float]]]:
    """Per-token losses of a micro-batch laid out as runs of rows, one run per request.

    `runs` holds (loss_fn, config, row_start, row_end); `logprobs`, every input and `mask` are
    [rows, width] with zeros on padding. Returns the per-token loss ([rows, width], padding 0) and,
    per run, the extra metrics its loss reports (merged by the caller across micro-batches with
    `merge_metrics`; "loss:sum" is added by the caller from the returned per-token loss).

    Every loss works row by row, so consecutive runs with the same loss function and config are
    computed as one block (fewer ops with many tenants; the gradient of a sum is 1 for every
    token however the sum is grouped).
    """
    blocks: list[tuple[str, dict[str, float], int, int]] = []
    for loss_fn, config, s, e in runs:
        if blocks and blocks[-1][0] == loss_fn and blocks[-1][1] == config and blocks[-1][3] == s:
            blocks[-1] = (loss_fn, config, blocks[-1][2], e)
        else:
            blocks.append((loss_fn, config, s, e))
    parts, computed = [], []
    for fn, cfg, s, e in blocks:
        out = LOSSES[fn].fn(logprobs[s:e], {k: v[s:e] for k, v in inputs.items()}, cfg)
        parts.append(out.loss * mask[s:e])
        computed.append((s, e, out.row_metrics))
    tok_loss = parts[0] if len(parts) == 1 else torch.cat(parts)
    metrics = []
    for _, _, s, e in runs:
        bs, _, row_metrics = next(c for c in computed if c[0] <= s < c[1])  # the block holding the run
        metrics.append({key: float(values[s - bs:e - bs].max() if key.endswith(":max") else values[s - bs:e - bs].sum())
                        for key, values in row_metrics.items()})
    return tok_loss, metrics
