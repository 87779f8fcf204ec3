"""`SamplingEngine`: batched autoregressive generation over one paged KV cache, many adapters per batch.

Runs on the device loop's thread (device_loop.py), between training cycles, on the same model and
the same `MultiLoRALinear` layers: each row goes through its own adapter snapshot (or none, for
the base model). Each tick of a round (`run`):

1. jobs submitted since the last tick join the waiting ones, in arrival order, and admission
   (admission.py) starts those that fit the KV-cache budget, pausing younger running jobs where an
   older one needs their room (their cache swapped out, to resume bit for bit);
2. one prefill forward (`_prefill_chunk`): the next chunk of the prompts being prefilled, at most
   `prefill_chunk_tokens` (padded) while rows decode, so a long prompt never stalls them for more
   than a chunk (`max_prefill_tokens` when none decode). A prompt with images goes whole (its
   image tokens and pixels in one forward), and a model with linear-attention layers prefills one
   prompt per forward (a padded row would run its recurrent state on). A job whose prompt is
   complete forks into its num_samples rows (sharing its full cache pages) and picks their first
   tokens;
3. one decode step for every running row (`_decode`, step.py): all rows in one forward, their
   adapters' LoRA deltas in one grouped call per projection, a CUDA graph replay on CUDA.

The engine hands control back to training whenever training work is waiting, keeping its state
(the pool's pages) for the next round. The KV cache is one pool of pages sized by the budget
(kv_cache.py); what a job reserves of that budget, and the order jobs run in, is admission.py's.

Returned logprobs are the model's own: log-softmax of the raw logits, with no temperature, top-k or
top-p applied, so they equal the training forward's logprobs of the same tokens. A step's next
tokens are picked for all its rows at once on the device and read back in one copy (pick.py);
seeded rows draw from their own counter-based streams, so a seed gives the same samples whatever
else is in the batch.

A request's failure is its own: when a prefill forward of several jobs raises (one job's prompt may
break it), each job is prefilled alone, so only the job that fails alone fails; when a decode step
raises, nothing it wrote counts (a row's length moves only after its token is picked) and each
job's rows step alone. A job fails with a user error (400) if its own request raised a `UserError`.

The jobs it runs and their results are jobs.py's; each job's rows, their tokens and the job's one
answer are rows.py's; what a prompt's logits answer is prompt_logits.py's.
"""

from __future__ import annotations

import collections
import itertools
import logging
import time
from typing import Callable

import torch

from .. import faults
from ..errors import UserError
from ..runtime.graphs import CudaGraphCapture, StepGraphs
from ..runtime.lora_plan import LoRARouting
from ..runtime.packing import segments_of
from .admission import Admission
from .image_positions import prefill_inputs
from .jobs import SampleJob
from .kv_budget import DEFAULT_KV_TOKENS, job_kv_tokens
from .kv_cache import PAGE_TOKENS, KVPool
from .pick import BatchPicker
from .prompt_logits import needs_prompt_logits, prompt_answers
from .rows import JobState, Row, RowRecorder, failure, rows_of
from .step import AttentionMasks, DecodeBatch, DecodeStep, ForwardRow, forward_inputs, run_forward

log = logging.getLogger(__name__)

CANCELLED = "cancelled: nobody is waiting for this request any more"
# The defaults' reasons, from shared/reference/gpu-notes.md's H200 figures for a Qwen3-1.7B-shaped body
# (~3.4 GFLOP per token; a decode step reads ~3.4 GB of weights in ~0.8 ms; 748 TFLOP/s, ~65 % reached):
# - 256 rows per decode step: a row costs ~7 us, so ~115 rows ride on the weight read for free; at 256 a
#   step is compute-bound (~2 ms), and more rows would only lengthen every row's step.
# - 2048 prefill tokens per forward while rows decode: ~14 ms, so a running row waits about two decode
#   steps (issue 35's 8 ms target) for a long prompt's chunk.
# - 16,384 with none decoding: ~0.1 s, enough to amortize a forward's launches; a prompt that arrives
#   meanwhile starts in the next one. Not measured on a GPU with this engine yet (decode_profile.py).


class SamplingEngine:
    def __init__(self, model: torch.nn.Module, routing: LoRARouting, tokenizer, device: torch.device,
                 *, max_rows: int = 256, prefill_chunk_tokens: int = 2048, max_prefill_tokens: int = 16384,
                 kv_budget_tokens: int = DEFAULT_KV_TOKENS, kv_share_per_key: float = 1.0, cuda_graphs: bool = True,
                 preallocate: bool = True, graphs: StepGraphs | None = None,
                 on_request_done: Callable[[SampleJob, int], None] = lambda job, tokens: None):
        self.model = model
        self.routing = routing
        self.tokenizer = tokenizer
        self.device = device
        # The prefill's LoRA calls on CPU are the training pass's, probed per shape; a decode step
        # groups every adapter of the step in one call (step.py), on every device.
        self.exact_lora = device.type != "cuda"
        self.max_rows = max_rows
        # A prefill forward's padded tokens: while rows decode, at most a chunk (it delays their next
        # token); with none decoding, as many prompts as max_prefill_tokens holds.
        self.prefill_chunk_tokens = prefill_chunk_tokens
        self.max_prefill_tokens = max(max_prefill_tokens, prefill_chunk_tokens)
        self.kv_budget_tokens = kv_budget_tokens
        self.kv_tokens_per_key = max(1, int(kv_budget_tokens * kv_share_per_key))
        self.peak_reserved_kv_tokens = 0  # the most the running jobs ever reserved together
        text = model.config.get_text_config() if hasattr(model.config, "get_text_config") else model.config
        linear = [kind == "linear_attention" for kind in (getattr(text, "layer_types", None)
                                                           or ["full_attention"] * text.num_hidden_layers)]
        self.recurrent = any(linear)  # its prompts prefill alone: a padded row would run its state on
        self.rope = getattr(model.config, "image_token_id", None) is not None  # Qwen-VL's 3-D positions
        # On CUDA the whole pool is made now (`preallocate`): a captured step reads fixed addresses, and
        # the memory is the sampler's from start-up. Elsewhere it is made at the first prefill and
        # grows with what rows need.
        self.pool = KVPool(kv_budget_tokens, device, max_rows=max_rows, linear=linear,
                           preallocate=preallocate and device.type == "cuda")
        self.masks = AttentionMasks(model.config)
        # Decode steps as CUDA graphs on CUDA; `graphs` puts a stand-in capture in (tests, on CPU).
        if graphs is None and cuda_graphs and device.type == "cuda":
            graphs = StepGraphs(CudaGraphCapture(device))
        self.decode_step = DecodeStep(model, routing, self.pool, self.masks, graphs)
        self.decode_batch = DecodeBatch(buckets=graphs is not None, rope=self.rope)
        self.admission = Admission(kv_budget_tokens, self.kv_tokens_per_key, max_rows)
        self._pending: collections.deque[SampleJob] = collections.deque()
        self._arrivals = itertools.count()
        # The last pick's rows, their settings and draw counts (rows compare by identity)
        self._picker: tuple[tuple[Row, ...], BatchPicker, torch.Tensor] | None = None
        self.requests_cancelled = 0
        self.requests_preempted = 0
        # Rows' tokens recorded, jobs answered (and observed: api/metrics.py), counted.
        self.recorder = RowRecorder(tokenizer, on_request_done)
        if preallocate and device.type == "cuda":
            # Not on CPU, where the first prefill makes it: a forward here, on the thread that builds
            # the server, would leave an OpenMP team behind (runtime/cpu_threads.py).
            self._allocate_pool()

    def _allocate_pool(self) -> None:
        """Make the whole pool's storage now, with one forward of one token that writes only the
        trash page: each layer's keys, values and states take their shapes from the model itself
        (latent caches, linear-attention states)."""
        host = forward_inputs([ForwardRow(seq=None, tokens=[0], start=0)], 1, rope=self.rope)
        with torch.no_grad():
            run_forward(self.model, self.pool, self.masks, {k: t.to(self.device) for k, t in host.items()}, 1,
                        continues=False)

    # -- producer side (any thread; deque appends and pops are atomic) ---------------------------------
    def submit(self, job: SampleJob) -> None:
        self._pending.append(job)

    def submit_all(self, jobs: list[SampleJob]) -> None:
        self._pending.extend(jobs)  # one step under the GIL: admission sees all of them or none

    def has_work(self) -> bool:
        return bool(self._pending or self.admission.waiting or self.admission.running)

    def _jobs(self) -> list[JobState]:
        return list(self.admission.running) + list(self.admission.waiting)

    def active_adapter_ids(self) -> set[str]:
        """The adapters in the layers that started jobs use (running, or paused)."""
        return {job.adapter_id for job in self._jobs() if job.resolved and job.adapter_id is not None}

    def requested_adapter_ids(self) -> set[str]:
        """The `adapter_id`s the queued and running jobs asked for (before resolution)."""
        return ({job.adapter_id for job in list(self._pending)} | {job.request.adapter_id for job in self._jobs()}) - {None}

    @property
    def tokens_generated(self) -> int:
        return self.recorder.tokens_generated

    @property
    def requests_done(self) -> int:
        return self.recorder.requests_done

    @property
    def active_rows(self) -> int:
        return sum(job.rows_left for job in list(self.admission.running))

    @property
    def reserved_kv_tokens(self) -> int:
        """KV-cache tokens the running jobs have reserved (any thread: a snapshot)."""
        return self.admission.reserved()

    @property
    def held_kv_tokens(self) -> int:
        """KV-cache tokens the running jobs' sequences hold now (each row counts its prompt)."""
        return sum(seq.length for job in list(self.admission.running)
                   for seq in ([job.prefill] if job.prefill else [row.seq for row in job.rows]))

    @property
    def waiting_jobs(self) -> int:
        """Jobs queued, not yet started (waiting for the KV-cache budget or the next round), or paused."""
        return len(self._pending) + len(self.admission.waiting)

    def reserved_kv_tokens_of(self, owner: str) -> int:
        """KV-cache tokens `owner`'s running jobs have reserved."""
        return self.admission.reserved_of(owner)

    def refusal(self, job: SampleJob) -> str | None:
        """Why `job` can never run here (its worst case exceeds one key's share of the KV-cache budget,
        or it asks for more samples than the engine runs at once), or None."""
        if job.num_samples > self.max_rows:
            return (f"a sample job asks for {job.num_samples} samples, more than the {self.max_rows} sequences "
                    "the built-in sampler runs at once: ask for fewer samples")
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
        jobs = [JobState.of(job) for job in self._drain()] + self._jobs()
        for job in self.admission.running:
            self._release(job)
        self.admission.running.clear()
        self.admission.waiting.clear()
        for job in jobs:
            try:
                job.fail(reason)
            except Exception:  # one broken callback must not keep the others unanswered
                log.exception("a sampling job's on_error callback failed")

    def run(self, should_yield: Callable[[], bool], max_seconds: float = 0.5,
            resolve_adapter: Callable[[SampleJob], str | None] = lambda j: j.adapter_id,
            min_seconds: float = 0.0) -> None:
        """Tick until idle or for at most max_seconds; once min_seconds have passed, also stop as
        soon as training is waiting.

        Always makes at least one tick of progress, so sampling never starves; `min_seconds` is
        its guaranteed share of the device when training competes for it.
        """
        start = time.perf_counter()
        with torch.no_grad():
            while self.has_work():
                self._tick(resolve_adapter)
                elapsed = time.perf_counter() - start
                if elapsed > max_seconds or (elapsed >= min_seconds and should_yield()):
                    return

    def _tick(self, resolve_adapter) -> None:
        self._receive()
        self._admit(resolve_adapter)
        self._drop_cancelled(self.admission.running)  # after admission: the room it frees is the next tick's
        self._prefill_chunk()
        self._decode([row for job in self.admission.running for row in job.rows])
        self.pool.collect()

    def _drain(self) -> list[SampleJob]:
        jobs = []
        while self._pending:
            jobs.append(self._pending.popleft())
        return jobs

    def _receive(self) -> None:
        """New jobs join the waiting ones; cancelled waiting jobs leave."""
        for job in self._drain():
            reason = self.refusal(job)  # refused at submission; here for jobs that reach the engine otherwise
            if reason is not None:
                job.on_error(reason)
            else:
                self.admission.wait(JobState.of(job, next(self._arrivals)))
        self._drop_cancelled(self.admission.waiting)

    def _drop_cancelled(self, queue: list[JobState]) -> None:
        """Jobs whose clients left leave `queue`, their cache with them."""
        for job in [j for j in queue if j.request.cancelled]:
            queue.remove(job)
            self._release(job)
            self.requests_cancelled += 1
            job.fail(CANCELLED)

    def _release(self, job: JobState) -> None:
        """Free what `job` holds of the pool."""
        self.pool.free([job.prefill] if job.prefill else [row.seq for row in job.rows])
        job.prefill, job.swapped = None, None

    def _admit(self, resolve_adapter) -> None:
        if not self.admission.waiting:
            return
        plan = self.admission.plan()
        for job in plan.pause:
            self._pause(job)
        for job in plan.start:
            self.admission.waiting.remove(job)
            if not job.resolved:
                try:
                    job.adapter_id, job.resolved = resolve_adapter(job.request), True
                except Exception as e:  # e.g. an unreadable snapshot: only this request fails
                    job.fail(f"cannot load the sampler weights: {e}")
                    continue
            self._resume(job)
            self.admission.running.append(job)
        self.peak_reserved_kv_tokens = max(self.peak_reserved_kv_tokens, self.reserved_kv_tokens)

    def _pause(self, job: JobState) -> None:
        """Preempt `job`: its cache leaves the pool, it waits in its arrival place."""
        self.admission.running.remove(job)
        seqs = [job.prefill] if job.prefill else [row.seq for row in job.rows]
        job.swapped = self.pool.swap_out(seqs)
        self.admission.wait(job)
        self.requests_preempted += 1

    def _resume(self, job: JobState) -> None:
        if job.swapped is None:  # a new job: an empty sequence for its prompt
            job.prefill = self.pool.new_seq()
            self.pool.reset_slot(job.prefill)
            return
        seqs = self.pool.swap_in(job.swapped)
        job.swapped = None
        if job.rows:
            for row, seq in zip(job.rows, seqs):
                row.seq = seq
        else:
            job.prefill = seqs[0]

    # -- prefill ---------------------------------------------------------------------------------------
    def _prefill_chunk(self) -> None:
        """One prefill forward over the next chunk of the jobs being prefilled; a job whose forward
        breaks a batch of several is then prefilled on its own."""
        batch = self._next_chunk([job for job in self.admission.running if job.prefilling])
        if not batch:
            return
        try:
            complete = self._prefill(batch)
        except Exception as e:
            if len(batch) == 1:
                self._drop(batch[0][0], e)
                return
            log.warning("prefill of %d sampling requests failed (%s: %s); prefilling them one by one",
                        len(batch), type(e).__name__, e)
            complete = []
            for part in batch:
                try:
                    complete += self._prefill([part])
                except Exception as e:
                    self._drop(part[0], e)
        if complete:
            self._start_rows(complete)

    def _next_chunk(self, jobs: list[JobState]) -> list[tuple[JobState, int]]:
        """(job, tokens) of the next prefill forward: oldest first, at most prefill_chunk_tokens
        padded tokens while rows decode (max_prefill_tokens when none do). A prompt with images
        goes whole, beside other prompts with images only; a model with linear-attention layers
        prefills one prompt per forward."""
        if not jobs:
            return []
        first = jobs[0]
        images = first.request.pixels is not None
        if images:
            return [(j, len(j.request.prompt)) for j in jobs if j.request.pixels is not None][:1 if self.recurrent else None]
        decoding = any(job.rows for job in self.admission.running)
        budget = self.prefill_chunk_tokens if decoding else self.max_prefill_tokens
        batch, width = [], 0
        for job in jobs:
            if job.request.pixels is not None:
                continue
            left = len(job.request.prompt) - job.prefilled
            new_width = min(budget, max(width, left))
            if batch and (self.recurrent or (len(batch) + 1) * new_width > budget):
                break
            batch.append(job)
            width = new_width
        batch.sort(key=lambda job: job.adapter_id or "")  # rows of one adapter together: fewer LoRA segments
        return [(job, min(width, len(job.request.prompt) - job.prefilled)) for job in batch]

    def _prefill(self, batch: list[tuple[JobState, int]]) -> list[tuple[JobState, torch.Tensor]]:
        """Prefill the next `n` tokens of each job's prompt; the jobs whose prompts are now complete,
        with their last logits."""
        rows = []
        for job, n in batch:
            self.pool.extend(job.prefill, job.prefilled + n)
            rows.append(ForwardRow(seq=job.prefill, tokens=job.request.prompt[job.prefilled:job.prefilled + n],
                                   start=job.prefilled))
        width = max(job.prefilled + n for job, n in batch)
        host = forward_inputs(rows, width, rope=self.rope)
        inputs = {name: t.to(self.device) for name, t in host.items()}
        extra, deltas = {}, None
        if batch[0][0].request.pixels is not None:
            real = (torch.arange(inputs["input_ids"].shape[1], device=self.device)
                    >= inputs["input_ids"].shape[1] - torch.tensor([n for _, n in batch], device=self.device)[:, None])
            extra, deltas = prefill_inputs(self.model, inputs["input_ids"], real.long(), inputs["query_positions"],
                                           [job.request.pixels for job, _ in batch])
        keep = 0 if any(needs_prompt_logits(job.request) for job, _ in batch) else 1
        with self.routing.batch(segments_of([job.adapter_id for job, _ in batch]), exact=self.exact_lora):
            faults.check_poisoned("sampling.prefill_poisoned", (job.request.prompt for job, _ in batch), user=True)
            logits = run_forward(self.model, self.pool, self.masks, inputs, width,
                                 continues=batch[0][0].prefilled > 0, logits_to_keep=keep, **extra).float()
        complete = []
        for r, (job, n) in enumerate(batch):
            job.prefill.length = job.prefilled = job.prefilled + n
            if keep == 0 and needs_prompt_logits(job.request):
                job.prompt_logits.append(logits[r, logits.shape[1] - n:])
            if deltas is not None:
                job.rope_delta = int(deltas[r])
            if job.prefilled == len(job.request.prompt):
                complete.append((job, logits[r, -1]))
        return complete

    def _start_rows(self, complete: list[tuple[JobState, torch.Tensor]]) -> None:
        """Prompts done: each job forks into its rows, whose first tokens are picked together."""
        rows, logits = [], []
        for job, last in complete:
            if job.prompt_logits:
                full = torch.cat(job.prompt_logits)
                job.prompt_logits = []
                job.prompt = prompt_answers(job.request, full)
            job.rows = rows_of(job, self.pool.fork(job.prefill, job.request.num_samples))
            job.prefill = None
            rows += job.rows
            logits += [last] * job.request.num_samples
        try:
            picks = self._pick(rows, torch.stack(logits))
        except Exception as e:
            for job, _ in complete:
                self._drop(job, e)
            return
        now = time.perf_counter()
        for job, _ in complete:
            job.request.first_token_at = now
        self._record(rows, picks, logits[0].shape[-1])

    # -- decode ----------------------------------------------------------------------------------------
    def _decode(self, rows: list[Row], alone: bool = False) -> None:
        """One decode step of `rows`: each writes its newest token and gets the next."""
        if not rows:
            return
        for row in rows:
            if row.seq.length >= len(row.seq.pages) * PAGE_TOKENS:  # its newest token starts a page
                self.pool.extend(row.seq, row.seq.length + 1)
        layout, host = self.decode_batch(rows)
        placed = [row for row in layout.rows if row is not None]
        try:
            faults.check_poisoned("sampling.decode_poisoned", (row.job.request.prompt for row in placed))
            logits = self.decode_step(layout, host)
            if len(placed) < len(layout.rows):  # padding rows: never picked
                real = torch.tensor([i for i, row in enumerate(layout.rows) if row is not None], device=self.device)
                logits = logits.index_select(0, real)
            picks = self._pick(placed, logits.float())
        except Exception as e:
            jobs = list({id(row.job): row.job for row in placed}.values())
            if alone or len(jobs) == 1:
                for job in jobs:
                    self._drop(job, e)
                return
            log.warning("a decode step of %d sampling requests failed (%s: %s); stepping each on its own",
                        len(jobs), type(e).__name__, e)
            for job in jobs:
                self._decode([row for row in placed if row.job is job], alone=True)
            return
        for row in placed:  # the step stands: each row's newest token is in its cache
            row.seq.length += 1
        self._record(placed, picks, logits.shape[-1])

    def _pick(self, rows: list[Row], logits: torch.Tensor) -> list:
        """Every row's next token from its logits [rows, vocab], in one batched call (pick.py)."""
        key = tuple(rows)  # rows compare by identity; the key keeps them alive
        if self._picker is None or self._picker[0] != key:
            picker = BatchPicker([row.sampling for row in rows], self.device)
            steps = torch.tensor([len(row.tokens) for row in rows], device=self.device)
        else:  # the same rows as at the last pick, each with the token it picked
            picker, steps = self._picker[1], self._picker[2] + 1
        picks = picker.pick(logits, steps)[1]
        self._picker = (key, picker, steps)  # once the pick stands
        return picks

    def _record(self, rows: list[Row], picks: list, vocab: int) -> None:
        """Record every row's pick; retire finished rows and jobs. A row that cannot have a token
        fails its own job."""
        for row, picked in zip(rows, picks):
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
                row.job.rows.remove(row)
                self.pool.free([row.seq])
        self._retire({id(row.job): row.job for row in rows}.values())

    def _retire(self, jobs) -> None:
        """Jobs answered (all rows done, or failed) leave, their cache with them."""
        for job in jobs:
            if (job.failed or not job.rows) and job in self.admission.running:
                self.admission.running.remove(job)
                self._release(job)

    def _drop(self, job: JobState, e: Exception) -> None:
        """`job` failed with `e`: it is answered and leaves, its cache with it."""
        log.warning("a sampling request failed", exc_info=not isinstance(e, UserError))
        job.fail(failure(e))
        self._retire([job])

