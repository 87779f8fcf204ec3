"""One forward of the built-in engine's model over the paged KV cache (kv_cache.py): a prefill chunk
or a decode step, its inputs built on the host, its masks on the device.

A forward's rows are left-padded to its longest (every row ends at the last column, whose logits
are the next token's); each token's place in the pool and each row's pages are a `StepIndex`, and
the attention masks come from each query's position: key j is seen by a query at position p when
j <= p (and j > p - window on a sliding-window layer). The masks are additive, in the model's
dtype, per kind of layer where the model mixes kinds (`AttentionMasks`).

A decode step's rows are laid out in blocks, one per adapter, each padded to the largest block
(`decode_layout`), so the LoRA deltas of every adapter in the step run as one grouped call per
projection (runtime/lora_plan.py groups equal blocks of one rank and scaling; padding rows read
the zero page, write the trash page and are never picked). On CUDA the blocks, the row count and
the width round up to fixed buckets, and each layout is a CUDA graph, captured the first time
(runtime/graphs.py's `StepGraphs`: static input buffers, one memory pool): a step is then a few
host-to-device copies and one replay. Elsewhere the same step runs eagerly on exact sizes.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Hashable
from dataclasses import dataclass

import numpy as np
import torch

from ..runtime.lora_plan import LoRARouting
from ..runtime.packing import segments_of
from .kv_cache import PAGE_TOKENS, TRASH_PAGE, ZERO_PAGE, KVPool, PagedCache, Seq, StepIndex

log = logging.getLogger(__name__)


class AttentionMasks:
    """The model's `attention_mask` argument from each query's position: one additive 4-D mask, or
    one per kind of layer where the model mixes kinds (full, sliding-window, linear attention)."""

    KINDS = ("full_attention", "sliding_attention", "linear_attention")

    def __init__(self, config):
        text = config.get_text_config() if hasattr(config, "get_text_config") else config
        kinds = set(getattr(text, "layer_types", None) or ["full_attention"])
        unknown = kinds - set(self.KINDS)
        if unknown:
            raise ValueError(f"the built-in sampler cannot mask layers of kind {sorted(unknown)}")
        self.window = getattr(text, "sliding_window", None)
        self.by_kind = len(kinds) > 1 or kinds != {"full_attention"}
        if not self.by_kind and getattr(text, "use_sliding_window", True) is False:
            self.window = None  # a config that names a window but does not use it
        self.kinds = kinds

    def __call__(self, query_positions: torch.Tensor, width: int, dtype: torch.dtype):
        """`query_positions` [rows, tokens]: each query's position in its row (padding: 0)."""
        keys = torch.arange(width, device=query_positions.device)
        q = query_positions[:, None, :, None]
        floor = torch.finfo(dtype).min

        def additive(hidden: torch.Tensor) -> torch.Tensor:  # 0 where seen, the dtype's floor where not
            return hidden.to(dtype).mul_(floor)  # 0 * floor is -0.0: adds nothing to a score

        if not self.by_kind:
            hidden = keys > q
            if self.window is not None:
                hidden |= keys <= q - self.window
            return additive(hidden)
        masks = {}
        if "full_attention" in self.kinds:
            masks["full_attention"] = additive(keys > q)
        if "sliding_attention" in self.kinds:
            masks["sliding_attention"] = additive((keys > q) | (keys <= q - self.window))
        if "linear_attention" in self.kinds:
            masks["linear_attention"] = None  # its rows are never padded (engine.py prefills them alone)
        return masks


@dataclass
class ForwardRow:
    """One row of a forward: its sequence, the tokens it adds, their positions."""

    seq: Seq | None  # None: a padding row
    tokens: list[int]
    start: int  # the first new token's place in the sequence
    rope_delta: int = 0  # a vision-language row's rotary offset (image_positions.py)


def forward_inputs(rows: list[ForwardRow], width: int, *, rope: bool) -> dict[str, torch.Tensor]:
    """The host tensors of one forward over `rows` (left-padded), reading `width` positions."""
    n, q = len(rows), max(len(r.tokens) for r in rows)
    ids = np.zeros((n, q), dtype=np.int64)
    positions = np.zeros((n, q), dtype=np.int64)
    write = np.full((n, q), TRASH_PAGE * PAGE_TOKENS, dtype=np.int64)
    pages = np.full((n, -(-width // PAGE_TOKENS)), ZERO_PAGE, dtype=np.int64)
    slots = np.zeros(n, dtype=np.int64)
    deltas = np.zeros(n, dtype=np.int64)
    for r, row in enumerate(rows):
        k = len(row.tokens)
        ids[r, q - k:] = row.tokens
        if row.seq is None:
            continue
        table = row.seq.pages
        if k == 1:  # a decode step's row: plain ints are faster than arrays
            positions[r, -1] = row.start
            write[r, -1] = table[row.start // PAGE_TOKENS] * PAGE_TOKENS + row.start % PAGE_TOKENS
        else:
            at = np.arange(row.start, row.start + k)
            positions[r, q - k:] = at
            write[r, q - k:] = np.asarray(table, dtype=np.int64)[at // PAGE_TOKENS] * PAGE_TOKENS + at % PAGE_TOKENS
        read = min(len(table), pages.shape[1])
        pages[r, :read] = table[:read]
        slots[r] = row.seq.slot
        deltas[r] = row.rope_delta
    position_ids = torch.from_numpy(positions)
    if rope:  # Qwen-VL's [4, rows, tokens]: the text position (what masks read), then the three rotary axes
        rotary = torch.from_numpy(positions + deltas[:, None])
        position_ids = torch.cat([position_ids[None], rotary[None].expand(3, -1, -1)])
    return {"input_ids": torch.from_numpy(ids), "position_ids": position_ids,
            "query_positions": torch.from_numpy(positions), "write": torch.from_numpy(write.reshape(-1)),
            "pages": torch.from_numpy(pages), "slots": torch.from_numpy(slots)}


def run_forward(model: torch.nn.Module, pool: KVPool, masks: AttentionMasks, inputs: dict[str, torch.Tensor],
                width: int, *, continues: bool, logits_to_keep: int = 1, **extra) -> torch.Tensor:
    """The model's logits over `inputs` (device tensors of `forward_inputs` with that `width`), its
    keys written to the pool; `extra`: an image prefill's pixels and grids (and its position ids,
    which replace these)."""
    index = StepIndex(write=inputs["write"], pages=inputs["pages"], slots=inputs["slots"], width=width,
                      continues=continues)
    cache = PagedCache(pool, index)
    dtype = next(model.parameters()).dtype
    mask = masks(inputs["query_positions"], width, dtype)
    kwargs = {"position_ids": inputs["position_ids"], **extra}
    out = model(input_ids=inputs["input_ids"], attention_mask=mask, cache=cache, use_cache=True,
                logits_to_keep=logits_to_keep, **kwargs)
    cache.finish()
    return out.logits


# -- decode steps ---------------------------------------------------------------------------------------
@dataclass(frozen=True)
class DecodeLayout:
    """Where each running row sits in a decode step: blocks of equal size, one per adapter (padding
    rows: None), then the rows without an adapter; and the width every row reads."""

    rows: list  # [batch position] -> the engine's row, or None
    segments: tuple[tuple[str | None, int, int], ...]  # the LoRA routing (runtime/lora_plan.py)
    width: int

    def key(self, routing: LoRARouting, pool: KVPool) -> Hashable:
        """What a captured step depends on: the layout, the width, where the adapters' slots and the
        pool's pages are."""
        return (self.segments, self.width, routing.storage_version, routing.slot_version, pool.storage_version)


def bucket(n: int, sizes: tuple[int, ...]) -> int:
    """The smallest of `sizes` that holds n, or n rounded up to a multiple of the largest."""
    for size in sizes:
        if n <= size:
            return size
    return -(-n // sizes[-1]) * sizes[-1]


ROW_BUCKETS = (1, 2, 4, 8, 16, 24, 32, 48, 64, 96, 128)  # decode blocks and batches on CUDA
WIDTH_BUCKETS = tuple(PAGE_TOKENS * 2 ** i for i in range(13))  # 16 ... 65536 keys


def place_rows(rows: list, adapter_of: Callable, *, buckets: bool) -> tuple[list, tuple]:
    """`rows` in blocks per adapter (sorted by id), each padded to the largest (rounded up to a
    bucket where `buckets`), then the rows without an adapter (their count rounded up likewise):
    (batch position -> row or None, the LoRA routing's segments)."""
    by_adapter: dict[str | None, list] = {}
    for row in rows:
        by_adapter.setdefault(adapter_of(row), []).append(row)
    adapters = sorted(a for a in by_adapter if a is not None)
    block = max((len(by_adapter[a]) for a in adapters), default=0)
    if buckets and block:
        block = bucket(block, ROW_BUCKETS)
    laid: list = []
    ids: list[str | None] = []
    for a in adapters:
        members = by_adapter[a]
        laid += members + [None] * (block - len(members))
        ids += [a] * block
    base = by_adapter.get(None, [])
    pad = (bucket(len(base), ROW_BUCKETS) - len(base)) if buckets and base else 0
    laid += base + [None] * pad
    ids += [None] * (len(base) + pad)
    return laid, tuple(segments_of(ids))


class DecodeBatch:
    """A decode step's rows in place (`place_rows`) and its host inputs. While the same rows run,
    they are kept from one step to the next: a step moves every row on by one token with a few
    numpy operations, whatever the rows (each row's pages are added to the kept tables as it gets
    them). Another set of rows is laid out anew."""

    def __init__(self, *, buckets: bool, rope: bool):
        self.buckets, self.rope = buckets, rope
        self._key: tuple = ()

    def __call__(self, rows: list) -> tuple[DecodeLayout, dict[str, torch.Tensor]]:
        key = tuple((row, row.seq) for row in rows)  # compared by identity: a resumed row has a new Seq
        if key != self._key:
            self._lay_out(rows)
            self._key = key
        live = self._live
        lengths = np.fromiter((row.seq.length for row in live), dtype=np.int64, count=len(live))
        for i, row in enumerate(live):  # pages a row got since the last step
            held = self._held[i]
            if len(row.seq.pages) > held:
                self._add_pages(i, row.seq.pages[held:])
        longest = int(lengths.max()) + 1  # the new token's key too
        width = bucket(longest, WIDTH_BUCKETS) if self.buckets else longest
        n = len(self._placed)
        ids = np.zeros((n, 1), dtype=np.int64)
        ids[self._at, 0] = [row.tokens[-1] for row in live]
        positions = np.zeros((n, 1), dtype=np.int64)
        positions[self._at, 0] = lengths
        write = np.full(n, TRASH_PAGE * PAGE_TOKENS, dtype=np.int64)
        write[self._at] = self._tables[self._at, lengths // PAGE_TOKENS] * PAGE_TOKENS + lengths % PAGE_TOKENS
        pages = np.ascontiguousarray(self._tables[:, :-(-width // PAGE_TOKENS)])
        position_ids = torch.from_numpy(positions)
        if self.rope:  # Qwen-VL's [4, rows, 1]: the text position, then the three rotary axes
            rotary = torch.from_numpy(positions + self._deltas[:, None])
            position_ids = torch.cat([position_ids[None], rotary[None].expand(3, -1, -1)])
        host = {"input_ids": torch.from_numpy(ids), "position_ids": position_ids,
                "query_positions": torch.from_numpy(positions), "write": torch.from_numpy(write),
                "pages": torch.from_numpy(pages), "slots": self._slots}
        return DecodeLayout(rows=self._placed, segments=self._segments, width=width), host

    def _lay_out(self, rows: list) -> None:
        self._placed, self._segments = place_rows(rows, lambda row: row.adapter_id, buckets=self.buckets)
        self._at = np.asarray([i for i, row in enumerate(self._placed) if row is not None], dtype=np.int64)
        self._live = [row for row in self._placed if row is not None]
        self._tables = np.full((len(self._placed), 8), ZERO_PAGE, dtype=np.int64)
        self._held = [0] * len(self._live)
        for i, row in enumerate(self._live):
            self._add_pages(i, row.seq.pages)
        slots = np.zeros(len(self._placed), dtype=np.int64)
        slots[self._at] = [row.seq.slot for row in self._live]
        self._slots = torch.from_numpy(slots)
        self._deltas = np.zeros(len(self._placed), dtype=np.int64)
        self._deltas[self._at] = [row.job.rope_delta for row in self._live]

    def _add_pages(self, i: int, pages: list[int]) -> None:
        held = self._held[i]
        end = held + len(pages)
        if end > self._tables.shape[1]:  # wider tables (doubling): a long row
            wider = np.full((self._tables.shape[0], max(end, 2 * self._tables.shape[1])), ZERO_PAGE, dtype=np.int64)
            wider[:, :self._tables.shape[1]] = self._tables
            self._tables = wider
        self._tables[self._at[i], held:end] = pages
        self._held[i] = end


class DecodeStep:
    """Runs decode steps: eagerly, or as CUDA graphs of their layouts (`graphs`, on CUDA)."""

    def __init__(self, model: torch.nn.Module, routing: LoRARouting, pool: KVPool, masks: AttentionMasks,
                 graphs=None):
        self.model, self.routing, self.pool, self.masks = model, routing, pool, masks
        self.graphs = graphs  # runtime/graphs.py StepGraphs, or None: eager

    def __call__(self, layout: DecodeLayout, host: dict[str, torch.Tensor]) -> torch.Tensor:
        """[batch, vocab] logits of the step (a graph's static output: read before the next step)."""
        segments = list(layout.segments)

        def step(inputs: dict[str, torch.Tensor]) -> tuple[torch.Tensor]:
            with self.routing.batch(segments, exact=False):
                logits = run_forward(self.model, self.pool, self.masks, inputs, layout.width, continues=True)
            return (logits[:, -1],)

        if self.graphs is not None:
            outputs = self.graphs.run(layout.key(self.routing, self.pool), host, step, put_back=self._put_back(host),
                                      keep=lambda: self.routing.last_plans)
            if outputs is not None:
                return outputs[0]
            # A model whose decode step cannot be captured (an MoE router reads the host) fails at
            # every layout: it decodes eagerly from now on, as it did on this step.
            log.warning("the sampler's decode steps could not be captured as CUDA graphs; they run eagerly")
            self.graphs = None
        device = self.pool.device
        return step({name: t.to(device, non_blocking=True) for name, t in host.items()})[0]

    def _put_back(self, host: dict[str, torch.Tensor]) -> Callable[[], Callable[[], None]]:
        """What a capture's warm-up step changes that its replay changes again: the rows' linear-
        attention states (a key written twice is the same key)."""
        def snapshot() -> Callable[[], None]:
            saved = [None if st is None else tuple(s.clone() for s in st) for st in self.pool.states]

            def restore() -> None:
                for state, kept in zip(self.pool.states, saved):
                    if state is not None and kept is not None:
                        for store, old in zip(state, kept):
                            store.copy_(old)
            return restore
        return snapshot
