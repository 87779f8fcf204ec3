"""The next token of every row of a decode batch, picked in one go on the device.

Temperature, top-k, top-p and greedy apply to all rows at once as tensor ops; the chosen tokens,
their logprobs, whether each row's logits were finite, and the top-k logprobs asked for come back
to the host in ONE small device->host copy per step (`BatchPicker.pick`). Nothing of size vocab
crosses to the host.

Sampling is inverse-CDF: a row's token is the first whose cumulative probability (of the
tempered, top-k and top-p masked distribution) exceeds u * total, with one uniform u per row and
step. That is exact categorical sampling (a token's chance is the width of its CDF interval, and
masked tokens have width 0), and it needs one random number per row instead of one per vocabulary
entry.

`u` comes from a counter-based generator, not a shared stateful one: it is a function of the row's
key (its job's seed and its sample index; random when unseeded) and the step alone, the splitmix64
finalizer over (key + (step + 1) * golden ratio), computed with int64 tensor ops. So a seeded
request draws the same numbers whatever else is in the batch and whatever the batch size.

Returned logprobs are the model's own: log-softmax of the raw logits, whatever the temperature,
top-k or top-p, so they equal the training forward's.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch

GOLDEN = 0x9E3779B97F4A7C15  # splitmix64's increment: 2^64 / golden ratio, odd


def _int64(c: int) -> int:
    """The int64 with the same 64 bits as the unsigned `c` (tensor ops wrap modulo 2^64)."""
    c &= (1 << 64) - 1
    return c - (1 << 64) if c >= 1 << 63 else c


def _shift_right(z: torch.Tensor, s: int) -> torch.Tensor:
    """Logical right shift of int64 bits (`>>` on int64 is arithmetic: it copies the sign bit)."""
    return (z >> s) & ((1 << (64 - s)) - 1)


def mix64(z: torch.Tensor) -> torch.Tensor:
    """splitmix64's finalizer, elementwise over int64 tensors (bit for bit the unsigned version's)."""
    z = (z ^ _shift_right(z, 30)) * _int64(0xBF58476D1CE4E5B9)
    z = (z ^ _shift_right(z, 27)) * _int64(0x94D049BB133111EB)
    return z ^ _shift_right(z, 31)


def uniforms(keys: torch.Tensor, step: int | torch.Tensor) -> torch.Tensor:
    """One float64 uniform in [0, 1) per row: draw number `step` (one for all rows, or one per row)
    of each row's stream `keys`."""
    offset = (step + 1) * _int64(GOLDEN) if isinstance(step, torch.Tensor) else _int64((step + 1) * GOLDEN)
    z = mix64(keys + offset)
    return _shift_right(z, 11).double() * 2.0 ** -53  # the top 53 bits: every float64 step of [0, 1)


@dataclass(frozen=True)
class RowSampling:
    """How one row picks its tokens (from its job's SamplingParams)."""

    temperature: float  # <= 0: greedy
    top_k: int  # <= 0 or >= vocab: no top-k
    top_p: float  # >= 1: no top-p
    key: int  # 63-bit noise stream: from the job's seed and the row's sample index, random when unseeded
    logprobs_k: int  # top-k logprobs to return per token (0: none)


@dataclass
class Picked:
    """One row's pick, read back on the host."""

    token: int
    logprob: float
    finite: bool  # False: the logits held NaN or inf; token and logprobs mean nothing
    topk_ids: list[int]  # logprobs_k of them
    topk_logprobs: list[float]


class BatchPicker:
    """Per-row settings as device tensors, made once for a group's rows (again when rows leave)."""

    def __init__(self, rows: list[RowSampling], device: torch.device):
        self.logprobs_k = [r.logprobs_k for r in rows]
        self.all_greedy = all(r.temperature <= 0 for r in rows)
        self.any_greedy = any(r.temperature <= 0 for r in rows)
        self.top_ks = [r.top_k if r.temperature > 0 else 0 for r in rows]
        self.any_top_p = any(r.temperature > 0 and r.top_p < 1 for r in rows)
        self.greedy = torch.tensor([r.temperature <= 0 for r in rows], device=device)
        # Greedy rows never use their temperature: 1 keeps their (discarded) sampling finite.
        self.temperature = torch.tensor([r.temperature if r.temperature > 0 else 1.0 for r in rows],
                                        dtype=torch.float32, device=device)
        self.top_k = torch.tensor([r.top_k for r in rows], device=device)
        self.top_p = torch.tensor([r.top_p if r.top_p < 1 else torch.inf for r in rows], dtype=torch.float32,
                                  device=device)
        self.keys = mix64(torch.tensor([r.key for r in rows], dtype=torch.int64, device=device))

    def pick(self, logits: torch.Tensor, step: int | torch.Tensor) -> tuple[torch.Tensor, list[Picked]]:
        """Each row's token from its float32 `logits` [rows, vocab], at its stream's draw `step`
        (one for every row, or an int64 tensor of one per row: the tokens it has so far): the
        tokens (on the device) and every row's pick, read back in one copy."""
        vocab = logits.shape[-1]
        k = min(max(self.logprobs_k, default=0), vocab)
        logprobs = torch.log_softmax(logits, dim=-1)
        largest = logits.amax(dim=-1, keepdim=True)
        # amax and amin propagate NaN: both are finite exactly when every logit is.
        finite = torch.isfinite(largest) & torch.isfinite(logits.amin(dim=-1, keepdim=True))
        if self.all_greedy:
            tokens = torch.argmax(logits, dim=-1)
        else:
            tokens = self._sample(logits, largest, step)
            if self.any_greedy:
                tokens = torch.where(self.greedy, torch.argmax(logits, dim=-1), tokens)
        parts = [tokens[:, None].double(), logprobs.gather(1, tokens[:, None]).double(), finite.double()]
        if k:
            top = torch.topk(logprobs, k, dim=-1)
            parts += [top.indices.double(), top.values.double()]
        packed = torch.cat(parts, dim=1)  # token ids < 2^53: exact
        rows = packed.tolist()  # the step's one device->host read
        return tokens, [Picked(int(row[0]), row[1], row[2] == 1.0, [int(t) for t in row[3:3 + n]],
                               row[3 + k:3 + k + n]) for row, n in zip(rows, self.logprobs_k)]

    def _sample(self, logits: torch.Tensor, largest: torch.Tensor, step: int | torch.Tensor) -> torch.Tensor:
        # Relative to the row's max (`largest`), a tiny temperature sends the others to -inf, never
        # the max to inf: float32 keeps the tempered distribution finite.
        scaled = torch.sub(logits, largest).div_(self.temperature[:, None])
        vocab = logits.shape[-1]
        kmax = max((k for k in self.top_ks if k < vocab), default=0)
        if kmax > 0:
            scaled = self._top_k(scaled, kmax, vocab)
        if self.any_top_p:
            scaled = self._top_p(scaled)
        # Unnormalized (the max is exp(0) = 1), summed in float64 so that no token's interval,
        # however small, is lost to rounding against the running sum.
        cdf = scaled.exp_().double().cumsum_(dim=-1)
        target = uniforms(self.keys, step) * cdf[:, -1]
        # The first token whose CDF exceeds the target: it has non-zero probability.
        return torch.searchsorted(cdf, target[:, None], right=True)[:, 0].clamp_(max=vocab - 1)

    def _top_k(self, scaled: torch.Tensor, kmax: int, vocab: int) -> torch.Tensor:
        """Keep each row's top_k largest (and ties with its k-th); rows without top-k keep all.
        `kmax`: the largest top_k below `vocab`."""
        uses = (self.top_k > 0) & (self.top_k < vocab)
        kth = torch.topk(scaled, kmax, dim=-1).values.gather(1, (self.top_k.clamp(1, kmax) - 1)[:, None])
        kth = kth.masked_fill(~uses[:, None], -torch.inf)
        return scaled.masked_fill(scaled < kth, -torch.inf)

    def _top_p(self, scaled: torch.Tensor) -> torch.Tensor:
        """Keep each row's smallest most-likely prefix whose mass reaches top_p (at least one token)."""
        ordered, order = torch.sort(scaled, dim=-1, descending=True, stable=True)
        probs = torch.softmax(ordered, dim=-1)
        drop = (probs.cumsum(dim=-1) - probs) >= self.top_p[:, None]
        return torch.full_like(scaled, -torch.inf).scatter(1, order, ordered.masked_fill(drop, -torch.inf))


def row_seed(seed: int | None, index: int) -> int:
    """The key of sample `index` of a job with `seed` (None: a random one)."""
    if seed is None:
        return int.from_bytes(os.urandom(8), "little") & ((1 << 63) - 1)
    # Same seed, same samples; each of num_samples gets its own stream.
    return (int(seed) * 1_000_003 + index) & ((1 << 63) - 1)
