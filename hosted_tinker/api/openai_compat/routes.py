"""The OpenAI routes: plan a request, submit its jobs, then answer whole or stream it, and cancel
whatever its client no longer waits for."""

from __future__ import annotations

import asyncio
import json
import time
from pathlib import Path
from typing import Awaitable, Callable, TypeVar

import anyio
from fastapi import APIRouter, Depends, HTTPException, Request
from fastapi.concurrency import run_in_threadpool
from fastapi.responses import Response
from fastapi.routing import APIRoute
from sse_starlette import EventSourceResponse, ServerSentEvent

from ...accounts.access import Access
from ...checkpoints.paths import TinkerPath
from ...errors import UserError
from ...sampling.jobs import UserFailure
from ...server.core import Server
from ...services.sampling import SamplingRequests
from ..deps import get_access, get_sampling, get_server, require_owner
from .answer import Answer
from .channel import Channel
from .plan import Plan, plan_chat, plan_completion, resolve_model
from .schemas import ChatBody, CompletionBody, parse_body

T = TypeVar("T")
_ERROR_TYPES = {400: "invalid_request_error", 401: "authentication_error", 403: "permission_error",
                404: "not_found_error", 413: "invalid_request_error", 429: "rate_limit_error"}


class OpenAIErrorRoute(APIRoute):
    """A route whose error bodies (api/app.py writes them) carry `{"error": {"message", "type", ...}}`, the
    body OpenAI clients read the message from (the openai SDK shows nothing else in its exception text),
    beside this server's `detail`."""


def openai_error(message: str, status_code: int) -> dict:
    """The `error` object of an OpenAI error body."""
    kind = "server_error" if status_code >= 500 else _ERROR_TYPES.get(status_code, "invalid_request_error")
    return {"message": message, "type": kind, "param": None, "code": None}


router = APIRouter(route_class=OpenAIErrorRoute)


def _model_card(model_id: str, created: float, owned_by: str, base: str | None) -> dict:
    card = {"id": model_id, "object": "model", "created": int(created), "owned_by": owned_by}
    if base is not None:
        card.update(root=base, parent=base)
    return card


@router.get("/v1/models")
def list_models(owner: str = Depends(require_owner), server: Server = Depends(get_server)):
    """The served base models, then the caller's unexpired sampler checkpoints of them, newest first."""
    served = server.models.names
    data = [_model_card(name, server.started_at, "hosted-tinker", None) for name in served]
    rows, _ = server.store.checkpoints.live_page(owner, limit=1 << 30, offset=0)
    base_of_run: dict[str, str | None] = {}  # a run's checkpoints are all of its base model
    for c in rows:
        if c.kind != "sampler" or not Path(c.dir).is_dir():
            continue
        if c.model_id not in base_of_run:
            run = server.store.runs.get(c.model_id)
            base_of_run[c.model_id] = None if run is None else run.base_model
        base = base_of_run[c.model_id]
        if base in served:  # others cannot be sampled here
            path = TinkerPath.of_record(c.model_id, c.checkpoint_id)
            data.append(_model_card(str(path), c.created_at, owner, base))
    return {"object": "list", "data": data}


@router.get("/v1/models/{model:path}")
def get_model(model: str, owner: str = Depends(require_owner), server: Server = Depends(get_server),
              access: Access = Depends(get_access)):
    served, adapter = resolve_model(server, access, owner, model)
    if adapter is None:
        return _model_card(served.name, server.started_at, "hosted-tinker", None)
    # A training model's current weights have no directory: they are as new as now.
    created = Path(adapter).stat().st_mtime if Path(adapter).is_dir() else time.time()
    return _model_card(model, created, owner, served.name)


@router.post("/v1/completions")
async def completions(request: Request, owner: str = Depends(require_owner), server: Server = Depends(get_server),
                      access: Access = Depends(get_access), sampling: SamplingRequests = Depends(get_sampling)):
    body = await parse_body(request, CompletionBody)
    plan = await run_in_threadpool(plan_completion, server, access, owner, body)
    return await _answer(request, sampling, owner, plan)


@router.post("/v1/chat/completions")
async def chat_completions(request: Request, owner: str = Depends(require_owner),
                           server: Server = Depends(get_server), access: Access = Depends(get_access),
                           sampling: SamplingRequests = Depends(get_sampling)):
    body = await parse_body(request, ChatBody)
    plan = await run_in_threadpool(plan_chat, server, access, owner, body)
    return await _answer(request, sampling, owner, plan)


# -- running a plan ---------------------------------------------------------------------------------

def _submit(sampling: SamplingRequests, owner: str, plan: Plan, channel: Channel) -> None:
    """Queue the plan's jobs, their events going to `channel` (400 or 429 before any is queued)."""
    for j, job in enumerate(plan.jobs):
        base = j * plan.n
        job.on_done = lambda result, j=j: channel.put(("done", j, result))
        job.on_error = lambda message: channel.put(("error", message))
        if plan.stream:
            job.on_token = (lambda i, t, lp, ti, tl, reason, base=base:
                            channel.put(("tok", base + i, t, lp, ti, tl, reason)))
    sampling.submit_jobs(owner, plan.served, plan.jobs)


def _stop(plan: Plan, channel: Channel) -> None:
    """Nobody reads this plan's events any more: unfinished jobs are cancelled (finished ones ignore it)."""
    channel.close()
    for job in plan.jobs:
        plan.served.sampler.cancel(job)


async def _unless_client_leaves(request: Request, work: Callable[[], Awaitable[T]]) -> tuple[bool, T | None]:
    """(True, what `work` returned), or (False, None) if the client disconnected first.

    The request's body has been read, so the next ASGI message is the client's disconnect.
    """
    finished, result = False, None
    async with anyio.create_task_group() as tg:
        async def watch() -> None:
            while (await request.receive())["type"] != "http.disconnect":
                pass
            tg.cancel_scope.cancel()

        tg.start_soon(watch)
        result = await work()
        finished = True
        tg.cancel_scope.cancel()
    return finished, result


def _job_failed(message: str) -> Exception:
    """A failed job's answer: a 400 where its own request caused the failure (`UserFailure`), else a 500."""
    return UserError(message) if isinstance(message, UserFailure) else HTTPException(500, message)


def _event(body: dict | str) -> ServerSentEvent:
    return ServerSentEvent(data=body if isinstance(body, str) else json.dumps(body, separators=(",", ":")))


async def _answer(request: Request, sampling: SamplingRequests, owner: str, plan: Plan):
    channel = Channel(asyncio.get_running_loop())
    answer = Answer(plan)
    await run_in_threadpool(_submit, sampling, owner, plan, channel)  # it decodes the plan's images
    if plan.stream:
        return await _streamed_answer(request, plan, channel, answer)
    return await _whole_answer(request, plan, channel, answer)


async def _whole_answer(request: Request, plan: Plan, channel: Channel, answer: Answer):
    """One JSON answer once every job is done; the first failure fails the request."""
    results: list = [None] * len(plan.jobs)

    async def collect() -> str | None:  # -> an error message, if a job failed
        left = len(plan.jobs)
        while left:
            for ev in await channel.get():
                if ev[0] == "error":
                    return ev[1]
                results[ev[1]] = ev[2]
                left -= 1
        return None

    try:
        stayed, error = await _unless_client_leaves(request, collect)
    finally:
        _stop(plan, channel)
    if not stayed:
        return Response(status_code=499)  # "client closed request": nobody reads it
    if error is not None:
        raise _job_failed(error)
    return await run_in_threadpool(answer.from_results, results)


async def _streamed_answer(request: Request, plan: Plan, channel: Channel, answer: Answer):
    """Server-sent events as tokens come. It waits for the first tokens before answering, so that a
    request that fails at once (unreadable weights) is an HTTP error rather than a broken stream."""
    try:
        stayed, first = await _unless_client_leaves(request, channel.get)
    except BaseException:
        _stop(plan, channel)
        raise
    if not stayed:
        _stop(plan, channel)
        return Response(status_code=499)
    chunks, error = await run_in_threadpool(answer.events, first)
    if error is not None:
        _stop(plan, channel)
        raise _job_failed(error)

    async def stream():
        nonlocal chunks, error
        try:
            for body in answer.opening():
                yield _event(body)
            while True:
                for body in chunks:
                    yield _event(body)
                if error is not None:
                    kind = "invalid_request_error" if isinstance(error, UserFailure) else "server_error"
                    yield _event({"error": {"message": error, "type": kind, "code": None}})
                    return
                if answer.jobs_left == 0:
                    break
                chunks, error = await run_in_threadpool(answer.events, await channel.get())
            if plan.include_usage:
                yield _event(answer.chunk([], answer.usage()))
            yield _event("[DONE]")
        finally:  # also when the client disconnects (sse-starlette cancels this generator)
            _stop(plan, channel)

    return EventSourceResponse(stream(), sep="\n")
