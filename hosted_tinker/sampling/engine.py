"""`SamplingEngine`: batched autoregressive generation with a KV cache, many adapters per batch.

Runs on the device loop's thread (device_loop.py), between training cycles, on the same model
and the same `MultiLoRALinear` layers: each row of a batch goes through its own adapter snapshot (or
none, for the base model). Requests that arrive while others decode are admitted between
decode steps as a new group (prefilled once, with `num_samples` rows sharing that prefill), and
every group advances one token per step. The engine hands control back to training whenever
training work is waiting, keeping its state (KV caches) for the next cycle.

The KV cache the running groups hold is bounded by a budget in tokens (kv_budget.py), whoever
sent them: a group's rows are left-padded to its longest prompt, so each row reserves the group's
prompt width plus its job's max_tokens, from its prefill until it ends (finished, cancelled or
failed). Each API key's running jobs may hold at most its share of the budget
(`kv_share_per_key`, the setting `max_sampling_kv_share_per_key`): no key can reserve all of it.
Admission is FIFO: a job is admitted when its rows fit beside the running ones' reservations and
within its key's share. A job over its key's share waits without holding anyone back (only its
own key's running jobs can make room for it); a job that fits its share but not the free space
stops admission, and no later job overtakes it (so a large job waits only for running rows to
end, never for a stream of small ones). A job larger than its key's share could never run and is
refused (`refusal`) instead of queued.

Returned logprobs are the model's own: log-softmax of the raw logits, with no temperature,
top-k or top-p applied, so they equal the training forward's logprobs of the same tokens.
Temperature, top-k and top-p shape only the choice of the next token.

A group's next tokens are picked for all its rows at once on the device (pick.py), and come back
to the host in one copy per step, with their logprobs and top-k; the tokens also stay on the
device as the next step's input. Seeded rows draw from their own counter-based streams, so a
seed gives the same samples whatever else is in the batch.

A request's failure is its own: when a prefill group's forward raises (one job's prompt may break
it), each of its jobs is prefilled alone, so only the job that fails alone fails; when a decode
step raises, the group's cache is put back as before the step and each job's rows step on alone.
A job fails with a user error (400) if its own request raised a `UserError`, else a server error.

The jobs it runs and their results are jobs.py's; each job's rows, their recorded tokens and the
job's one answer are rows.py's; what a prompt's logits answer at its prefill (prompt logprobs,
target logprobs, alternative draws) is prompt_logits.py's.
"""

from __future__ import annotations

import copy
import logging
import time
from dataclasses import dataclass
from typing import Callable

import torch
from transformers import DynamicCache
from transformers.cache_utils import DynamicLayer

from .. import faults
from ..errors import UserError
from ..runtime.lora_plan import LoRARouting
from ..runtime.packing import segments_of
from .image_positions import decode_positions, prefill_inputs
from .jobs import SampleJob
from .kv_budget import DEFAULT_KV_TOKENS, job_kv_tokens
from .pick import BatchPicker
from .prompt_logits import needs_prompt_logits, prompt_logprobs, prompt_scores
from .rows import JobState, Row, RowRecorder, failure, rows_of

log = logging.getLogger(__name__)


@dataclass
class _Group:
    rows: list[Row]
    cache: DynamicCache
    mask: torch.Tensor  # [rows, total_len] 1 = real token
    positions: torch.Tensor  # [rows] position of the last token
    next_logits: torch.Tensor  # [rows, vocab] logits for the next token
    width: int  # prompt columns (the longest prompt's length): every row's cache starts this wide
    picker: BatchPicker  # the rows' sampling settings, on the device
    last_tokens: torch.Tensor | None = None  # [rows] the newest tokens, on the device: the next step's input
    steps: int = 0  # tokens chosen per row so far (the same for every row: they start together)
    kv_tokens: int = 0  # reserved KV-cache tokens: sum over rows of width + their job's max_tokens
    rope_deltas: torch.Tensor | None = None  # [rows] an image group's rotary offsets (image_positions.py)

    def reserve(self) -> None:
        """Reserve what the group's rows can hold at most (again, once rows have left)."""
        self.kv_tokens = sum(self.width + row.job.job.max_tokens for row in self.rows)


class SamplingEngine:
    def __init__(self, model: torch.nn.Module, routing: LoRARouting, tokenizer, device: torch.device,
                 *, max_rows_per_group: int = 256, max_prefill_tokens: int = 16384,
                 kv_budget_tokens: int = DEFAULT_KV_TOKENS, kv_share_per_key: float = 1.0,
                 on_request_done: Callable[[SampleJob, int], None] = lambda job, tokens: None):
        self.model = model
        self.routing = routing
        self.tokenizer = tokenizer
        self.device = device
        # On CPU the sampler's LoRA calls are the training pass's, probed per shape (its results
        # equal the trainer's, bit for bit); on CUDA its base GEMMs keep torch's defaults, which are
        # not batch-invariant, and its LoRA calls group tenants without probes (multi_lora.py).
        self.exact_lora = device.type != "cuda"
        self.max_rows_per_group = max_rows_per_group
        self.max_prefill_tokens = max_prefill_tokens
        self.kv_budget_tokens = kv_budget_tokens
        self.kv_tokens_per_key = max(1, int(kv_budget_tokens * kv_share_per_key))
        self.peak_reserved_kv_tokens = 0  # the most the running groups ever reserved together
        self._pending: list[SampleJob] = []
        self._groups: list[_Group] = []
        self.requests_cancelled = 0
        # Rows' tokens recorded, jobs answered (and observed: api/metrics.py), counted.
        self.recorder = RowRecorder(tokenizer, on_request_done)

    @property
    def tokens_generated(self) -> int:
        return self.recorder.tokens_generated

    @property
    def requests_done(self) -> int:
        return self.recorder.requests_done

    # -- producer side (any thread; list.append/pop are atomic under the GIL) ------------------------
    def submit(self, job: SampleJob) -> None:
        self._pending.append(job)

    def submit_all(self, jobs: list[SampleJob]) -> None:
        self._pending.extend(jobs)  # one step under the GIL: admission sees all of them or none

    def has_work(self) -> bool:
        return bool(self._pending or self._groups)

    def active_adapter_ids(self) -> set[str]:
        return {row.adapter_id for g in self._groups for row in g.rows if row.adapter_id is not None}

    def requested_adapter_ids(self) -> set[str]:
        """The `adapter_id`s the queued and running jobs asked for (before resolution)."""
        return ({job.adapter_id for job in list(self._pending)}
                | {row.job.job.adapter_id for g in self._groups for row in g.rows}) - {None}

    @property
    def active_rows(self) -> int:
        return sum(len(g.rows) for g in self._groups)

    @property
    def reserved_kv_tokens(self) -> int:
        """KV-cache tokens the running groups have reserved (any thread: a snapshot)."""
        return sum(g.kv_tokens for g in list(self._groups))

    @property
    def waiting_jobs(self) -> int:
        """Jobs queued, not yet admitted (waiting for the KV-cache budget or the next round)."""
        return len(self._pending)

    def reserved_kv_tokens_of(self, owner: str) -> int:
        """KV-cache tokens `owner`'s running jobs have reserved."""
        return sum(g.width + row.job.job.max_tokens for g in list(self._groups) for row in g.rows
                   if row.job.job.owner == owner)

    def refusal(self, job: SampleJob) -> str | None:
        """Why `job` can never run here (its worst case exceeds one key's share of the KV-cache budget), or None."""
        need = job_kv_tokens(job)
        if need <= self.kv_tokens_per_key:
            return None
        limit = (f"the sampler's whole KV-cache budget of {self.kv_budget_tokens} tokens (max_sampling_kv_tokens)"
                 if self.kv_tokens_per_key >= self.kv_budget_tokens else
                 f"one API key's share of the sampler's KV-cache budget, {self.kv_tokens_per_key} of "
                 f"{self.kv_budget_tokens} tokens (max_sampling_kv_share_per_key x max_sampling_kv_tokens)")
        return (f"a sample job needs up to {need} KV-cache tokens (num_samples {job.num_samples} x (prompt "
                f"{len(job.prompt)} + max_tokens {job.max_tokens})), more than {limit}: ask for fewer samples, "
                "fewer max_tokens or a shorter prompt")

    # -- the device loop's thread --------------------------------------------------------------------
    def fail_all(self, reason: str) -> None:
        """Give up every queued and running job, each told through on_error(reason)."""
        jobs: list[SampleJob] = []
        while self._pending:
            jobs.append(self._pending.pop(0))
        for group in self._groups:
            for row in group.rows:
                if not row.job.failed:
                    row.job.failed = True
                    jobs.append(row.job.job)
        self._groups.clear()
        for job in jobs:
            try:
                job.on_error(reason)
            except Exception:  # one broken callback must not keep the others unanswered
                log.exception("a sampling job's on_error callback failed")

    def run(self, should_yield: Callable[[], bool], max_seconds: float = 0.5,
            resolve_adapter: Callable[[SampleJob], str | None] = lambda j: j.adapter_id,
            min_seconds: float = 0.0) -> None:
        """Admit and decode until idle or for at most max_seconds; once min_seconds have passed,
        also stop as soon as training is waiting.

        Always makes at least one round of progress, so sampling never starves; `min_seconds`
        is its guaranteed share of the device when training competes for it.
        """
        start = time.perf_counter()
        with torch.no_grad():
            while self.has_work():
                self._admit(resolve_adapter)
                for group in list(self._groups):
                    self._decode_step(group)
                elapsed = time.perf_counter() - start
                if elapsed > max_seconds or (elapsed >= min_seconds and should_yield()):
                    return

    def _admit(self, resolve_adapter) -> None:
        if not self._pending:
            return
        jobs: list[SampleJob] = []
        rows = tokens = width = generated = 0
        free = self.kv_budget_tokens - self.reserved_kv_tokens
        held: dict[str, int] = {}  # per key: its running jobs' reservations
        over_share: set[str] = set()  # keys whose first waiting job is over their share: their jobs keep FIFO order
        i = 0
        while i < len(self._pending):
            job = self._pending[i]
            if job.cancelled:
                self._cancel(self._pending.pop(i))
                continue
            reason = self.refusal(job)  # refused at submission; here for jobs that reach the engine otherwise
            if reason is not None:
                self._pending.pop(i).on_error(reason)
                continue
            if jobs and (rows + job.num_samples > self.max_rows_per_group
                         or tokens + len(job.prompt) > self.max_prefill_tokens
                         or (job.pixels is None) != (jobs[0].pixels is None)):
                break  # jobs with images prefill in groups of their own: text groups stay as they were
            # The new group's reservation with this job in it (a longer prompt widens every row).
            new_width = max(width, len(job.prompt))
            new_generated = generated + job.num_samples * job.max_tokens
            if job.owner not in held:
                held[job.owner] = self.reserved_kv_tokens_of(job.owner)
            mine = sum(j.num_samples * (new_width + j.max_tokens) for j in jobs + [job] if j.owner == job.owner)
            if job.owner in over_share or held[job.owner] + mine > self.kv_tokens_per_key:
                over_share.add(job.owner)
                i += 1  # over its key's share: it waits for that key's rows, holding back no other key
                continue
            if (rows + job.num_samples) * new_width + new_generated > free:
                break  # FIFO: it waits until running rows end, and no later job overtakes it
            jobs.append(self._pending.pop(i))
            rows += job.num_samples
            tokens += len(job.prompt)
            width, generated = new_width, new_generated
        states: list[tuple[JobState, str | None]] = []
        for job in jobs:
            try:
                states.append((JobState.of(job), resolve_adapter(job)))
            except Exception as e:  # e.g. an unreadable snapshot: only this request fails
                job.on_error(f"cannot load the sampler weights: {e}")
        if states:
            self._prefill_apart_on_failure(states)

    def _prefill_apart_on_failure(self, states: list[tuple[JobState, str | None]]) -> None:
        """Prefill the jobs as one group; if that raises (one job's prompt may break the group's
        forward), prefill each on its own, so that the failure stays with the job that causes it
        (the others' results do not depend on the batch)."""
        try:
            self._prefill(states)
        except Exception as e:
            if len(states) == 1:
                self._prefill_failed(states, e)
                return
            log.warning("prefill of %d sampling requests failed (%s: %s); prefilling them one by one",
                        len(states), type(e).__name__, e)
            self._drop_groups_of(states)
            for st, aid in states:
                if st.started:  # answered already
                    continue
                alone = [(JobState.of(st.job), aid)]
                try:
                    self._prefill(alone)
                except Exception as e:
                    self._prefill_failed(alone, e)

    def _prefill_failed(self, states: list[tuple[JobState, str | None]], e: Exception) -> None:
        log.warning("prefill of a sampling request failed", exc_info=not isinstance(e, UserError))
        # It may have failed choosing the first tokens, with the new group already running: that
        # group goes too, or its rows would decode on and answer requests already failed here.
        self._drop_groups_of(states)
        for st, _ in states:
            if st.rows_left > 0:  # rows_left 0: already answered
                st.fail(failure(e))

    def _drop_groups_of(self, states: list[tuple[JobState, str | None]]) -> None:
        failed = {id(st) for st, _ in states}
        self._groups = [g for g in self._groups if not any(id(row.job) in failed for row in g.rows)]

    def _prefill(self, states: list[tuple[JobState, str | None]]) -> None:
        states.sort(key=lambda s: (s[1] or ""))  # rows of one adapter together: fewer segments
        width = max(len(st.job.prompt) for st, _ in states)
        n = len(states)
        ids = torch.zeros(n, width, dtype=torch.long)
        mask = torch.zeros(n, width, dtype=torch.long)
        for r, (st, _) in enumerate(states):
            p = st.job.prompt
            ids[r, width - len(p):] = torch.tensor(p)  # left padding: every row ends at the same column
            mask[r, width - len(p):] = 1
        ids, mask = ids.to(self.device), mask.to(self.device)
        positions = (mask.cumsum(-1) - 1).clamp(min=0)
        need_prompt = any(needs_prompt_logits(st.job) for st, _ in states)
        inputs, deltas = {"position_ids": positions}, None
        if states[0][0].job.pixels is not None:  # a group of image jobs (_admit)
            inputs, deltas = prefill_inputs(self.model, ids, mask, positions, [st.job.pixels for st, _ in states])
        cache = _new_cache(self.model.config)
        with self.routing.batch(segments_of([aid for _, aid in states]), exact=self.exact_lora):
            _check_poison("sampling.prefill_poisoned", [st.job for st, _ in states], faults.check_user)
            out = self.model(input_ids=ids, attention_mask=mask, past_key_values=cache, use_cache=True,
                             logits_to_keep=0 if need_prompt else 1, **inputs)
        logits = out.logits.float()
        for r, (st, _) in enumerate(states):
            if st.job.prompt_logprobs or st.job.topk_prompt_logprobs:
                st.prompt_info = prompt_logprobs(st.job, logits[r, width - len(st.job.prompt):])
            if st.job.prompt_targets is not None or st.job.prompt_alt_tokens_k:
                st.prompt_scores = prompt_scores(st.job, logits[r, width - len(st.job.prompt):])
        # Share the prefill across num_samples: repeat each prompt's cache row.
        expand = torch.tensor([r for r, (st, _) in enumerate(states) for _ in range(st.job.num_samples)],
                              device=self.device)
        cache.reorder_cache(expand)  # reorder_cache: linear-attention layers have no batch_select_indices
        rows = [row for st, aid in states for row in rows_of(st, aid)]
        group = _Group(rows=rows, cache=cache, mask=mask[expand], positions=positions[expand, -1],
                       next_logits=logits[expand, -1], width=width,
                       picker=BatchPicker([row.sampling for row in rows], self.device),
                       rope_deltas=None if deltas is None else deltas[expand])
        group.reserve()
        self._groups.append(group)
        self.peak_reserved_kv_tokens = max(self.peak_reserved_kv_tokens, self.reserved_kv_tokens)
        self._choose(group)
        now = time.perf_counter()
        for st, _ in states:
            st.job.first_token_at = now

    def _cancel(self, job: SampleJob) -> None:
        self.requests_cancelled += 1
        job.on_error("cancelled: nobody is waiting for this request any more")

    def _drop_cancelled(self, group: _Group) -> None:
        """Rows of cancelled jobs leave the batch, their KV cache rows with them."""
        keep = [r for r, row in enumerate(group.rows) if not row.job.job.cancelled]
        if len(keep) == len(group.rows):
            return
        for row in group.rows:
            if row.job.job.cancelled and not row.job.failed:
                row.job.failed = True
                self._cancel(row.job.job)
        self._keep_rows(group, keep)

    def _decode_step(self, group: _Group) -> None:
        self._drop_cancelled(group)
        if not group.rows:
            self._groups.remove(group)
            return
        before = (group.cache.get_seq_length(), group.mask, group.positions)
        try:
            last = group.last_tokens[:, None]
            group.mask = torch.cat([group.mask, group.mask.new_ones(len(group.rows), 1)], dim=1)
            group.positions = group.positions + 1
            positions = (group.positions[:, None] if group.rope_deltas is None
                         else decode_positions(group.positions, group.rope_deltas))
            with self.routing.batch(segments_of([row.adapter_id for row in group.rows]), exact=self.exact_lora):
                _check_poison("sampling.decode_poisoned", [row.job.job for row in group.rows], faults.check)
                out = self.model(input_ids=last, attention_mask=group.mask, position_ids=positions,
                                 past_key_values=group.cache, use_cache=True)
            group.next_logits = out.logits[:, -1].float()
            self._choose(group)
        except Exception as e:
            self._decode_failed(group, e, *before)

    def _decode_failed(self, group: _Group, e: Exception, length: int, mask: torch.Tensor,
                       positions: torch.Tensor) -> None:
        """A decode step failed before any token was recorded. With several jobs in the group, its
        cache is put back as it was before the step and each job's rows step on as a group of their
        own: the job whose rows fail alone fails, the others go on. (A cache whose layers keep a
        recurrent state cannot be put back: its jobs fail together.)"""
        jobs = list({id(row.job): row.job for row in group.rows}.values())
        self._groups.remove(group)
        if len(jobs) > 1 and _roll_back(group.cache, length):
            log.warning("a decode step of %d sampling requests failed (%s: %s); stepping each on its own",
                        len(jobs), type(e).__name__, e)
            group.mask, group.positions = mask, positions
            for st in jobs:
                alone = self._split_off(group, [r for r, row in enumerate(group.rows) if row.job is st])
                self._groups.append(alone)
                self._decode_step(alone)
            return
        log.warning("a decode step failed", exc_info=not isinstance(e, UserError))
        for st in jobs:
            st.fail(failure(e))

    def _split_off(self, group: _Group, rows: list[int]) -> _Group:
        """A new group of `group`'s rows at the indices `rows`, with copies of their cache rows."""
        idx = torch.tensor(rows, device=self.device)
        cache = copy.copy(group.cache)
        cache.layers = [copy.copy(layer) for layer in group.cache.layers]
        cache.batch_select_indices(idx)  # new tensors: the group's own stay as they are
        part = _Group(rows=[group.rows[r] for r in rows], cache=cache, mask=group.mask[idx],
                      positions=group.positions[idx], next_logits=group.next_logits[idx], width=group.width,
                      picker=BatchPicker([group.rows[r].sampling for r in rows], self.device),
                      last_tokens=group.last_tokens[idx], steps=group.steps,
                      rope_deltas=None if group.rope_deltas is None else group.rope_deltas[idx])
        part.reserve()
        return part

    def _choose(self, group: _Group) -> None:
        """Pick every row's next token in one batched call, record them, retire finished rows and
        jobs. A row that cannot have one fails its own job, whose rows leave the group; the other
        jobs go on."""
        group.last_tokens, picks = group.picker.pick(group.next_logits, group.steps)
        group.steps += 1
        vocab = group.next_logits.shape[-1]
        keep: list[int] = []
        for r, (row, picked) in enumerate(zip(group.rows, picks)):
            if not picked.finite:
                row.job.fail("the next-token logits are not finite (NaN or inf): the sampler weights make the "
                             "model's outputs non-finite, so nothing can be sampled from them")
            elif row.sampling.logprobs_k > vocab:
                row.job.fail(f"sampling failed on the server: {row.sampling.logprobs_k} top-k logprobs were "
                             f"asked per token, more than the model's {vocab} vocabulary entries")
            if row.job.failed:
                continue
            try:
                done = self.recorder.record(row, picked)
            except Exception as e:
                log.exception("recording a sampled token failed")
                row.job.fail(failure(e))
                continue
            if done:
                self.recorder.finish_row(row)
            else:
                keep.append(r)
        keep = [r for r in keep if not group.rows[r].job.failed]  # a job failed by a later row of its own
        if len(keep) < len(group.rows):
            self._keep_rows(group, keep)
            if not keep:
                self._groups.remove(group)

    def _keep_rows(self, group: _Group, keep: list[int]) -> None:
        """Retire every row of `group` but those at the indices `keep` (their KV cache rows too)."""
        group.rows = [group.rows[r] for r in keep]
        if keep:
            idx = torch.tensor(keep, device=self.device)
            group.cache.reorder_cache(idx)
            group.mask, group.positions = group.mask[idx], group.positions[idx]
            group.last_tokens = group.last_tokens[idx]
            if group.rope_deltas is not None:
                group.rope_deltas = group.rope_deltas[idx]
            group.picker = BatchPicker([row.sampling for row in group.rows], self.device)
        group.reserve()  # the rows that left give their reservation back


def _roll_back(cache: DynamicCache, length: int) -> bool:
    """Put `cache` back to `length` positions after a step that failed part way through its layers;
    False if it cannot be (a layer keeps a recurrent state, updated in place)."""
    if not all(type(layer) is DynamicLayer for layer in cache.layers):
        return False
    for layer in cache.layers:
        extra = layer.get_seq_length() - length
        if extra > 0:
            layer.crop(-extra)
    return True


def _check_poison(point: str, jobs: list[SampleJob], check: Callable[[str], None]) -> None:
    """Test-only (faults.py): a forward holding a poisoned prompt raises, where the model would."""
    if faults.armed(point) and any(faults.POISON[point] in job.prompt for job in jobs):
        check(point)


def _new_cache(config) -> DynamicCache:
    """An empty KV cache. A model with linear-attention layers (Qwen3.5) needs one built from its
    config (those layers keep a recurrent state, not keys); others get a plain one, which keeps
    every key even of sliding-window layers (the engine's masks span the whole row)."""
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    return DynamicCache(config=config) if "linear_attention" in (getattr(text, "layer_types", None) or ()) else DynamicCache()
