"""OpenAI-compatible endpoints: `/v1/models`, `/v1/completions`, `/v1/chat/completions`.

Any OpenAI client talks to the server unchanged (`base_url=<server>/v1`, `api_key=tml-...`, sent
as `Authorization: Bearer`, which `require_owner` accepts like `X-API-Key`). `model` names what
to sample from:

- the served base model's name: the base model;
- a `tinker://<run>/sampler_weights/<name>` (or `.../weights/<name>`) path the caller owns or that
  is published: that adapter, frozen as saved;
- a training model id the caller owns: its most recent sampler checkpoint.

Requests run on the built-in sampling engine (the clock-cycle thread), co-batched with Tinker
`sample` calls. Streaming (`stream: true`) sends server-sent events as tokens are chosen; the
text of a streamed answer is, by construction, the same as the non-streamed one (one
`_ChoiceText` assembles both). Logprobs are the model's raw ones, as Tinker's `compute_logprobs`
gives them. Extensions, as vLLM spells them: `top_k`, `return_tokens_as_token_ids` ("token_id:<id>"
token strings, so callers can recover exact ids) and, for chat, `chat_template_kwargs`.
"""

from __future__ import annotations

import asyncio
import json
import math
import time
import uuid
from collections import deque
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

from fastapi import APIRouter, Depends, HTTPException, Request
from fastapi.concurrency import run_in_threadpool
from fastapi.responses import JSONResponse, StreamingResponse
from fastapi.routing import APIRoute
from pydantic import BaseModel, ConfigDict, ValidationError, field_validator

from ..checkpoints.paths import SCHEME, TinkerPath
from ..sampling.engine import SampleJob, SampleResult
from ..server import Server
from .deps import get_server, require_owner
from .training import _checkpoint_for_load

_ERROR_TYPES = {400: "invalid_request_error", 401: "authentication_error", 403: "permission_error",
                404: "not_found_error", 413: "invalid_request_error"}


class _OpenAIErrorRoute(APIRoute):
    """Errors as `{"error": {"message", "type", ...}}`, the body OpenAI clients read the message from
    (the openai SDK shows nothing else in its exception text), keeping this server's `detail` too."""

    def get_route_handler(self):
        handler = super().get_route_handler()

        async def route(request: Request):
            try:
                return await handler(request)  # dependencies (auth) run in here too
            except HTTPException as e:
                message = str(e.detail or "error")
                kind = ("server_error" if e.status_code >= 500
                        else _ERROR_TYPES.get(e.status_code, "invalid_request_error"))
                return JSONResponse({"detail": message, "error": {"message": message, "type": kind, "param": None,
                                                                   "code": None}},
                                    status_code=e.status_code, headers=getattr(e, "headers", None))

        return route


router = APIRouter(route_class=_OpenAIErrorRoute)

DEFAULT_MAX_TOKENS = 256
MIN_TEMPERATURE = 1e-5
MAX_LOGPROBS = 20
_ROLES = {"system", "developer", "user", "assistant", "tool"}


# -- request bodies ---------------------------------------------------------------------------------

class _Strict(BaseModel):
    model_config = ConfigDict(extra="ignore", protected_namespaces=())

    @field_validator("n", "stream", "echo", "logprobs", "return_tokens_as_token_ids", mode="before", check_fields=False)
    @classmethod
    def _null_is_default(cls, v, info):  # OpenAI clients may send an explicit null for "the default"
        return cls.model_fields[info.field_name].default if v is None else v


class StreamOptions(_Strict):
    include_usage: bool = False


class _SamplingBody(_Strict):
    model: str
    n: int = 1
    max_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    seed: int | None = None
    stop: str | list[str] | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    logit_bias: dict[str, float] | None = None
    # extensions (vLLM's names)
    top_k: int | None = None
    return_tokens_as_token_ids: bool = False


class CompletionBody(_SamplingBody):
    prompt: Any = None
    logprobs: int | None = None
    echo: bool = False
    best_of: int | None = None
    suffix: str | None = None


class ChatBody(_SamplingBody):
    messages: list[Any]
    max_completion_tokens: int | None = None
    logprobs: bool | None = False
    top_logprobs: int | None = None
    tools: list[Any] | None = None
    functions: list[Any] | None = None
    tool_choice: Any = None
    response_format: dict[str, Any] | None = None
    chat_template_kwargs: dict[str, Any] | None = None


async def _parse(request: Request, cls: type[_Strict]) -> Any:
    """The JSON body as `cls`; anything malformed is a 400 (OpenAI's status), not FastAPI's 422."""
    try:
        data = await request.json()
    except (json.JSONDecodeError, UnicodeDecodeError):
        raise HTTPException(400, "the request body is not valid JSON") from None
    if not isinstance(data, dict):
        raise HTTPException(400, "the request body must be a JSON object")
    try:
        return cls.model_validate(data)
    except ValidationError as e:
        problems = "; ".join(f"{'.'.join(str(p) for p in err['loc']) or 'body'}: {err['msg']}" for err in e.errors())
        raise HTTPException(400, f"invalid request: {problems}") from None


# -- model resolution -------------------------------------------------------------------------------

def resolve_model(server: Server, owner: str, model: str) -> str | None:
    """`model` -> the adapter checkpoint directory to sample from (None = the base model)."""
    if not model:
        raise HTTPException(400, "model is required")
    if model == server.config.base_model:
        return None
    if model.startswith(SCHEME):
        ckpt_dir = _checkpoint_for_load(server, owner, model, with_optimizer=False).checkpoint_dir
    else:
        row = server.store.get_model(model)
        if row is None or row["owner"] != owner:
            raise HTTPException(404, f"model {model!r} not found: use {server.config.base_model!r}, a tinker:// "
                                     "sampler path, or the id of a training model you own (GET /v1/models lists them)")
        saved = [c for c in server.store.live_checkpoints(model) if c["kind"] == "sampler"]  # oldest first
        if not saved:
            raise HTTPException(404, f"model {model!r} has no sampler weights yet: call "
                                     "save_weights_for_sampler(name) on its training client first")
        ckpt_dir = Path(saved[-1]["dir"])
    if not ckpt_dir.is_dir():
        raise HTTPException(404, f"the weights of {model!r} were deleted")
    return str(ckpt_dir)


def _model_card(model_id: str, created: float, owned_by: str, base: str | None) -> dict:
    card = {"id": model_id, "object": "model", "created": int(created), "owned_by": owned_by}
    if base is not None:
        card.update(root=base, parent=base)
    return card


@router.get("/v1/models")
def list_models(owner: str = Depends(require_owner), server: Server = Depends(get_server)):
    """The base model, then the caller's unexpired sampler checkpoints, newest first."""
    base = server.config.base_model
    data = [_model_card(base, server.started_at, "hosted-tinker", None)]
    rows, _ = server.store.owner_checkpoints(owner, limit=1 << 30, offset=0)
    for c in rows:
        if c["kind"] == "sampler" and Path(c["dir"]).is_dir():
            path = TinkerPath.of_record(c["model_id"], c["checkpoint_id"])
            data.append(_model_card(str(path), c["created_at"], owner, base))
    return {"object": "list", "data": data}


@router.get("/v1/models/{model:path}")
def get_model(model: str, owner: str = Depends(require_owner), server: Server = Depends(get_server)):
    base = server.config.base_model
    if model == base:
        return _model_card(base, server.started_at, "hosted-tinker", None)
    ckpt = resolve_model(server, owner, model)
    return _model_card(model, Path(ckpt).stat().st_mtime, owner, base)


# -- turning a request into engine jobs -------------------------------------------------------------

@dataclass
class _Plan:
    kind: Literal["chat", "completion"]
    model: str
    prompts: list[list[int]]
    jobs: list[SampleJob]
    n: int
    logprobs: int | None  # None: no logprobs; k: k top alternatives per token
    token_ids: bool
    stream: bool
    include_usage: bool
    id: str = ""
    created: int = field(default_factory=lambda: int(time.time()))


def _check_params(server: Server, body: _SamplingBody) -> None:
    cfg = server.config
    if not 1 <= body.n <= cfg.max_num_samples:
        raise HTTPException(400, f"n must be between 1 and {cfg.max_num_samples}, got {body.n}")
    t = body.temperature
    if t is not None and not (math.isfinite(t) and 0 <= t <= 2):
        raise HTTPException(400, f"temperature must be between 0 and 2, got {t}")
    p = body.top_p
    if p is not None and not (math.isfinite(p) and 0 < p <= 1):
        raise HTTPException(400, f"top_p must be in (0, 1], got {p}")
    if body.top_k is not None and (body.top_k == 0 or body.top_k < -1):
        raise HTTPException(400, f"top_k must be -1 (no limit) or >= 1, got {body.top_k}")
    if body.max_tokens is not None and body.max_tokens < 1:
        raise HTTPException(400, f"max_tokens must be at least 1, got {body.max_tokens}")
    for name in ("presence_penalty", "frequency_penalty"):
        if getattr(body, name):
            raise HTTPException(400, f"{name} is not supported by this server; leave it unset or 0")
    if body.logit_bias:
        raise HTTPException(400, "logit_bias is not supported by this server")
    stops = [body.stop] if isinstance(body.stop, str) else (body.stop or [])
    if any(s == "" for s in stops):
        raise HTTPException(400, "stop strings must not be empty")


def _temperature(t: float | None) -> float:
    if t is None:
        return 1.0
    # Below this, logits / t can overflow to inf (NaN probabilities): it is greedy sampling anyway.
    return 0.0 if t < MIN_TEMPERATURE else t


def _stops(body: _SamplingBody) -> tuple[str, ...]:
    return (body.stop,) if isinstance(body.stop, str) else tuple(body.stop or ())


def _make_jobs(server: Server, body: _SamplingBody, prompts: list[list[int]], adapter: str | None,
               max_tokens: int | None, topk: int) -> list[SampleJob]:
    runtime = server.runtime
    jobs = []
    for prompt in prompts:
        if not prompt:
            raise HTTPException(400, "the prompt is empty")
        bad = [t for t in prompt if not 0 <= t < runtime.vocab_size]
        if bad:
            raise HTTPException(400, f"prompt token {bad[0]} is outside the vocabulary [0, {runtime.vocab_size})")
        room = runtime.max_context - len(prompt)
        if room < 1:
            raise HTTPException(400, f"the prompt has {len(prompt)} tokens: no room left in the model's context of "
                                     f"{runtime.max_context} tokens")
        if max_tokens is not None and max_tokens > room:
            raise HTTPException(400, f"the prompt ({len(prompt)} tokens) plus max_tokens ({max_tokens}) exceeds the "
                                     f"model's context of {runtime.max_context} tokens")
        jobs.append(SampleJob(
            prompt=prompt, num_samples=body.n, max_tokens=max_tokens or min(DEFAULT_MAX_TOKENS, room),
            adapter_id=adapter, temperature=_temperature(body.temperature),
            top_k=body.top_k if body.top_k is not None else -1, top_p=1.0 if body.top_p is None else body.top_p,
            seed=body.seed, stop_token_ids=frozenset(server.eos_token_ids), stop_strings=_stops(body),
            topk_sample_logprobs=topk))
    return jobs


def _completion_prompts(server: Server, prompt: Any) -> list[list[int]]:
    """str | list[str] | list[int] | list[list[int]] -> token id lists."""
    def is_ids(x):
        return isinstance(x, list) and x and all(isinstance(t, int) and not isinstance(t, bool) for t in x)

    if isinstance(prompt, str):
        items: list = [prompt]
    elif is_ids(prompt):
        items = [prompt]
    elif isinstance(prompt, list) and prompt and all(isinstance(p, str) or is_ids(p) for p in prompt):
        items = prompt
    else:
        raise HTTPException(400, "prompt must be a non-empty string, a list of strings, a list of token ids, "
                                 "or a list of token id lists")
    return [server.tokenizer.encode(p, add_special_tokens=False) if isinstance(p, str) else list(p) for p in items]


def _plan_completion(server: Server, owner: str, body: CompletionBody) -> _Plan:
    _check_params(server, body)
    if body.echo:
        raise HTTPException(400, "echo is not supported by this server")
    if body.suffix:
        raise HTTPException(400, "suffix is not supported by this server")
    if body.best_of is not None and body.best_of != body.n:
        raise HTTPException(400, "best_of is not supported by this server (other than best_of = n)")
    if body.logprobs is not None and not 0 <= body.logprobs <= MAX_LOGPROBS:
        raise HTTPException(400, f"logprobs must be between 0 and {MAX_LOGPROBS}, got {body.logprobs}")
    adapter = resolve_model(server, owner, body.model)
    prompts = _completion_prompts(server, body.prompt)
    jobs = _make_jobs(server, body, prompts, adapter, body.max_tokens, body.logprobs or 0)
    return _Plan("completion", body.model, prompts, jobs, body.n, body.logprobs, body.return_tokens_as_token_ids,
                 body.stream, bool(body.stream_options and body.stream_options.include_usage),
                 id=f"cmpl-{uuid.uuid4().hex}")


def _chat_messages(messages: list[Any]) -> list[dict]:
    if not messages:
        raise HTTPException(400, "messages must be a non-empty list")
    out = []
    for i, m in enumerate(messages):
        if not isinstance(m, dict):
            raise HTTPException(400, f"messages[{i}] must be an object with 'role' and 'content'")
        role = m.get("role")
        if role not in _ROLES:
            raise HTTPException(400, f"messages[{i}].role must be one of {sorted(_ROLES)}, got {role!r}")
        content = m.get("content")
        if isinstance(content, list):
            texts = []
            for j, part in enumerate(content):
                if not isinstance(part, dict) or part.get("type") != "text" or not isinstance(part.get("text"), str):
                    kind = part.get("type") if isinstance(part, dict) else type(part).__name__
                    raise HTTPException(400, f"messages[{i}].content[{j}] is {kind!r}: this server hosts text-only "
                                             "models; send text parts")
                texts.append(part["text"])
            content = "\n".join(texts)
        elif content is None:
            content = ""
        elif not isinstance(content, str):
            raise HTTPException(400, f"messages[{i}].content must be a string or a list of text parts")
        msg = {k: v for k, v in m.items() if k in ("name", "tool_calls", "tool_call_id")}
        msg.update(role="system" if role == "developer" else role, content=content)
        out.append(msg)
    return out


def _plan_chat(server: Server, owner: str, body: ChatBody) -> _Plan:
    _check_params(server, body)
    if body.tools or body.functions:
        raise HTTPException(400, "tools and functions are not supported by this server")
    if body.tool_choice not in (None, "none"):
        raise HTTPException(400, "tool_choice is not supported by this server")
    if body.response_format and body.response_format.get("type", "text") != "text":
        raise HTTPException(400, "response_format other than {'type': 'text'} is not supported by this server")
    top = body.top_logprobs
    if top is not None and not body.logprobs:
        raise HTTPException(400, "top_logprobs needs logprobs: true")
    if top is not None and not 0 <= top <= MAX_LOGPROBS:
        raise HTTPException(400, f"top_logprobs must be between 0 and {MAX_LOGPROBS}, got {top}")
    max_tokens = body.max_completion_tokens if body.max_completion_tokens is not None else body.max_tokens
    if max_tokens is not None and max_tokens < 1:
        raise HTTPException(400, f"max_completion_tokens must be at least 1, got {max_tokens}")
    messages = _chat_messages(body.messages)
    adapter = resolve_model(server, owner, body.model)
    tok = server.tokenizer
    if not getattr(tok, "chat_template", None):
        raise HTTPException(400, f"the tokenizer of {server.config.base_model!r} has no chat template; "
                                 "use /v1/completions")
    try:
        text = tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=False,
                                       **(body.chat_template_kwargs or {}))
    except Exception as e:  # the template refused the conversation (roles out of order, ...)
        raise HTTPException(400, f"the chat template of {server.config.base_model!r} refused these messages: "
                                 f"{type(e).__name__}: {e}") from None
    prompt = tok.encode(text, add_special_tokens=False)
    jobs = _make_jobs(server, body, [prompt], adapter, max_tokens, top or 0)
    return _Plan("chat", body.model, [prompt], jobs, body.n, (top or 0) if body.logprobs else None,
                 body.return_tokens_as_token_ids, body.stream,
                 bool(body.stream_options and body.stream_options.include_usage),
                 id=f"chatcmpl-{uuid.uuid4().hex}")


# -- text of one choice -----------------------------------------------------------------------------

class _ChoiceText:
    """One choice's text, assembled token by token, with OpenAI's stop semantics.

    Incremental detokenization (decode a sliding window, hold back incomplete UTF-8), the text cut
    before the first stop string, and, while streaming, as much text held back as could still turn
    out to be the start of one. `feed` returns what became final; everything it returns, joined,
    is the answer, so a streamed answer equals a non-streamed one. The stop token that ended the
    sequence (EOS) is no part of the answer or of its logprobs.
    """

    CONTEXT = 6  # prompt tokens the window starts with, so a first token's leading space survives

    def __init__(self, tokenizer, prompt: list[int], stop_strings: tuple[str, ...], stop_ids: frozenset[int]):
        self.tok = tokenizer
        self.ids = list(prompt[-self.CONTEXT:])
        self.prefix_offset, self.read_offset = 0, len(self.ids)
        self.stop_strings = stop_strings
        self.hold = max((len(s) for s in stop_strings), default=1) - 1
        self.stop_ids = stop_ids
        self.text = ""
        self.emitted = 0
        self.tokens: list[int] = []
        self.offsets: list[int] = []  # where each answer token's text starts in self.text
        self.logprobs: list[float] = []
        self.top: list[tuple[list[int], list[float]] | None] = []
        self.released = 0  # answer tokens handed out
        self.generated = 0
        self.cut = False
        self.finish_reason: str | None = None

    def _decode(self, ids: list[int]) -> str:
        return self.tok.decode(ids, skip_special_tokens=True)

    def _add_text(self, delta: str) -> None:
        start = max(0, len(self.text) - self.hold)
        self.text += delta
        if self.stop_strings:
            hits = [i for i in (self.text.find(s, start) for s in self.stop_strings) if i >= 0]
            if hits:
                self.text, self.cut = self.text[:min(hits)], True

    def feed(self, token: int, logprob: float, top_ids, top_lps, stop_reason: str | None) -> tuple[str, int, int]:
        """-> (new final text, first and end index of the answer tokens released with it)."""
        self.generated += 1
        if self.finish_reason is not None:
            return "", self.released, self.released
        if not self.cut and not (stop_reason == "stop" and token in self.stop_ids):
            self.offsets.append(len(self.text))
            self.tokens.append(token)
            self.logprobs.append(logprob)
            self.top.append((top_ids, top_lps) if top_ids is not None else None)
            self.ids.append(token)
            prefix = self._decode(self.ids[self.prefix_offset:self.read_offset])
            new = self._decode(self.ids[self.prefix_offset:])
            if len(new) > len(prefix) and not new.endswith("\ufffd"):
                self.prefix_offset, self.read_offset = self.read_offset, len(self.ids)
                self._add_text(new[len(prefix):])
        final = stop_reason is not None or self.cut
        if final:
            if not self.cut:  # flush what was held back as incomplete UTF-8
                prefix = self._decode(self.ids[self.prefix_offset:self.read_offset])
                new = self._decode(self.ids[self.prefix_offset:])
                if len(new) > len(prefix):
                    self._add_text(new[len(prefix):])
            self.finish_reason = "stop" if self.cut else stop_reason
            end = len(self.text)
        else:
            end = max(self.emitted, len(self.text) - (self.hold if self.stop_strings else 0))
        out, self.emitted = self.text[self.emitted:end], end
        first = self.released
        if final and not self.cut:
            self.released = len(self.tokens)
        else:
            while self.released < len(self.tokens) and self.offsets[self.released] < end:
                self.released += 1
        return out, first, self.released


class _TokenText:
    """Token strings for logprobs, cached per id."""

    def __init__(self, tokenizer, as_ids: bool):
        self.tok = tokenizer
        self.as_ids = as_ids
        self.cache: dict[int, str] = {}

    def __call__(self, t: int) -> str:
        if self.as_ids:
            return f"token_id:{t}"
        s = self.cache.get(t)
        if s is None:
            s = self.cache[t] = self.tok.decode([t], skip_special_tokens=False)
        return s


def _lp(x: float) -> float:
    return x if math.isfinite(x) else -9999.0  # JSON has no -inf


def _chat_logprobs(c: _ChoiceText, a: int, b: int, text: _TokenText) -> dict:
    content = []
    for i in range(a, b):
        s = text(c.tokens[i])
        top = []
        if c.top[i] is not None:
            for t, lp in zip(*c.top[i]):
                ts = text(t)
                top.append({"token": ts, "logprob": _lp(lp), "bytes": list(ts.encode())})
        content.append({"token": s, "logprob": _lp(c.logprobs[i]), "bytes": list(s.encode()), "top_logprobs": top})
    return {"content": content, "refusal": None}


def _completion_logprobs(c: _ChoiceText, a: int, b: int, text: _TokenText) -> dict:
    tokens, lps, tops = [], [], []
    for i in range(a, b):
        s = text(c.tokens[i])
        tokens.append(s)
        lps.append(_lp(c.logprobs[i]))
        top: dict[str, float] = {}
        if c.top[i] is not None:
            for t, lp in zip(*c.top[i]):
                top.setdefault(text(t), _lp(lp))
        top.setdefault(s, _lp(c.logprobs[i]))  # like OpenAI: the sampled token is always there
        tops.append(top)
    return {"tokens": tokens, "token_logprobs": lps, "top_logprobs": tops, "text_offset": c.offsets[a:b]}


# -- running a plan ---------------------------------------------------------------------------------

class _Channel:
    """Events from the cycle thread to one request's coroutine, waking the event loop once per batch."""

    def __init__(self, loop: asyncio.AbstractEventLoop):
        self._loop = loop
        self._items: deque = deque()
        self._event = asyncio.Event()
        self._armed = False
        self.closed = False

    def put(self, item) -> None:  # any thread
        if self.closed:
            return
        self._items.append(item)
        if not self._armed:
            self._armed = True
            try:
                self._loop.call_soon_threadsafe(self._wake)
            except RuntimeError:  # the loop is gone: the server is shutting down
                pass

    def _wake(self) -> None:
        self._armed = False
        self._event.set()

    async def get(self) -> list:
        while not self._items:
            self._event.clear()
            if self._items:
                break
            await self._event.wait()
        out = []
        while self._items:
            out.append(self._items.popleft())
        return out

    def close(self) -> None:  # the consumer left (client disconnected): drop whatever comes
        self.closed = True
        self._items.clear()


def _submit(server: Server, plan: _Plan, channel: _Channel, stream: bool) -> None:
    for j, job in enumerate(plan.jobs):
        base = j * plan.n
        job.on_done = lambda result, j=j: channel.put(("done", j, result))
        job.on_error = lambda message: channel.put(("error", message))
        if stream:
            job.on_token = (lambda i, t, lp, ti, tl, reason, base=base:
                            channel.put(("tok", base + i, t, lp, ti, tl, reason)))
        server.sampler.submit_job(job)


class _Answer:
    """Assembles the choices of one plan, from streamed tokens or from finished results."""

    def __init__(self, server: Server, plan: _Plan):
        self.plan = plan
        self.choices = [_ChoiceText(server.tokenizer, job.prompt, job.stop_strings, job.stop_token_ids)
                        for job in plan.jobs for _ in range(plan.n)]
        self.text = _TokenText(server.tokenizer, plan.token_ids)
        self.jobs_left = len(plan.jobs)

    def usage(self) -> dict:
        prompt = sum(len(p) for p in self.plan.prompts)
        done = sum(c.generated for c in self.choices)
        return {"prompt_tokens": prompt, "completion_tokens": done, "total_tokens": prompt + done}

    def _logprobs(self, c: _ChoiceText, a: int, b: int) -> dict | None:
        if self.plan.logprobs is None:
            return None
        return (_chat_logprobs if self.plan.kind == "chat" else _completion_logprobs)(c, a, b, self.text)

    # non-streamed
    def from_results(self, results: list[SampleResult]) -> dict:
        choices = []
        for j, result in enumerate(results):
            for i, seq in enumerate(result.sequences):
                idx = j * self.plan.n + i
                c = self.choices[idx]
                parts = []
                for k, t in enumerate(seq.tokens):
                    top = (seq.topk_ids[k], seq.topk_logprobs[k]) if seq.topk_ids is not None else (None, None)
                    last = k == len(seq.tokens) - 1
                    parts.append(c.feed(t, seq.logprobs[k], *top, seq.stop_reason if last else None)[0])
                text, lps = "".join(parts), self._logprobs(c, 0, c.released)
                if self.plan.kind == "chat":
                    choices.append({"index": idx, "message": {"role": "assistant", "content": text},
                                    "logprobs": lps, "finish_reason": c.finish_reason})
                else:
                    choices.append({"index": idx, "text": text, "logprobs": lps, "finish_reason": c.finish_reason})
        obj = "chat.completion" if self.plan.kind == "chat" else "text_completion"
        return {"id": self.plan.id, "object": obj, "created": self.plan.created, "model": self.plan.model,
                "system_fingerprint": None, "choices": choices, "usage": self.usage()}

    # streamed
    def _chunk(self, choices: list[dict], usage: dict | None = None) -> str:
        obj = "chat.completion.chunk" if self.plan.kind == "chat" else "text_completion"
        body = {"id": self.plan.id, "object": obj, "created": self.plan.created, "model": self.plan.model,
                "system_fingerprint": None, "choices": choices}
        if self.plan.include_usage:
            body["usage"] = usage
        return f"data: {json.dumps(body, separators=(',', ':'))}\n\n"

    def opening(self) -> list[str]:
        if self.plan.kind != "chat":
            return []
        return [self._chunk([{"index": i, "delta": {"role": "assistant", "content": ""}, "logprobs": None,
                              "finish_reason": None} for i in range(len(self.choices))])]

    def events(self, events: list) -> tuple[list[str], str | None]:
        """-> (SSE chunks, an error message if a job failed). Runs in a worker thread."""
        pending: dict[int, list] = {}  # choice -> [new text, first and end index of its released tokens]
        error = None
        for ev in events:
            if ev[0] == "tok":
                _, idx, t, lp, ti, tl, reason = ev
                text, a, b = self.choices[idx].feed(t, lp, ti, tl, reason)
                p = pending.get(idx)
                if p is None:
                    pending[idx] = [text, a, b]
                else:
                    p[0] += text
                    p[2] = b
            elif ev[0] == "done":
                self.jobs_left -= 1
            elif ev[0] == "error":
                error = ev[1]
        out = []
        for idx, (text, a, b) in pending.items():
            c = self.choices[idx]
            if not text and a == b and c.finish_reason is None:
                continue
            lps = self._logprobs(c, a, b)
            if self.plan.kind == "chat":
                delta = {"content": text} if text or c.finish_reason is None else {}
                choice = {"index": idx, "delta": delta, "logprobs": lps, "finish_reason": c.finish_reason}
            else:
                choice = {"index": idx, "text": text, "logprobs": lps, "finish_reason": c.finish_reason}
            out.append(self._chunk([choice]))
        return out, error


def _error_event(message: str) -> str:
    return "data: " + json.dumps({"error": {"message": message, "type": "server_error", "code": None}}) + "\n\n"


async def _run(server: Server, plan: _Plan):
    loop = asyncio.get_running_loop()
    channel = _Channel(loop)
    answer = _Answer(server, plan)
    if not plan.stream:
        _submit(server, plan, channel, stream=False)
        results: list[SampleResult | None] = [None] * len(plan.jobs)
        left = len(plan.jobs)
        try:
            while left:
                for ev in await channel.get():
                    if ev[0] == "error":
                        raise HTTPException(500, ev[1])
                    results[ev[1]] = ev[2]
                    left -= 1
        finally:
            channel.close()
        return await run_in_threadpool(answer.from_results, results)

    _submit(server, plan, channel, stream=True)
    # Wait for the first tokens before answering, so a request that fails at once (unreadable
    # weights) is an HTTP error rather than a broken stream.
    try:
        first = await channel.get()
    except BaseException:
        channel.close()
        raise
    chunks, error = await run_in_threadpool(answer.events, first)
    if error is not None:
        channel.close()
        raise HTTPException(500, error)

    async def sse():
        nonlocal chunks, error
        try:
            for c in answer.opening():
                yield c
            while True:
                for c in chunks:
                    yield c
                if error is not None:
                    yield _error_event(error)
                    return
                if answer.jobs_left == 0:
                    break
                chunks, error = await run_in_threadpool(answer.events, await channel.get())
            if plan.include_usage:
                yield answer._chunk([], answer.usage())
            yield "data: [DONE]\n\n"
        finally:  # also on a client disconnect: the job runs to its end, its output is dropped
            channel.close()

    return StreamingResponse(sse(), media_type="text/event-stream",
                             headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})


@router.post("/v1/completions")
async def completions(request: Request, owner: str = Depends(require_owner),
                      server: Server = Depends(get_server)):
    body = await _parse(request, CompletionBody)
    plan = await run_in_threadpool(_plan_completion, server, owner, body)
    return await _run(server, plan)


@router.post("/v1/chat/completions")
async def chat_completions(request: Request, owner: str = Depends(require_owner),
                           server: Server = Depends(get_server)):
    body = await _parse(request, ChatBody)
    plan = await run_in_threadpool(_plan_chat, server, owner, body)
    return await _run(server, plan)
