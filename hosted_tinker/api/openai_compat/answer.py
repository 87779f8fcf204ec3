"""`Answer`: the response bodies of one plan, whole (from finished results) or as stream chunks."""

from __future__ import annotations

from ...sampling.jobs import SampleResult
from .plan import Plan
from .text import ChoiceText, TokenText, chat_logprobs, completion_logprobs


class Answer:
    def __init__(self, plan: Plan):
        self.plan = plan
        tokenizer = plan.served.tokenizer
        self.choices = [ChoiceText(tokenizer, job.prompt, job.stop_strings, job.stop_token_ids)
                        for job in plan.jobs for _ in range(plan.n)]
        self.text = TokenText(tokenizer, plan.token_ids)
        self.jobs_left = len(plan.jobs)

    def usage(self) -> dict:
        prompt = sum(len(p) for p in self.plan.prompts)
        done = sum(c.generated for c in self.choices)
        return {"prompt_tokens": prompt, "completion_tokens": done, "total_tokens": prompt + done}

    def _logprobs(self, c: ChoiceText, a: int, b: int) -> dict | None:
        if self.plan.logprobs is None:
            return None
        return (chat_logprobs if self.plan.kind == "chat" else completion_logprobs)(c, a, b, self.text)

    # -- non-streamed -------------------------------------------------------------------------------
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

    # -- streamed -----------------------------------------------------------------------------------
    def chunk(self, choices: list[dict], usage: dict | None = None) -> dict:
        obj = "chat.completion.chunk" if self.plan.kind == "chat" else "text_completion"
        body = {"id": self.plan.id, "object": obj, "created": self.plan.created, "model": self.plan.model,
                "system_fingerprint": None, "choices": choices}
        if self.plan.include_usage:
            body["usage"] = usage
        return body

    def opening(self) -> list[dict]:
        if self.plan.kind != "chat":
            return []
        return [self.chunk([{"index": i, "delta": {"role": "assistant", "content": ""}, "logprobs": None,
                             "finish_reason": None} for i in range(len(self.choices))])]

    def events(self, events: list) -> tuple[list[dict], str | None]:
        """-> (stream chunks, an error message if a job failed). Runs in a worker thread."""
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
            out.append(self.chunk([choice]))
        return out, error
