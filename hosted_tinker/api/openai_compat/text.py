"""The text of one choice, token by token, and the token strings and logprobs OpenAI clients read."""

from __future__ import annotations

import math

from tokenizers.decoders import DecodeStream


class ChoiceText:
    """One choice's text, assembled token by token, with OpenAI's stop semantics.

    Incremental detokenization is the tokenizer's own `DecodeStream` (it holds back incomplete
    UTF-8, and starts from the end of the prompt so that a first token's leading space survives).
    The text is cut before the first stop string and, while streaming, as much text is held back
    as could still turn out to be the start of one. `feed` returns what became final; everything it
    returns, joined, is the answer, so a streamed answer equals a non-streamed one. The stop token
    that ended the sequence (EOS) is no part of the answer or of its logprobs.
    """

    CONTEXT = 6  # prompt tokens the stream starts after

    def __init__(self, tokenizer, prompt: list[int], stop_strings: tuple[str, ...], stop_ids: frozenset[int]):
        self.tok = tokenizer.backend_tokenizer
        self.stream = DecodeStream(ids=list(prompt[-self.CONTEXT:]), skip_special_tokens=True)
        self.held: list[int] = []  # tokens fed since the stream last gave text (an incomplete character)
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
            piece = self.stream.step(self.tok, token)
            if piece is None:
                self.held.append(token)
            else:
                self.held.clear()
                self._add_text(piece)
        final = stop_reason is not None or self.cut
        if final:
            if not self.cut and self.held:  # the answer ends inside a character: as a full decode shows it
                self._add_text(self.tok.decode(self.held, skip_special_tokens=True))
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


class TokenText:
    """Token strings for logprobs, cached per id ("token_id:<id>" when the client asked for ids)."""

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


def chat_logprobs(c: ChoiceText, a: int, b: int, text: TokenText) -> dict:
    """Chat completions' `logprobs` of answer tokens a..b."""
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


def completion_logprobs(c: ChoiceText, a: int, b: int, text: TokenText) -> dict:
    """Completions' `logprobs` of answer tokens a..b."""
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
