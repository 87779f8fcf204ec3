"""The built-in engine finds stop strings by scanning only each new token's tail (issue 26, item 4).

Against the real engine on the embedded model, in process. It once decoded every row whole and
scanned it against every stop string after every token: a row's cost grew with its length, on the
device loop's thread that every tenant shares. Now each token decodes a window as long as the
longest stop string (in bytes, plus a few tokens), and a stop string spanning several tokens still
stops the row at the same token as a scan of the whole text would.
"""

from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from hosted_tinker.models.embedded import ensure_embedded_model
from hosted_tinker.runtime.trainer import TrainingRuntime
from hosted_tinker.sampling.engine import SamplingEngine
from hosted_tinker.sampling.jobs import SampleJob

PROMPT = [11, 12, 13]


class CountingTokenizer:
    """The real tokenizer, recording how many tokens each decode is given."""

    def __init__(self, tokenizer):
        self.tokenizer = tokenizer
        self.decoded: list[int] = []

    def decode(self, ids, **kw):
        self.decoded.append(len(ids))
        return self.tokenizer.decode(ids, **kw)

    def __getattr__(self, name):
        return getattr(self.tokenizer, name)


@pytest.fixture(scope="module")
def engine(tmp_path_factory) -> SamplingEngine:
    path = ensure_embedded_model(tmp_path_factory.mktemp("models"))
    model = AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32)
    tokenizer = CountingTokenizer(AutoTokenizer.from_pretrained(str(path)))
    runtime = TrainingRuntime(model, "embedded", device=torch.device("cpu"))
    return SamplingEngine(model, runtime.routing, tokenizer, torch.device("cpu"))


def greedy(engine: SamplingEngine, max_tokens: int, stop: tuple[str, ...] = ()) -> list[int]:
    done = []
    engine.submit(SampleJob(prompt=PROMPT, num_samples=1, max_tokens=max_tokens, adapter_id=None, temperature=0.0,
                            stop_strings=stop, on_done=done.append))
    engine.run(should_yield=lambda: False, max_seconds=60.0)
    return done[0].sequences[0].tokens


def test_a_long_row_decodes_only_its_tail(engine):
    engine.tokenizer.decoded.clear()
    tokens = greedy(engine, 48, stop=("\x00never",))
    assert len(tokens) == 48
    assert max(engine.tokenizer.decoded) <= len("\x00never") + 4 < 48, engine.tokenizer.decoded


def test_a_stop_string_over_several_tokens_stops_where_a_whole_scan_would(engine):
    tokens = greedy(engine, 32)
    decode = engine.tokenizer.tokenizer.decode
    text = decode(tokens[:20])
    stop = text[-12:]  # the tail of the first 20 tokens: spans several of them
    first = next(k for k in range(1, 33) if stop in decode(tokens[:k]))  # what a scan of the whole row finds
    assert len(decode(tokens[first - 1:first])) < len(stop)  # not one token's text
    assert greedy(engine, 32, stop=(stop,)) == tokens[:first]
