"""A request -> the engine jobs that answer it: the model to sample, prompts, parameters, bounds."""

from __future__ import annotations

import math
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

from fastapi import HTTPException

from ...accounts.access import Access
from ...checkpoints.paths import SCHEME
from ...errors import NotFound
from ...sampling.jobs import SampleJob
from ...server.core import Server
from ...server.served_models import ServedModel
from ...services import checkpoint_base_model, served_model
from ...services.sampling import sample_job
from ...services.training import checkpoint_to_load
from ...models.vision import Pixels
from .images import check_takes_images, expand_images, image_part
from .schemas import ChatBody, CompletionBody, SamplingBody
from .template import render_chat

DEFAULT_MAX_TOKENS = 256
MIN_TEMPERATURE = 1e-5
MAX_LOGPROBS = 20
_ROLES = {"system", "developer", "user", "assistant", "tool"}


@dataclass
class Plan:
    kind: Literal["chat", "completion"]
    model: str
    served: ServedModel  # the base model whose sampler runs the jobs (and whose tokenizer reads them)
    prompts: list[list[int]]
    jobs: list[SampleJob]
    n: int
    logprobs: int | None  # None: no logprobs; k: k top alternatives per token
    token_ids: bool
    stream: bool
    include_usage: bool
    id: str = ""
    created: int = field(default_factory=lambda: int(time.time()))


def resolve_model(server: Server, access: Access, owner: str, model: str) -> tuple[ServedModel, str | None]:
    """`model` -> (the served base model that samples it, the jobs' `adapter_id`: None = the base
    model itself). A checkpoint or training model samples on its own base model: a checkpoint
    directory, or for a training model its current weights (as of its last completed optim_step:
    both sampling backends serve them, one version for the whole request), or, when it is not
    loaded, its latest sampler checkpoint. Call once per request."""
    if not model:
        raise HTTPException(400, "model is required")
    if model in server.models.names:
        return server.models.get(model), None
    if model.startswith(SCHEME):
        ckpt_dir = checkpoint_to_load(access, owner, model, with_optimizer=False,
                                      max_rank=server.config.max_lora_rank, purpose="sample").checkpoint_dir
        base_model = None  # the checkpoint's own, read once its folder is known to exist
    else:
        try:
            row = access.model(owner, model)
        except NotFound:
            served = ", ".join(repr(n) for n in server.models.names)
            raise NotFound(f"model {model!r} not found: use a served base model ({served}), a tinker:// sampler "
                           "path, or the id of a training model you own (GET /v1/models lists them)") from None
        own = served_model(server, row.base_model)
        current = own.sampler.current_weights_ref(model)
        if current is not None:
            return own, current
        saved = [c for c in server.store.checkpoints.live(model) if c.kind == "sampler"]  # oldest first
        if not saved:
            raise HTTPException(404, f"model {model!r} has no sampler weights yet: call "
                                     "save_weights_for_sampler(name) on its training client first")
        ckpt_dir, base_model = Path(saved[-1].dir), row.base_model
    if not ckpt_dir.is_dir():
        raise HTTPException(404, f"the weights of {model!r} were deleted")
    return served_model(server, base_model or checkpoint_base_model(ckpt_dir, model)), str(ckpt_dir)


def _check_params(server: Server, body: SamplingBody) -> None:
    cfg = server.config
    if not 1 <= body.n <= cfg.max_num_samples:
        raise HTTPException(400, f"n must be between 1 and {cfg.max_num_samples} (max_num_samples), got {body.n}")
    t = body.temperature
    if t is not None and not (math.isfinite(t) and 0 <= t <= 2):
        raise HTTPException(400, f"temperature must be between 0 and 2, got {t}")
    p = body.top_p
    if p is not None and not (math.isfinite(p) and 0 < p <= 1):
        raise HTTPException(400, f"top_p must be in (0, 1], got {p}")
    if body.max_tokens is not None and body.max_tokens < 1:
        raise HTTPException(400, f"max_tokens must be at least 1, got {body.max_tokens}")
    for name in ("presence_penalty", "frequency_penalty"):
        if getattr(body, name):
            raise HTTPException(400, f"{name} is not supported by this server; leave it unset or 0")
    if body.logit_bias:
        raise HTTPException(400, "logit_bias is not supported by this server")


def _temperature(t: float | None) -> float:
    if t is None:
        return 1.0
    # Below this, logits / t can overflow to inf (NaN probabilities): it is greedy sampling anyway.
    return 0.0 if t < MIN_TEMPERATURE else t


def _stops(body: SamplingBody) -> tuple[str, ...]:
    return (body.stop,) if isinstance(body.stop, str) else tuple(body.stop or ())


def _make_jobs(served: ServedModel, body: SamplingBody, prompts: list[list[int]], adapter: str | None,
               max_tokens: int | None, topk: int, pixels: Pixels | None = None) -> list[SampleJob]:
    """One job per prompt, each checked as a Tinker sample request's is (services/sampling.py)."""
    return [sample_job(served, prompt, max_tokens=max_tokens, default_max_tokens=DEFAULT_MAX_TOKENS,
                       top_k=-1 if body.top_k is None else body.top_k, stop_strings=_stops(body), num_samples=body.n,
                       adapter_id=adapter, temperature=_temperature(body.temperature),
                       top_p=1.0 if body.top_p is None else body.top_p, seed=body.seed,
                       stop_token_ids=frozenset() if body.ignore_eos else frozenset(served.eos_token_ids),
                       topk_sample_logprobs=topk, pixels=pixels)
            for prompt in prompts]


def _completion_prompts(server: Server, served: ServedModel, prompt: Any) -> list[list[int]]:
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
    limit = server.config.max_prompts_per_request
    if len(items) > limit:
        raise HTTPException(400, f"{len(items)} prompts in one request; the limit is {limit} "
                                 "(max_prompts_per_request): send them in several requests")
    return [served.tokenizer.encode(p, add_special_tokens=False) if isinstance(p, str) else list(p) for p in items]


def plan_completion(server: Server, access: Access, owner: str, body: CompletionBody) -> Plan:
    _check_params(server, body)
    if body.echo:
        raise HTTPException(400, "echo is not supported by this server")
    if body.suffix:
        raise HTTPException(400, "suffix is not supported by this server")
    if body.best_of is not None and body.best_of != body.n:
        raise HTTPException(400, "best_of is not supported by this server (other than best_of = n)")
    if body.logprobs is not None and not 0 <= body.logprobs <= MAX_LOGPROBS:
        raise HTTPException(400, f"logprobs must be between 0 and {MAX_LOGPROBS}, got {body.logprobs}")
    served, adapter = resolve_model(server, access, owner, body.model)
    prompts = _completion_prompts(server, served, body.prompt)
    jobs = _make_jobs(served, body, prompts, adapter, body.max_tokens, body.logprobs or 0)
    return Plan("completion", body.model, served, prompts, jobs, body.n, body.logprobs, body.return_tokens_as_token_ids,
                body.stream, bool(body.stream_options and body.stream_options.include_usage),
                id=f"cmpl-{uuid.uuid4().hex}")


def _chat_messages(messages: list[Any]) -> tuple[list[dict], list[tuple[str, bytes]]]:
    """The messages as the chat template takes them, and their images (format, data) in order."""
    if not messages:
        raise HTTPException(400, "messages must be a non-empty list")
    out, images = [], []
    for i, m in enumerate(messages):
        if not isinstance(m, dict):
            raise HTTPException(400, f"messages[{i}] must be an object with 'role' and 'content'")
        role = m.get("role")
        if not isinstance(role, str) or role not in _ROLES:
            raise HTTPException(400, f"messages[{i}].role must be one of {sorted(_ROLES)}, got {role!r}")
        content = m.get("content")
        if isinstance(content, list):
            content = _content_parts(f"messages[{i}].content", content, images)
        elif content is None:
            content = ""
        elif not isinstance(content, str):
            raise HTTPException(400, f"messages[{i}].content must be a string or a list of text and image_url parts")
        msg = {k: v for k, v in m.items() if k in ("name", "tool_calls", "tool_call_id")}
        msg.update(role="system" if role == "developer" else role, content=content)
        out.append(msg)
    return out, images


def _content_parts(where: str, content: list, images: list[tuple[str, bytes]]) -> str | list[dict]:
    """Text parts joined into one string; with an image among them, the parts as a list, each
    image an `{"type": "image"}` part where the template puts its placeholder (images.py)."""
    parts: list[dict] = []
    for j, part in enumerate(content):
        kind = part.get("type") if isinstance(part, dict) else type(part).__name__
        if kind == "image_url":
            images.append(image_part(f"{where}[{j}]", part))
            parts.append({"type": "image"})
        elif kind == "text" and isinstance(part.get("text"), str):
            parts.append({"type": "text", "text": part["text"]})
        else:
            raise HTTPException(400, f"{where}[{j}] is {kind!r}: send text and image_url parts")
    if any(p["type"] == "image" for p in parts):
        return parts
    return "\n".join(p["text"] for p in parts)


def plan_chat(server: Server, access: Access, owner: str, body: ChatBody) -> Plan:
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
    messages, images = _chat_messages(body.messages)
    served, adapter = resolve_model(server, access, owner, body.model)
    if images:
        check_takes_images(served)  # before its template sees image parts
    tok = served.tokenizer
    text = render_chat(server.config, served, body, messages)
    prompt, pixels = tok.encode(text, add_special_tokens=False), None
    if images:
        prompt, pixels = expand_images(served, prompt, images)
    jobs = _make_jobs(served, body, [prompt], adapter, max_tokens, top or 0, pixels)
    return Plan("chat", body.model, served, [prompt], jobs, body.n, (top or 0) if body.logprobs else None,
                body.return_tokens_as_token_ids, body.stream,
                bool(body.stream_options and body.stream_options.include_usage),
                id=f"chatcmpl-{uuid.uuid4().hex}")
