"""A fused pass's inputs and outputs on the host (runtime/trainer.py runs it).

`host_inputs` builds one micro-batch's padded input tensors from its requests (in numpy: no
tensor op per datum); a launched pass (`PendingPass`) hands every datum its outputs once the
runtime's one wait for the device has made them readable (the outputs were queued to host
memory as each micro-batch was launched: host_copies.to_host), with the pass's `PassStats`.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from collections.abc import Callable

import numpy as np
import torch

from ..requests.kinds import FBOutcome, FBWork
from .adapters import GradientPass
from .host_copies import Launched
from .losses import LOSSES
from .packing import MicroBatch


@dataclass
class PassStats:
    """What one fused pass did, for metrics and benchmarks. `models` is known when the pass starts,
    the rest is counted as it runs."""

    models: int
    datums: int = 0
    tokens: int = 0
    padded_tokens: int = 0
    micro_batches: int = 0
    seconds: float = 0.0


def host_inputs(mb: MicroBatch, works: list[FBWork], *, pin: bool, pixel_dtype: torch.dtype
                ) -> tuple[dict[str, torch.Tensor], tuple[str, ...]]:
    """The micro-batch's padded inputs as host tensors (pinned on CUDA): "tokens" [2, rows,
    width] (ids, targets) and "floats" [1 + k, rows, width] (mask, then the k loss inputs its
    losses read, whose names are returned); with rows of (N, K) targets, also those targets
    and weights, "topk_targets" and "topk_weights" [rows, width, largest K] (their rows' targets
    and weights in the first two are 0). Built in numpy: no tensor op per datum."""
    specs = {works[wi].loss_fn for wi, _, _ in mb.runs}
    keys = tuple(sorted({k for fn in specs for k in (*LOSSES[fn].required_inputs, *LOSSES[fn].inputs)}
                        - {"target_tokens"}))
    rows, width = len(mb.rows), mb.width
    k_max = max(works[wi].targets_k for wi, _, _ in mb.runs)
    host = {"tokens": torch.zeros((2, rows, width), dtype=torch.long, pin_memory=pin),
            "floats": torch.zeros((1 + len(keys), rows, width), dtype=torch.float32, pin_memory=pin)}
    if k_max:
        host["topk_targets"] = torch.zeros((rows, width, k_max), dtype=torch.long, pin_memory=pin)
        host["topk_weights"] = torch.zeros((rows, width, k_max), dtype=torch.float32, pin_memory=pin)
    tok, flo = host["tokens"].numpy(), host["floats"].numpy()
    top_t, top_w = (host[key].numpy() if k_max else None for key in ("topk_targets", "topk_weights"))
    for r, (wi, di) in enumerate(mb.rows):
        d = works[wi].data[di]
        n = mb.lengths[r]
        tok[0, r, :n] = d.tokens
        flo[0, r, :n] = 1.0
        k = works[wi].targets_k
        if k:
            top_t[r, :n, :k] = d.inputs["target_tokens"]
            top_w[r, :n, :k] = d.inputs["weights"]
            continue
        tok[1, r, :n] = d.inputs["target_tokens"]
        for i, key in enumerate(keys):
            if key in d.inputs:
                flo[1 + i, r, :n] = d.inputs[key]
    pixels = [works[wi].data[di].pixels for wi, di in mb.rows if works[wi].data[di].pixels is not None]
    if pixels:  # in row order: the model fills its image tokens in that order
        host["pixel_values"] = torch.cat([p.pixel_values for p in pixels]).to(pixel_dtype)
        host["image_grid_thw"] = torch.cat([p.grid_thw for p in pixels])
    return host, keys


@dataclass
class PendingPass:
    """A launched fused pass: its micro-batches' outputs arrive in host memory by the runtime's
    next `wait()`."""

    on_done: Callable[[PassStats], None]  # hears the pass's stats (the runtime keeps its last pass's)
    works: list[FBWork]
    launched: list[Launched]
    metric_sums: list[dict[str, float]]
    stats: PassStats
    start: float
    # The trained adapters' gradients as they were before the pass: a request of it that fails
    # later in its cycle has its model's put back (compute_requests.py, request_parts.py).
    before: GradientPass | None = None

    def outcomes(self) -> list[FBOutcome]:
        """Hand every datum its outputs (after the wait), and the pass's stats to `on_done`."""
        works, stats, metric_sums = self.works, self.stats, self.metric_sums
        per_datum: dict[tuple[int, int], dict[str, np.ndarray]] = {}
        for item in self.launched:
            mb = item.mb
            lp_cpu, el_cpu = item.logprobs.numpy(), item.losses.numpy()
            topk_cpu = item.topk.numpy() if item.topk is not None else None
            for r, (wi, di) in enumerate(mb.rows):
                n, k = mb.lengths[r], works[wi].targets_k
                per_datum[(wi, di)] = {
                    "logprobs": (topk_cpu[r, :n, :k] if k else lp_cpu[r, :n]).astype(np.float32, copy=True),
                    "elementwise_loss": el_cpu[r, :n].astype(np.float32, copy=True),
                }
                metric_sums[wi]["loss:sum"] += float(el_cpu[r, :n].astype(np.float64).sum())
            stats.micro_batches += 1
            stats.tokens += mb.tokens
            stats.padded_tokens += mb.padded_tokens
        outcomes = []
        for wi, work in enumerate(works):
            outcomes.append(FBOutcome(outputs=[per_datum[(wi, di)] for di in range(len(work.data))],
                                      metrics=metric_sums[wi]))
            stats.datums += len(work.data)
        stats.seconds = time.perf_counter() - self.start
        self.on_done(stats)
        return outcomes


@dataclass
class ReadyPass:
    """A pass that ran to its end when it was launched (a worker pool's: its ranks' collectives wait
    for one another), read like a `PendingPass`."""

    ready: list[FBOutcome]
    stats: PassStats
    before: GradientPass | None = None  # as `PendingPass.before`

    def outcomes(self) -> list[FBOutcome]:
        return self.ready
