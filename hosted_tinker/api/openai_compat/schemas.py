"""Request bodies of the OpenAI endpoints, and the one way they are read (malformed is a 400, as OpenAI answers)."""

from __future__ import annotations

from typing import Any

from fastapi import HTTPException, Request
from pydantic import BaseModel, ConfigDict, ValidationError, field_validator

from ..limits import parse_json
from ..schemas import fits_int64


class _Strict(BaseModel):
    model_config = ConfigDict(extra="ignore", protected_namespaces=())

    @field_validator("n", "stream", "echo", "logprobs", "return_tokens_as_token_ids", "ignore_eos", mode="before",
                     check_fields=False)
    @classmethod
    def _null_is_default(cls, v, info):  # OpenAI clients may send an explicit null for "the default"
        return cls.model_fields[info.field_name].default if v is None else v

    @field_validator("*", mode="after")
    @classmethod
    def _fits_int64(cls, value: Any) -> Any:  # what numpy and torch hold (a top_k of 2**63 was a 500)
        return fits_int64(value)


class StreamOptions(_Strict):
    include_usage: bool = False


class SamplingBody(_Strict):
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
    ignore_eos: bool = False
    return_tokens_as_token_ids: bool = False


class CompletionBody(SamplingBody):
    prompt: Any = None
    logprobs: int | None = None
    echo: bool = False
    best_of: int | None = None
    suffix: str | None = None


class ChatBody(SamplingBody):
    messages: list[Any]
    max_completion_tokens: int | None = None
    logprobs: bool | None = False
    top_logprobs: int | None = None
    tools: list[Any] | None = None
    functions: list[Any] | None = None
    tool_choice: Any = None
    response_format: dict[str, Any] | None = None
    chat_template: Any = None  # vLLM's field: refused unless trusted (template.py)
    chat_template_kwargs: dict[str, Any] | None = None


async def parse_body(request: Request, cls: type[_Strict]) -> Any:
    """The JSON body as `cls`; anything malformed is a 400 (OpenAI's status), not FastAPI's 422."""
    data = parse_json(await request.body())
    if not isinstance(data, dict):
        raise HTTPException(400, "the request body must be a JSON object")
    try:
        return cls.model_validate(data)
    except ValidationError as e:
        problems = "; ".join(f"{'.'.join(str(p) for p in err['loc']) or 'body'}: {err['msg']}" for err in e.errors())
        raise HTTPException(400, f"invalid request: {problems}") from None
