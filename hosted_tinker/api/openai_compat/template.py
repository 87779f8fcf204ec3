"""A chat request's prompt text: the chat template it renders and what a request may set in it.

A template is code that runs on the server. One sent with the request (`chat_template`, top level
or in `chat_template_kwargs`) is refused unless the operator trusts requests with
`--trust-request-chat-template`, as vLLM does. Every other `chat_template_kwargs` key reaches the
template only where the template reads that variable (Qwen3's `enable_thinking`), never one the
server or `apply_chat_template` sets itself (`messages`, `tools`, the special tokens, ...), and all
of them together are bounded in bytes (`--max-chat-template-kwargs-bytes`): the operator's template
is trusted, but it may loop over what it is given.
"""

from __future__ import annotations

import functools
import inspect
import json
from typing import Any

from fastapi import HTTPException
from jinja2 import TemplateSyntaxError, meta
from jinja2.sandbox import ImmutableSandboxedEnvironment

from ...config.settings import ServerConfig
from ...server.served_models import ServedModel
from .schemas import ChatBody

# Variables the template gets from the server, not from a request (besides apply_chat_template's
# own parameters and the tokenizer's special tokens, found at run time).
_SERVER_VARIABLES = frozenset({"messages", "raise_exception", "strftime_now"})


def render_chat(config: ServerConfig, served: ServedModel, body: ChatBody, messages: list[dict]) -> str:
    """The prompt text of `messages` under the model's chat template (or the request's, if trusted)."""
    kwargs = dict(body.chat_template_kwargs or {})
    template = _request_template(config, body, kwargs)
    tok = served.tokenizer
    if template is None:
        if not getattr(tok, "chat_template", None):
            raise HTTPException(400, f"the tokenizer of {served.name!r} has no chat template; use /v1/completions")
        try:
            template = tok.get_chat_template()
        except ValueError as e:  # several named templates, none of them the default
            raise HTTPException(400, f"the chat template of {served.name!r}: {e}") from None
    _check_kwargs(config, tok, template, kwargs)
    try:
        return tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=False, chat_template=template,
                                       **kwargs)
    except Exception as e:  # the template refused the conversation (roles out of order, ...)
        raise HTTPException(400, f"the chat template of {served.name!r} refused these messages: "
                                 f"{type(e).__name__}: {e}") from None


def _request_template(config: ServerConfig, body: ChatBody, kwargs: dict[str, Any]) -> str | None:
    """The template the request sends (taken out of `kwargs`), or None: the model's own."""
    sent = {where: t for where, t in (("chat_template", body.chat_template),
                                      ("chat_template_kwargs.chat_template", kwargs.pop("chat_template", None)))
            if t is not None}
    if not sent:
        return None
    where = next(iter(sent))
    if not config.trust_request_chat_template:
        raise HTTPException(400, f"{where}: this server does not render chat templates sent with a request "
                                 "(the operator can allow it with --trust-request-chat-template); leave it "
                                 "out to use the model's own template")
    if len(sent) > 1 or not isinstance(sent[where], str):
        raise HTTPException(400, "send one chat_template, as a string")
    template_variables(sent[where])  # a syntax error is the caller's, said here
    return sent[where]


def _check_kwargs(config: ServerConfig, tok, template: str, kwargs: dict[str, Any]) -> None:
    if not kwargs:
        return
    limit = config.max_chat_template_kwargs_bytes
    size = len(json.dumps(kwargs).encode())
    if size > limit:
        raise HTTPException(400, f"chat_template_kwargs is {size} bytes as JSON; the limit is {limit} "
                                 "(max_chat_template_kwargs_bytes)")
    server_set = _SERVER_VARIABLES | set(inspect.signature(tok.apply_chat_template).parameters) | \
        set(tok.special_tokens_map)
    settable = sorted(template_variables(template) - server_set)
    for key in kwargs:
        if key in server_set:
            raise HTTPException(400, f"chat_template_kwargs.{key} is set by the server, not by a request")
        if key not in settable:
            raise HTTPException(400, f"chat_template_kwargs.{key}: the chat template does not read {key!r}; "
                                     f"it reads {settable or 'no request variables'}")


@functools.lru_cache(maxsize=16)  # the served models' templates (and a trusted request's, up to a body each)
def template_variables(template: str) -> frozenset[str]:
    """The variables `template` reads but does not set itself (its inputs)."""
    env = ImmutableSandboxedEnvironment()
    try:
        parsed = env.parse(template)
    except TemplateSyntaxError as e:
        raise HTTPException(400, f"chat_template is not a valid Jinja template: {e}") from None
    return frozenset(meta.find_undeclared_variables(parsed) - env.globals.keys())
