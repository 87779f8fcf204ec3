"""OpenAI-compatible endpoints: `/v1/models`, `/v1/completions`, `/v1/chat/completions`.

Any OpenAI client talks to the server unchanged (`base_url=<server>/v1`, `api_key=tml-...`, sent
as `Authorization: Bearer`, which `require_owner` accepts like `X-API-Key`). `model` names what
to sample from, checked again on every request:

- the served base model's name: the base model;
- a `tinker://<run>/sampler_weights/<name>` (or `.../weights/<name>`) path the caller owns or that
  is published: that adapter, frozen as saved;
- a training model id the caller owns: its most recent sampler checkpoint.

Requests run on the built-in sampling engine (the clock-cycle thread), co-batched with Tinker
`sample` calls, bounded per request and per key like them (`services/sampling.py`). A request
whose client disconnects is cancelled: the engine drops its rows. Streaming (`stream: true`)
sends server-sent events as tokens are chosen; the text of a streamed answer is, by construction,
the same as the non-streamed one (one `ChoiceText` assembles both). Logprobs are the model's raw
ones, as Tinker's `compute_logprobs` gives them. Extensions, as vLLM spells them: `top_k`,
`ignore_eos`, `return_tokens_as_token_ids` ("token_id:<id>" token strings, so callers can recover
exact ids) and, for chat, `chat_template_kwargs` (only the variables the model's template reads; a
template sent with a request only with `--trust-request-chat-template`).

| module | job |
|---|---|
| `schemas.py` | request bodies |
| `plan.py` | a request -> engine jobs (prompts, parameters, the model to sample) |
| `template.py` | a chat request's prompt text: the chat template and what a request may set in it |
| `text.py` | one choice's text, token by token; token strings and logprobs |
| `answer.py` | the response bodies: whole, or as stream chunks |
| `channel.py` | engine events from the cycle thread to the request's coroutine |
| `routes.py` | the routes: submit, wait (or stream), cancel when the client leaves |
"""

from .routes import OpenAIErrorRoute, openai_error, router

__all__ = ["OpenAIErrorRoute", "openai_error", "router"]
