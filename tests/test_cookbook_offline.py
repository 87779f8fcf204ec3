"""tinker-cookbook against our tiny model, offline, by real hub names (no server needed).

Why: the server's end-to-end tests drive the cookbook's recipes, which load tokenizers with
``get_tokenizer("Qwen/Qwen3-8B")``, pick renderers from their model table and build datums
from ``HuggingFaceH4/no_robots``. This checks that the fake hub cache from ``offline_hub``
satisfies all of that without network, and that our chat template and the cookbook's Qwen3
renderers agree token for token (so the OpenAI-compatible path and the Tinker path see the
same prompts).

huggingface_hub/datasets read HF_HOME and the offline flags at import time, so the checks run
in one subprocess (this file executed as a script) with ``offline_env``; the tests assert on
the JSON report it prints. Skipped when tinker-cookbook is not installed
(``tools/install_cookbook.sh`` installs it).
"""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from offline_hub import install_fake_hub_model, install_fake_no_robots, offline_env

MODELS = {
    # name -> renderer the cookbook's model table recommends
    "Qwen/Qwen3-8B": "qwen3",
    "Qwen/Qwen3-4B-Instruct-2507": "qwen3_instruct",
    "Qwen/Qwen3-8B-Base": "role_colon",
}
N_TRAIN, N_TEST = 48, 16

pytestmark = pytest.mark.skipif(
    importlib.util.find_spec("tinker_cookbook") is None,
    reason="tinker-cookbook not installed (run tools/install_cookbook.sh)",
)


@pytest.fixture(scope="module")
def report(tmp_path_factory) -> dict:
    hf_home = tmp_path_factory.mktemp("hf_home")
    for name in MODELS:
        install_fake_hub_model(hf_home, name)
    install_fake_no_robots(hf_home, N_TRAIN, N_TEST)
    env = {**os.environ, **offline_env(hf_home)}
    proc = subprocess.run(
        [sys.executable, __file__], env=env, capture_output=True, text=True, timeout=300,
        cwd=Path(__file__).parent,
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


def test_get_tokenizer_loads_the_tiny_tokenizer_by_hub_name(report):
    tok = report["tokenizer"]
    assert tok["class"] == "Qwen2Tokenizer"
    assert tok["len"] == 1024
    assert tok["eos_token"] == "<|im_end|>"
    assert tok["pad_token"] == "<|endoftext|>"
    assert tok["name_or_path"] == "Qwen/Qwen3-8B"


def test_recommended_renderers(report):
    assert {n: r["renderer"] for n, r in report["renderers"].items()} == MODELS


def test_renderers_match_the_chat_template(report):
    # The thinking and instruct templates must equal what the Qwen3 renderers produce:
    # generation prompts, and whole conversations (with the final assistant turn).
    for name in ("Qwen/Qwen3-8B", "Qwen/Qwen3-4B-Instruct-2507"):
        r = report["renderers"][name]
        assert r["generation_prompt_matches_template"], r
        assert r["supervised_matches_template"], r
    assert report["renderers"]["Qwen/Qwen3-8B"]["disable_thinking_matches_template"]


def test_renderers_parse_their_stop_token(report):
    for name, r in report["renderers"].items():
        assert r["parsed"] == {"role": "assistant", "content": "Hello there."}, name
    # Qwen3 renderers stop on one token id (<|im_end|>); role_colon on a string.
    im_end_id = report["tokenizer"]["im_end_id"]
    assert report["renderers"]["Qwen/Qwen3-8B"]["stop"] == [im_end_id]
    assert report["renderers"]["Qwen/Qwen3-4B-Instruct-2507"]["stop"] == [im_end_id]
    assert report["renderers"]["Qwen/Qwen3-8B-Base"]["stop"] == ["\n\nUser:"]


def test_no_robots_loads_offline(report):
    ds = report["no_robots"]
    assert ds["splits"] == {"train": N_TRAIN, "test": N_TEST}
    assert set(ds["columns"]) == {"prompt", "prompt_id", "messages", "category"}


def test_conversation_to_datum_for_no_robots(report):
    d = report["datums"]
    assert d["count"] == N_TRAIN
    assert d["min_trained_tokens"] > 0
    assert d["max_length_respected"]


def test_model_loads_by_hub_name(report):
    assert report["model"]["class"] == "Qwen3ForCausalLM"
    assert report["model"]["vocab_size"] == 1024


# ---------------------------------------------------------------------------------------------
# The subprocess side: run with the offline environment, print one JSON line.
# ---------------------------------------------------------------------------------------------
def _checks() -> dict:
    import datasets
    import transformers
    from tinker_cookbook import model_info, renderers
    from tinker_cookbook.renderers import TrainOnWhat
    from tinker_cookbook.supervised.data import conversation_to_datum
    from tinker_cookbook.tokenizer_utils import get_tokenizer

    out: dict = {}
    tok = get_tokenizer("Qwen/Qwen3-8B")
    out["tokenizer"] = {
        "class": type(tok).__name__, "len": len(tok), "eos_token": tok.eos_token,
        "pad_token": tok.pad_token, "name_or_path": tok.name_or_path,
        "im_end_id": tok.convert_tokens_to_ids("<|im_end|>"),
    }

    convo = [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "What is 2 + 3?"},
        {"role": "assistant", "content": "It is 5."},
        {"role": "user", "content": "And 4 + 4?"},
        {"role": "assistant", "content": "It is 8."},
    ]

    def template_ids(t, messages, **kw) -> list[int]:
        text = t.apply_chat_template(messages, tokenize=False, **kw)
        return t.encode(text, add_special_tokens=False)

    out["renderers"] = {}
    for name in MODELS:
        t = get_tokenizer(name)
        renderer_name = model_info.get_recommended_renderer_name(name)
        renderer = renderers.get_renderer(renderer_name, t)
        prompt = renderer.build_generation_prompt(convo[:-1]).to_ints()
        model_input, weights = renderer.build_supervised_example(convo)
        full = model_input.to_ints()
        stop = renderer.get_stop_sequences()
        if isinstance(stop[0], int):  # Qwen3 renderers stop on the <|im_end|> token id
            reply = t.encode("Hello there.", add_special_tokens=False) + [stop[0]]
        else:  # role_colon stops on the *string* "\n\nUser:"
            reply = t.encode(" Hello there." + stop[0], add_special_tokens=False)
        parsed, _ = renderer.parse_response(reply)
        info = {
            "renderer": renderer_name,
            "stop": stop,
            "parsed": {"role": parsed["role"], "content": parsed["content"]},
            "trained_tokens": int(sum(weights)),
        }
        if renderer_name.startswith("qwen3"):
            info["generation_prompt_matches_template"] = prompt == template_ids(
                t, convo[:-1], add_generation_prompt=True)
            # The template appends "\n" after the final <|im_end|>; the renderer stops at it.
            info["supervised_matches_template"] = full == template_ids(t, convo)[:-1]
        if renderer_name == "qwen3":
            nothink = renderers.get_renderer("qwen3_disable_thinking", t)
            info["disable_thinking_matches_template"] = (
                nothink.build_generation_prompt(convo[:-1]).to_ints()
                == template_ids(t, convo[:-1], add_generation_prompt=True, enable_thinking=False)
            )
        out["renderers"][name] = info

    ds = datasets.load_dataset("HuggingFaceH4/no_robots")
    out["no_robots"] = {
        "splits": {k: len(v) for k, v in ds.items()},
        "columns": ds["train"].column_names,
    }

    renderer = renderers.get_renderer("qwen3", tok)
    max_length = 64
    datums = [conversation_to_datum(row["messages"], renderer, max_length,
                                    TrainOnWhat.ALL_ASSISTANT_MESSAGES)
              for row in ds["train"]]
    out["datums"] = {
        "count": len(datums),
        "min_trained_tokens": min(
            sum(1 for w in d.loss_fn_inputs["weights"].tolist() if w > 0) for d in datums),
        "max_length_respected": all(d.model_input.length <= max_length for d in datums),
    }

    model = transformers.AutoModelForCausalLM.from_pretrained("Qwen/Qwen3-8B")
    out["model"] = {"class": type(model).__name__, "vocab_size": model.config.vocab_size}
    return out


if __name__ == "__main__":
    import logging

    logging.disable(logging.WARNING)  # datasets warns that it uses the cache (expected here)
    print(json.dumps(_checks()))
