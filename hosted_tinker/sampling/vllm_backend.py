"""`VLLMSamplingBackend`: runs `SampleJob`s on the vLLM sidecar, with the built-in engine's answers.

Each job becomes one `/v1/completions` request with token-id prompts, sent from an asyncio loop
on a thread of its own (many requests in flight; the caller never waits). The mapping keeps the
built-in engine's semantics (`engine.py`):
- stopping: only at the job's own `stop_token_ids` (`ignore_eos`, so `stop=[]` means never) and
  stop strings, matched on text decoded with special tokens; the stopping token is part of the
  answer. vLLM does the same: the stop token, or the token that completed a stop string, is the
  last of `token_ids`.
- returned logprobs are the raw model's (vLLM's default `logprobs_mode=raw_logprobs`: before
  temperature, top-k, top-p), so they equal training's.
- temperature below vLLM's greedy threshold (1e-5) is greedy; vLLM refuses n > 1 when greedy, so
  one sequence is asked for and repeated (greedy samples are identical anyway).
- every sampling field vLLM would otherwise fill from the model's generation_config (an attached
  vLLM may not run with `--generation-config vllm`) is sent explicitly.
- seeds: vLLM seeds the i-th of n samples with seed + i; same seed, same samples, as ours (the
  streams differ from the built-in engine's: same distribution, not the same draws).
- prompt logprobs and their top-k: exact logprob of each prompt token, top-k by rank, NaN / 0 /
  -99999 outside `prompt_logprobs_last_n`, as the built-in engine lays them out.
- `target_prompt_logprobs` (prompt_scoring.py): vLLM's prompt logprobs give only a top-k and the
  prompt's own token, not chosen ones, so each prompt row that asks for tokens is one more request
  for `prompt[:row + 1]` with one greedy token and `logprob_token_ids` = the row's tokens: vLLM
  returns their raw logprobs at that position exactly (clamped at -9999, as all its logprobs). Those
  requests share the prompt's prefix in vLLM's prefix cache.
- `prompt_alt_tokens_k`: likewise one request per prompt row for `prompt[:row + 1]`, drawing k
  one-token samples at the job's temperature (no top-k, top-p), each row seeded apart from the
  others when the job has a seed (same seed, same draws; not the built-in engine's draws).

What it cannot serve, it says (`refusal`), so that the server routes those jobs to the built-in
engine instead, explicitly: prompt logprobs while vLLM runs with lm_head LoRA (its batched
prompt-logprob path crashes the CPU engine and, by the same per-request indexing, would apply
lm_head deltas to the wrong rows on GPU), and adapters that train lm_head while it runs without.

vLLM going down fails the requests in flight with a server error at once; new requests wait for
it to come back up to `outage_wait_s`, then fail. `cancel_job` (the client left) stops a job
wherever it is: waiting for vLLM, or its HTTP request to vLLM, which is closed. An adapter vLLM no longer knows (404: it
restarted unseen) is registered again and the request retried once.

Usage (accounting.py): a job is streamed from vLLM whatever its client asked for, so its tokens are counted
as they come (`SampleJob.prefilled_tokens`, `generated_tokens`; a whole answer tells nothing until its end):
one cut short (client gone, vLLM failed) is charged its prompt and what vLLM generated until then (the cost
of streaming: benchmarks/vllm_streaming.py). Except prompt logprobs, which vLLM refuses to stream: such a job
goes whole. A prompt-scoring row request is charged when answered (`SampleJob.scoring_*`), as vLLM reports
it (cached prompt tokens with `--enable-prompt-tokens-details`; without, none: logged once).
"""

from __future__ import annotations

import asyncio
import json
import logging
import math
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass

import httpx
import numpy as np

from .jobs import SampleJob, SampleResult, SequenceResult, SequenceSoFar
from .prompt_scoring import MAX_PROMPT_K, PromptAlternatives, ScoredTargets, alternatives_seed
from .vllm_adapters import AdapterUnavailable, AdapterVersion, AdapterVersions
from .vllm_sidecar import VLLMSidecar, VLLMUnavailable

log = logging.getLogger(__name__)

GREEDY_BELOW = 1e-5  # vLLM's _SAMPLING_EPS: lower temperatures sample greedily
PROMPT_ROW_REQUESTS = 8  # a job's per-row requests (target logprobs, alternative draws) in flight at once


@dataclass
class BackendStats:
    """Counters since start, named as the keys `metrics()` reports them under."""

    requests_total: int = 0  # jobs ended, answered or failed
    request_failures_total: int = 0
    request_seconds_total: float = 0.0
    tokens_generated_total: int = 0


def _topk(entries: dict[str, float], actual: int, k: int, key) -> tuple[list[int], list[float]]:
    """vLLM's logprob dict for one position -> our top-k (ids, logprobs), best first.

    vLLM lists the actual token first and then the top k, in one dict: k entries when the
    actual token is among the top k, k + 1 when it is not (then it is no part of the top k).
    """
    items = [(key(t), lp) for t, lp in entries.items()]
    if len(items) > k:
        items = [(t, lp) for t, lp in items if t != actual]
    items.sort(key=lambda x: -x[1])
    return [t for t, _ in items[:k]], [lp for _, lp in items[:k]]


def _sample_token_id(s: str) -> int:
    return int(s.rsplit(":", 1)[1])  # "token_id:123" (return_tokens_as_token_ids)


def completion_body(job: SampleJob, model: str) -> dict:
    """The `/v1/completions` body for `job` (sampling one sequence when it is greedy)."""
    greedy = job.temperature < GREEDY_BELOW
    body = {
        "model": model, "prompt": list(job.prompt), "n": 1 if greedy else job.num_samples,
        "max_tokens": job.max_tokens, "temperature": 0.0 if greedy else job.temperature,
        "top_p": job.top_p, "top_k": job.top_k if job.top_k > 0 else -1, "seed": job.seed,
        "min_p": 0.0, "repetition_penalty": 1.0, "presence_penalty": 0.0, "frequency_penalty": 0.0,
        "min_tokens": 0, "stop": list(job.stop_strings), "stop_token_ids": sorted(job.stop_token_ids),
        "ignore_eos": True, "skip_special_tokens": False, "logprobs": job.topk_sample_logprobs,
        "return_token_ids": True, "return_tokens_as_token_ids": True,
    }
    if job.prompt_logprobs or job.topk_prompt_logprobs:
        body["prompt_logprobs"] = job.topk_prompt_logprobs
    return body


def prompt_row_body(job: SampleJob, body: dict, row: int, **fields) -> dict:
    """A one-token request at prompt row `row` (predicting prompt[row + 1]) on the model of `body`."""
    return {**{k: v for k, v in body.items() if k != "prompt_logprobs"}, "prompt": list(job.prompt[:row + 1]),
            "max_tokens": 1, "stop": [], "stop_token_ids": [], "logprobs": 0, **fields}


def target_row_body(job: SampleJob, body: dict, row: int) -> dict:
    ids = sorted({int(t) for t in job.prompt_targets.ids[row] if t >= 0})
    return prompt_row_body(job, body, row, n=1, temperature=0.0, seed=None, logprob_token_ids=ids)


def alternatives_row_body(job: SampleJob, body: dict, row: int) -> dict:
    greedy = job.temperature < GREEDY_BELOW
    seed = alternatives_seed(job.seed)
    return prompt_row_body(job, body, row, n=1 if greedy else job.prompt_alt_tokens_k,
                           temperature=0.0 if greedy else job.temperature, top_k=-1, top_p=1.0,
                           seed=None if seed is None else (seed + row * MAX_PROMPT_K) % (1 << 63))


def prompt_arrays(job: SampleJob, entries: list) -> tuple:
    """vLLM's `prompt_logprobs` -> (logprobs, top-k ids, top-k logprobs) laid out as the engine's."""
    n = len(job.prompt)
    lp = np.full(n, np.nan, dtype=np.float32)
    k = job.topk_prompt_logprobs
    ids = np.zeros((n, k), dtype=np.int64) if k else None
    vals = np.full((n, k), -99999.0, dtype=np.float32) if k else None
    first_scored = 1 if job.prompt_logprobs_last_n is None else max(1, n - job.prompt_logprobs_last_n)
    for i in range(first_scored, n):
        entry = {t: v["logprob"] for t, v in entries[i].items()}
        lp[i] = entry[str(job.prompt[i])]
        if k:
            top_ids, top_lps = _topk(entry, job.prompt[i], k, int)
            ids[i, :len(top_ids)], vals[i, :len(top_lps)] = top_ids, top_lps
    return (lp if job.prompt_logprobs else None), ids, vals


class VLLMSamplingBackend:
    def __init__(self, sidecar: VLLMSidecar, adapters: AdapterVersions, *, outage_wait_s: float = 120.0,
                 max_connections: int = 512):
        """Create after `adapters` (its on_ready listener must re-register adapters before ours opens the gate)."""
        self.sidecar = sidecar
        self.adapters = adapters
        self.lora_lm_head = adapters.lora_lm_head
        self.outage_wait_s = outage_wait_s
        self.stats = BackendStats()
        self._in_flight = 0
        self._count_lock = threading.Lock()
        self._calls: dict[asyncio.Task, None] = {}  # tasks talking to vLLM right now
        self._warned_cached = False  # logged once: this vLLM does not say what its prefix cache served
        self._tasks: dict[int, asyncio.Task] = {}  # id(job) -> its task, until its answer is given
        self._pool = ThreadPoolExecutor(4, thread_name_prefix="vllm-adapters")
        self._loop = asyncio.new_event_loop()
        self._started = threading.Event()
        self._thread = threading.Thread(target=self._run_loop, args=(max_connections,), name="vllm-backend",
                                        daemon=True)
        self._thread.start()
        self._started.wait()
        sidecar.add_listener(lambda generation: self._loop.call_soon_threadsafe(self._ready.set),
                             lambda reason: self._loop.call_soon_threadsafe(self._on_down, reason))
        if sidecar.is_ready():
            self._loop.call_soon_threadsafe(self._ready.set)

    # -- any thread -----------------------------------------------------------------------------
    def refusal(self, job: SampleJob) -> str | None:
        """Why this job must go to the built-in engine instead, or None when vLLM serves it."""
        if job.pixels is not None:
            return "images are sampled by the built-in engine: the vLLM sidecar here is given text prompts only"
        if self.lora_lm_head and (job.prompt_logprobs or job.topk_prompt_logprobs):
            return ("prompt logprobs are computed by the built-in engine: vLLM runs with lm_head LoRA here, and its "
                    "batched prompt-logprob path does not support it")
        return self.adapters.refusal(job.adapter_id) if job.adapter_id is not None else None

    def submit_job(self, job: SampleJob) -> None:
        """Run `job`; its on_done / on_error / on_token are called on the backend's thread."""
        with self._count_lock:
            self._in_flight += 1
        asyncio.run_coroutine_threadsafe(self._serve(job), self._loop)

    def cancel_job(self, job: SampleJob) -> None:
        """Nobody waits for `job` any more (any thread): stop it; unless it finished first, its on_error is called."""
        job.cancelled = True
        self._loop.call_soon_threadsafe(self._cancel, id(job))

    def has_work(self) -> bool:
        return self._in_flight > 0

    def metrics(self) -> dict[str, float]:
        # In flight: submitted and not answered; at vLLM: of those, the ones sent to it (the rest wait
        # for it to be ready or for their adapter).
        return {**asdict(self.stats), "requests_in_flight": self._in_flight, "requests_at_vllm": len(self._calls),
                "restarts_total": self.sidecar.stats.restarts,
                "last_start_seconds": self.sidecar.stats.last_start_seconds, "ready": float(self.sidecar.is_ready())}

    def close(self) -> None:
        """Fail what is still running, then stop the loop."""
        async def shutdown():
            for task in list(self._tasks.values()):  # waiting for vLLM, or talking to it
                task.cancel("the server is shutting down; resubmit this request")
            await self._client.aclose()
        asyncio.run_coroutine_threadsafe(shutdown(), self._loop).result(timeout=30)
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(timeout=30)
        self._pool.shutdown(wait=False)

    # -- the backend's loop ---------------------------------------------------------------------------
    def _run_loop(self, max_connections: int) -> None:
        asyncio.set_event_loop(self._loop)
        self._ready = asyncio.Event()
        limits = httpx.Limits(max_connections=max_connections, max_keepalive_connections=64)
        # No read timeout: a long generation is legitimate, and a dead vLLM is noticed by the
        # supervisor, which cancels what is in flight (`_on_down`).
        self._client = httpx.AsyncClient(base_url=self.sidecar.url, limits=limits, trust_env=False,
                                         timeout=httpx.Timeout(None, connect=10.0))
        self._started.set()
        self._loop.run_forever()

    def _cancel(self, job_id: int) -> None:
        task = self._tasks.get(job_id)  # None: answered already, or not started (it checks job.cancelled)
        if task is not None:
            task.cancel("the request was cancelled: its client went away")

    def _on_down(self, reason: str) -> None:
        self._ready.clear()
        for task in list(self._calls):
            task.cancel(f"vLLM went down during this request ({reason}); it is being restarted, retry")

    async def _serve(self, job: SampleJob) -> None:
        start = time.perf_counter()
        task = asyncio.current_task()
        self._tasks[id(job)] = task
        failed = True
        try:
            if job.cancelled:  # before it started
                raise asyncio.CancelledError("the request was cancelled: its client went away")
            reason = self.refusal(job)
            if reason is not None:
                raise AdapterUnavailable(reason)
            await self._wait_ready()
            version = None
            if job.adapter_id is not None:
                version = await self._acquire(job.adapter_id)
            self._calls[task] = None
            try:
                result = await self._generate(job, version)
            finally:
                self._calls.pop(task, None)
                if version is not None:
                    self.adapters.release(version)
            self._tasks.pop(id(job), None)  # answered: a cancel from now on changes nothing
            failed = False
            try:
                job.on_done(result)
            except Exception as e:  # encoding the answer failed: this request fails, others go on
                log.exception("delivering a vLLM sample result failed")
                job.on_error(f"sampling failed on the server: {type(e).__name__}: {e}")
        except asyncio.CancelledError as e:
            job.on_error(str(e.args[0]) if e.args else "the request was cancelled")
        except (AdapterUnavailable, VLLMUnavailable) as e:
            job.on_error(str(e))
        except Exception as e:
            log.exception("a vLLM sampling request failed")
            job.on_error(f"sampling failed on the vLLM sidecar: {type(e).__name__}: {e}")
        finally:
            self._tasks.pop(id(job), None)
            self.stats.requests_total += 1
            self.stats.request_failures_total += failed
            self.stats.request_seconds_total += time.perf_counter() - start
            with self._count_lock:
                self._in_flight -= 1

    async def _acquire(self, adapter_ref: str) -> AdapterVersion:
        """`adapters.acquire` off the loop; a cancel while it runs releases what it acquires."""
        acquiring = self._loop.run_in_executor(self._pool, self.adapters.acquire, adapter_ref)
        try:
            return await asyncio.shield(acquiring)
        except asyncio.CancelledError:
            acquiring.add_done_callback(
                lambda f: None if f.cancelled() or f.exception() is not None else self.adapters.release(f.result()))
            raise

    async def _wait_ready(self) -> None:
        if self._ready.is_set():
            return
        try:
            await asyncio.wait_for(self._ready.wait(), self.outage_wait_s)
        except asyncio.TimeoutError:
            why = self.sidecar.stats.last_down_reason or "it is still starting"
            raise VLLMUnavailable(f"the vLLM sampler is unavailable ({why}); waited {self.outage_wait_s:.0f} s") from None

    async def _generate(self, job: SampleJob, version: AdapterVersion | None) -> SampleResult:
        body = completion_body(job, version.name if version else self.sidecar.served_model_name)
        for attempt in (0, 1):
            try:
                if "prompt_logprobs" in body:  # vLLM refuses to stream them: whole, told nothing until its end
                    choices, prompt_entries = await self._complete(body)
                else:
                    choices, prompt_entries = await self._stream(job, body), None
                break
            except _UnknownAdapter:
                if attempt or version is None:
                    raise VLLMUnavailable(f"vLLM does not know adapter {body['model']!r} even after loading it") from None
                await self._loop.run_in_executor(self._pool, self.adapters.load, version)
        sequences = []
        for c in choices:
            if c.stop_reason not in ("stop", "length"):
                raise VLLMUnavailable(f"vLLM ended a sequence with finish_reason {c.stop_reason!r}")
            sequences.append(c.result(with_topk=job.topk_sample_logprobs > 0))
        if len(sequences) < job.num_samples:  # greedy: one sequence asked for, all samples are it
            sequences = [sequences[0]] + [SequenceResult(**vars(sequences[0])) for _ in range(job.num_samples - 1)]
        lp = ids = vals = None
        if job.prompt_logprobs or job.topk_prompt_logprobs:
            lp, ids, vals = prompt_arrays(job, prompt_entries)
        targets = await self._score_targets(job, body) if job.prompt_targets is not None else None
        alternatives = await self._draw_alternatives(job, body) if job.prompt_alt_tokens_k else None
        return SampleResult(sequences=sequences, prompt_logprobs=lp, topk_prompt_ids=ids, topk_prompt_logprobs=vals,
                            target_prompt_logprobs=targets, prompt_alt_tokens=alternatives)

    async def _per_row(self, rows: list[int], request) -> list:
        """`await request(row)` for each of `rows`, a few at a time; their answers in order."""
        gate = asyncio.Semaphore(PROMPT_ROW_REQUESTS)

        async def one(row: int):
            async with gate:
                return await request(row)
        return await asyncio.gather(*(one(row) for row in rows))

    async def _score_targets(self, job: SampleJob, body: dict) -> ScoredTargets:
        targets = job.prompt_targets
        rows = targets.requested_rows()

        async def row_scores(row: int) -> dict[int, float]:
            data = await self._post_row(job, target_row_body(job, body, row))
            entries = data["choices"][0]["logprobs"]["top_logprobs"][0]
            return {_sample_token_id(t): float(lp) for t, lp in entries.items()}

        logprobs = np.zeros(targets.ids.shape, dtype=np.float32)
        for row, scores in zip(rows, await self._per_row(rows, row_scores)):
            for col, token in enumerate(targets.ids[row]):
                if token >= 0:
                    logprobs[row, col] = scores[int(token)]
        return ScoredTargets(logprobs, targets.layout)

    async def _draw_alternatives(self, job: SampleJob, body: dict) -> PromptAlternatives:
        k, rows = job.prompt_alt_tokens_k, list(range(len(job.prompt) - 1))

        async def row_draws(row: int) -> list[SequenceSoFar]:
            row_body = alternatives_row_body(job, body, row)
            choices = [SequenceSoFar() for _ in range(row_body["n"])]
            for ch in (await self._post_row(job, row_body))["choices"]:
                _add(choices[ch["index"]], ch, row_body["logprobs"])
            return choices

        tokens = np.zeros((len(rows), k), dtype=np.int64)
        logprobs = np.zeros((len(rows), k), dtype=np.float32)
        for row, choices in zip(rows, await self._per_row(rows, row_draws)):
            drawn = [c for c in choices for _ in range(k // len(choices))]  # greedy: one draw, k times
            tokens[row] = [c.tokens[0] for c in drawn]
            logprobs[row] = [c.logprobs[0] for c in drawn]
        return PromptAlternatives(tokens, logprobs)

    async def _post(self, body: dict) -> dict:
        try:
            r = await self._client.post("/v1/completions", json=body)
        except httpx.HTTPError as e:
            raise self._lost(e) from None
        self._check(r.status_code, r.text)
        return r.json()

    async def _complete(self, body: dict) -> tuple[list[SequenceSoFar], list | None]:
        data = await self._post(body)
        choices = [SequenceSoFar() for _ in range(body["n"])]
        prompt_entries = None
        for ch in data["choices"]:
            _add(choices[ch["index"]], ch, body["logprobs"])
            prompt_entries = prompt_entries or ch.get("prompt_logprobs")
        self.stats.tokens_generated_total += data["usage"]["completion_tokens"]
        return choices, prompt_entries

    async def _post_row(self, job: SampleJob, body: dict) -> dict:
        """One of `job`'s per-row prompt-scoring requests, whole (one token: nothing to stream); what vLLM says
        it computed for it is charged to `job` (`SampleJob.scoring_*`)."""
        data = await self._post(body)
        usage = data["usage"]
        cached = (usage.get("prompt_tokens_details") or {}).get("cached_tokens")
        if cached is None:
            cached = 0
            if not self._warned_cached:
                self._warned_cached = True
                log.warning("vLLM does not report the prompt tokens it takes from its prefix cache (start it with "
                            "--enable-prompt-tokens-details): prompt-scoring requests are charged as computed")
        job.scoring_prefilled_tokens += usage["prompt_tokens"] - cached
        job.scoring_cached_tokens += cached
        job.scoring_generated_tokens += usage["completion_tokens"]
        self.stats.tokens_generated_total += usage["completion_tokens"]
        return data

    async def _stream(self, job: SampleJob, body: dict) -> list[SequenceSoFar]:
        """Run `body` streamed, whatever `job`'s client asked for: what vLLM has computed is known as it comes
        (charged if the job ends unfinished, accounting.py). A streaming client's tokens go to job.on_token,
        each held back until the next, so the last carries its stop reason."""
        choices = [SequenceSoFar() for _ in range(body["n"])]
        reported = [0] * body["n"]
        try:
            async with self._client.stream("POST", "/v1/completions", json={**body, "stream": True}) as r:
                if r.status_code != 200:
                    self._check(r.status_code, (await r.aread()).decode(errors="replace"))
                async for line in r.aiter_lines():
                    if not line.startswith("data: ") or line == "data: [DONE]":
                        continue
                    chunk = json.loads(line[6:])
                    if "error" in chunk:
                        raise VLLMUnavailable(f"vLLM failed while streaming: {chunk['error']}")
                    for ch in chunk["choices"]:
                        i = ch["index"]
                        _add(choices[i], ch, body["logprobs"])
                        # What vLLM has computed so far, charged if the job ends unfinished (accounting.py).
                        new = len(ch.get("token_ids") or [])
                        job.prefilled_tokens = len(job.prompt)
                        job.generated_tokens += new
                        self.stats.tokens_generated_total += new
                        if job.on_token is not None:
                            reported[i] = _report_new(job, body, i, choices[i], reported[i])
        except httpx.HTTPError as e:
            raise self._lost(e) from None
        return choices

    def _check(self, status: int, text: str) -> None:
        if status == 200:
            return
        if status == 404 and "does not exist" in text:
            raise _UnknownAdapter()
        message = _error_message(text)
        if status >= 500:
            self.sidecar.report_failure(f"HTTP {status}: {message}")
            raise VLLMUnavailable(f"the vLLM sampler failed ({status}): {message}")
        raise VLLMUnavailable(f"the vLLM sampler refused the request ({status}): {message}")

    def _lost(self, e: Exception) -> VLLMUnavailable:
        self.sidecar.report_failure(f"{type(e).__name__}: {e}")
        return VLLMUnavailable(f"lost the connection to the vLLM sampler ({type(e).__name__}); it is being checked "
                               "and restarted if it died, retry")


class _UnknownAdapter(Exception):
    pass


def _add(c: SequenceSoFar, ch: dict, k: int) -> None:
    """Append a (whole or streamed) choice's tokens to `c`."""
    ids = ch.get("token_ids") or []
    lps = ch["logprobs"]
    for j, t in enumerate(ids):
        lp = lps["token_logprobs"][j]
        c.tokens.append(t)
        c.logprobs.append(-math.inf if lp is None else float(lp))
        if k:
            top_ids, top_lps = _topk(lps["top_logprobs"][j], t, k, _sample_token_id)
            c.topk_ids.append(top_ids)
            c.topk_logprobs.append(top_lps)
    if ch.get("finish_reason") is not None:
        c.stop_reason = ch["finish_reason"]


def _report_new(job: SampleJob, body: dict, i: int, c: SequenceSoFar, reported: int) -> int:
    """Give job.on_token sequence `i`'s tokens after the first `reported`, all but the last while `c` goes on
    (the last carries the stop reason); every sample when one greedy sequence stands for all. -> now reported."""
    repeat = job.num_samples if body["n"] == 1 else 1
    done = len(c.tokens) if c.stop_reason is not None else len(c.tokens) - 1
    for pos in range(reported, done):
        reason = c.stop_reason if c.stop_reason is not None and pos == len(c.tokens) - 1 else None
        top = (c.topk_ids[pos], c.topk_logprobs[pos]) if body["logprobs"] else (None, None)
        for copy in range(repeat):
            try:
                job.on_token(i + copy, c.tokens[pos], c.logprobs[pos], *top, reason)
            except Exception:  # a streaming consumer's failure never stops the request
                log.exception("a streaming on_token callback failed")
    return max(reported, done)


def _error_message(text: str) -> str:
    try:
        return str(json.loads(text)["error"]["message"])
    except (ValueError, KeyError, TypeError):
        return text[:300]
