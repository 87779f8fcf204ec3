"""The built-in engine's KV cache: one pool of pages, preallocated and shared by every running row.

Storage, as vLLM's paged attention keeps it: per attention layer, keys and values in pages of
`PAGE_TOKENS` tokens, `[pages, PAGE_TOKENS, heads, dim]`, made at a layer's first write (on CUDA
the engine makes one at its start: each layer's shapes are then the model's own). Their number is
fixed by the KV-cache budget (`--max-sampling-kv-tokens`, kv_budget.py) plus one page per running
row (a row's last page is partly empty): on CUDA all of them at once (a captured decode step reads
fixed addresses); elsewhere grown by doubling up to that bound, as rows need them (CPU memory is
shared with everything else on the machine, and the default budget there is generous).

A sequence (`Seq`: a prompt being prefilled, or one sample's row) holds a page table. The samples
of one prompt share its full pages (counted references) and each gets its own copy of the last,
partial one, so a row only ever writes its own pages. Page 0 is never written (the zero page: what
a gather reads past a row's end) and page 1 takes the writes of padding tokens. Freed pages are
zeroed: keys under another row's mask are still multiplied (a masked NaN poisons the whole row).

A forward reads and writes the pool through `PagedCache`, the transformers `Cache` its attention
layers call: `update(keys, values, layer)` writes the forward's new keys at each token's place
(`StepIndex.write`) and returns every row's keys gathered from its pages up to the forward's
width (`StepIndex.pages`); the step's mask cuts each row to its own positions. Linear-attention
layers (Qwen3.5's Gated DeltaNet) keep a fixed-size state per row instead, in per-row slots:
gathered for a forward, written back after it (`PagedCache.finish`), so a forward that fails
leaves them as they were.

Preemption (engine.py) takes a job's pages and states out of the pool and puts them back bit for
bit (`swap_out`, `swap_in`).
"""

from __future__ import annotations

import functools
from dataclasses import dataclass, field

import numpy as np
import torch
from transformers.cache_utils import Cache, CacheLayerMixin, LinearAttentionLayer

PAGE_TOKENS = 16
ZERO_PAGE, TRASH_PAGE = 0, 1  # never written; written by padding tokens
FIRST_FREE_PAGE = 2
DUMMY_SLOT = 0  # the linear-attention state slot padding rows read and write


@dataclass(eq=False)
class Seq:
    """One sequence's cache: its pages, how many tokens they hold, its linear-attention slot."""

    pages: list[int] = field(default_factory=list)
    length: int = 0
    slot: int = DUMMY_SLOT


@dataclass(frozen=True)
class StepIndex:
    """Where one forward's tokens go in the pool and what it reads back (device tensors)."""

    write: torch.Tensor  # [rows * tokens]: each input token's place (page * PAGE_TOKENS + offset), row-major
    pages: torch.Tensor  # [rows, ceil(width / PAGE_TOKENS)]: the pages each row reads
    slots: torch.Tensor  # [rows]: each row's linear-attention state slot
    width: int  # the positions each row reads (its keys past its own end are masked)
    continues: bool  # whether the rows' linear-attention states already hold earlier tokens

    @functools.cached_property
    def read(self) -> torch.Tensor:
        """`pages` flattened: one view for every layer's reads."""
        return self.pages.view(-1)


@dataclass
class Swapped:
    """A job's sequences out of the pool: their pages' contents and states, and each one's layout."""

    keys: list[torch.Tensor | None]  # per layer: [pages, PAGE_TOKENS, heads, dim] (None: linear layer)
    values: list[torch.Tensor | None]
    states: list[tuple[torch.Tensor, torch.Tensor] | None]  # per linear layer: (conv, recurrent) [seqs, ...]
    tables: list[list[int]]  # per sequence: indices into the swapped pages
    lengths: list[int]


class KVPool:
    def __init__(self, budget_tokens: int, device: torch.device, *, max_rows: int, linear: list[bool],
                 preallocate: bool):
        self.device = device
        self.linear = linear  # per model layer: whether it keeps a linear-attention state
        self.max_pages = FIRST_FREE_PAGE + -(-budget_tokens // PAGE_TOKENS) + max_rows
        self.capacity = self.max_pages if preallocate else min(self.max_pages, FIRST_FREE_PAGE + 64)
        self.keys: list[torch.Tensor | None] = [None] * len(linear)
        self.values: list[torch.Tensor | None] = [None] * len(linear)
        self.refs = np.zeros(self.capacity, dtype=np.int64)
        self._free = list(range(self.capacity - 1, FIRST_FREE_PAGE - 1, -1))  # popped from the end: low first
        self._to_zero: list[int] = []
        self.slot_capacity = max_rows + 1
        self.states: list[tuple[torch.Tensor, torch.Tensor] | None] = [None] * len(linear)
        self._free_slots = list(range(self.slot_capacity - 1, DUMMY_SLOT, -1))
        self.has_linear = any(linear)
        self.storage_version = 0  # bumped when the storage moves (it grows): captured steps over it are stale

    # -- pages --------------------------------------------------------------------------------------
    def new_seq(self) -> Seq:
        return Seq(slot=self._free_slots.pop() if self.has_linear else DUMMY_SLOT)

    def extend(self, seq: Seq, length: int) -> None:
        """Give `seq` the pages to hold `length` tokens."""
        while len(seq.pages) * PAGE_TOKENS < length:
            seq.pages.append(self._page())

    def fork(self, seq: Seq, n: int) -> list[Seq]:
        """`seq` and n - 1 copies of it: full pages shared, the partial last page copied."""
        copies = [seq]
        partial = seq.length % PAGE_TOKENS != 0
        shared = seq.pages[:-1] if partial else seq.pages
        for _ in range(n - 1):
            twin = self.new_seq()
            self.refs[shared] += 1
            twin.pages, twin.length = list(shared), seq.length
            if partial:
                twin.pages.append(self._page())
            copies.append(twin)
        if partial and n > 1:
            src = torch.tensor([seq.pages[-1]] * (n - 1), device=self.device)
            dst = torch.tensor([c.pages[-1] for c in copies[1:]], device=self.device)
            self._copy_pages(src, dst)
        if self.has_linear and n > 1:
            self._copy_slots(torch.tensor([seq.slot] * (n - 1), device=self.device),
                             torch.tensor([c.slot for c in copies[1:]], device=self.device))
        return copies

    def free(self, seqs: list[Seq]) -> None:
        """Give the sequences' pages back (zeroed once no sequence holds them) and their slots."""
        for seq in seqs:
            pages = np.asarray(seq.pages, dtype=np.int64)
            np.subtract.at(self.refs, pages, 1)
            gone = pages[self.refs[pages] == 0]
            self._to_zero.extend(gone.tolist())
            seq.pages = []
            if seq.slot != DUMMY_SLOT:
                self._free_slots.append(seq.slot)
                seq.slot = DUMMY_SLOT

    def collect(self) -> None:
        """Zero the pages freed since the last call and make them free (one write per layer)."""
        if not self._to_zero:
            return
        pages = torch.tensor(self._to_zero, device=self.device)
        for store in (*self.keys, *self.values):
            if store is not None:
                store.index_fill_(0, pages, 0)
        self._free.extend(sorted(set(self._to_zero), reverse=True))
        self._to_zero = []

    @property
    def pages_in_use(self) -> int:
        return int((self.refs > 0).sum())

    def _page(self) -> int:
        if not self._free:
            self.collect()
        if not self._free:
            self._grow()
        page = self._free.pop()
        self.refs[page] = 1
        return page

    def _grow(self) -> None:
        if self.capacity >= self.max_pages:
            raise RuntimeError("the sampler's KV pool ran out of pages within its budget (a bug)")
        new = min(self.max_pages, 2 * self.capacity)
        for stores in (self.keys, self.values):
            for i, old in enumerate(stores):
                if old is not None:
                    stores[i] = torch.cat([old, old.new_zeros(new - self.capacity, *old.shape[1:])])
        self.refs = np.concatenate([self.refs, np.zeros(new - self.capacity, dtype=np.int64)])
        self._free = list(range(new - 1, self.capacity - 1, -1)) + self._free
        self.capacity = new
        self.storage_version += 1

    def _copy_pages(self, src: torch.Tensor, dst: torch.Tensor) -> None:
        for store in (*self.keys, *self.values):
            if store is not None:
                store.index_copy_(0, dst, store.index_select(0, src))

    def _copy_slots(self, src: torch.Tensor, dst: torch.Tensor) -> None:
        for state in self.states:
            if state is not None:
                for store in state:
                    store.index_copy_(0, dst, store.index_select(0, src))

    # -- a forward's reads and writes ---------------------------------------------------------------
    def write_read(self, layer: int, k: torch.Tensor, v: torch.Tensor,
                   index: StepIndex) -> tuple[torch.Tensor, torch.Tensor]:
        """Write the forward's keys and values ([rows, heads, tokens, dim]) at their places; return
        every row's [rows, heads, width, dim] from its pages (a view of what it gathered)."""
        out = []
        for stores, new in ((self.keys, k), (self.values, v)):
            heads, dim = new.shape[1], new.shape[-1]
            if stores[layer] is None:
                stores[layer] = torch.zeros(self.capacity, PAGE_TOKENS, heads, dim, dtype=new.dtype, device=self.device)
            store = stores[layer]
            store.view(-1, heads, dim).index_copy_(0, index.write, new.transpose(1, 2).reshape(-1, heads, dim))
            rows, pages = index.pages.shape
            read = store.index_select(0, index.read)  # index_select: 2x advanced indexing's speed on CPU
            out.append(read.view(rows, pages * PAGE_TOKENS, heads, dim)[:, :index.width].transpose(1, 2))
        return out[0], out[1]

    def linear_layer(self, layer: int, index: StepIndex) -> LinearAttentionLayer:
        """Layer `layer`'s states of the forward's rows (copies), as the model's linear attention reads them."""
        view = LinearAttentionLayer()
        state = self.states[layer]
        if state is not None:
            conv, recurrent = (store.index_select(0, index.slots) for store in state)
            view.conv_states[0], view.recurrent_states[0] = conv, recurrent
            view.is_conv_states_initialized[0] = view.is_recurrent_states_initialized[0] = True
            view.conv_kernel_size[0] = conv.shape[-1]
            view.dtype, view.device = conv.dtype, conv.device
        view.has_previous_state[0] = index.continues
        return view

    def store_linear(self, layer: int, view: LinearAttentionLayer, index: StepIndex) -> None:
        """Write the forward's new states back to the rows' slots."""
        conv, recurrent = view.conv_states[0], view.recurrent_states[0]
        if conv is None or recurrent is None:
            return
        if self.states[layer] is None:
            self.states[layer] = (conv.new_zeros(self.slot_capacity, *conv.shape[1:]),
                                  recurrent.new_zeros(self.slot_capacity, *recurrent.shape[1:]))
        for store, new in zip(self.states[layer], (conv, recurrent)):
            store.index_copy_(0, index.slots, new)

    def reset_slot(self, seq: Seq) -> None:
        """A new sequence starts from an empty state (its slot may hold an earlier row's)."""
        for state in self.states:
            if state is not None:
                for store in state:
                    store[seq.slot].zero_()

    # -- preemption -------------------------------------------------------------------------------
    def swap_out(self, seqs: list[Seq]) -> Swapped:
        """Copy the sequences' pages and states out of the pool (to the host), then free them."""
        unique = sorted({p for seq in seqs for p in seq.pages})
        where = {p: i for i, p in enumerate(unique)}
        pages = torch.tensor(unique, dtype=torch.long, device=self.device)
        slots = torch.tensor([s.slot for s in seqs], dtype=torch.long, device=self.device)
        out = Swapped(keys=[None if s is None else s.index_select(0, pages).to("cpu", copy=True) for s in self.keys],
                      values=[None if s is None else s.index_select(0, pages).to("cpu", copy=True)
                              for s in self.values],
                      states=[None if st is None else tuple(s.index_select(0, slots).to("cpu", copy=True) for s in st)
                              for st in self.states],
                      tables=[[where[p] for p in seq.pages] for seq in seqs], lengths=[s.length for s in seqs])
        self.free(seqs)
        return out

    def swap_in(self, swapped: Swapped) -> list[Seq]:
        """New sequences holding exactly what `swap_out` took (the same sharing of pages)."""
        pages = [self._page() for _ in range(1 + max((i for t in swapped.tables for i in t), default=-1))]
        seqs = [Seq(pages=[pages[i] for i in table], length=n) for table, n in zip(swapped.tables, swapped.lengths)]
        for seq in seqs:
            if self.has_linear:
                seq.slot = self._free_slots.pop()
            self.refs[seq.pages] += 1
        self.refs[pages] -= 1  # `_page` counted each once; the tables count every holder
        index = torch.tensor(pages, dtype=torch.long, device=self.device)
        for stores, saved in ((self.keys, swapped.keys), (self.values, swapped.values)):
            for store, data in zip(stores, saved):
                if store is not None and data is not None and len(pages):
                    store.index_copy_(0, index, data.to(self.device))
        slots = torch.tensor([s.slot for s in seqs], dtype=torch.long, device=self.device)
        for state, saved in zip(self.states, swapped.states):
            if state is not None and saved is not None:
                for store, data in zip(state, saved):
                    store.index_copy_(0, slots, data.to(self.device))
        return seqs


class _PagedLayer(CacheLayerMixin):
    """One attention layer's view of the pool for one forward."""

    def __init__(self, pool: KVPool, layer: int, index: StepIndex):
        super().__init__()
        self.pool, self.layer, self.index = pool, layer, index
        self.is_initialized = True

    def lazy_initialization(self, key_states, value_states) -> None:  # the pool allocates
        pass

    def update(self, key_states, value_states, *args, **kwargs):
        return self.pool.write_read(self.layer, key_states, value_states, self.index)

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        return self.get_seq_length(), 0

    def get_seq_length(self) -> int:
        return self.index.width

    def get_max_length(self) -> int:
        return -1


class PagedCache(Cache):
    """The transformers `Cache` of one forward over the pool (`StepIndex` says which rows, where)."""

    def __init__(self, pool: KVPool, index: StepIndex):
        self.pool, self.index = pool, index
        super().__init__(layers=[pool.linear_layer(i, index) if linear else _PagedLayer(pool, i, index)
                                 for i, linear in enumerate(pool.linear)])

    def finish(self) -> None:
        """The forward succeeded: the rows' new linear-attention states go back to their slots."""
        for i, linear in enumerate(self.pool.linear):
            if linear:
                self.pool.store_linear(i, self.layers[i], self.index)
