"""The vLLM sidecar started without lm_head LoRA: prompt logprobs are served by vLLM (batched, without
crashing it), with the built-in engine's values and layout; adapters that train lm_head are refused
(vLLM would silently drop their lm_head part) so the server can route them to the built-in engine.
"""

from __future__ import annotations

import concurrent.futures as cf

import numpy as np
import pytest
from vllm_support import WAIT, StackConfig, job, stop_stack

from hosted_tinker.checkpoints.adapter_io import save_checkpoint
from hosted_tinker.sampling.vllm_adapters import latest_ref

PROMPT = [5, 77, 300, 12, 900, 40, 41, 42]


VLLM_STACK = StackConfig(lora_lm_head=False)


@pytest.fixture(scope="module")
def stack(vllm_stacks):
    s = vllm_stacks.take(VLLM_STACK)
    yield s
    stop_stack(s)


def _same(ours, theirs, what):
    for name in ("prompt_logprobs", "topk_prompt_logprobs"):
        a, b = getattr(ours, name), getattr(theirs, name)
        assert (a is None) == (b is None), (what, name)
        if a is not None:
            np.testing.assert_allclose(b, a, atol=1e-4, equal_nan=True, err_msg=f"{what}: {name}")
    a, b = ours.topk_prompt_ids, theirs.topk_prompt_ids
    assert (a is None) == (b is None), what
    if a is not None:
        np.testing.assert_array_equal(b, a, err_msg=what)


def test_prompt_logprobs_match_the_builtin_engine(stack):
    stack.create("m-attn", train_unembed=False)
    step = stack.train_step("m-attn", PROMPT[:4], PROMPT[4:])
    assert stack.adapters.wait_synced("m-attn", step, WAIT)
    cases = {
        "prompt logprobs (compute_logprobs)": dict(prompt_logprobs=True),
        "top-k prompt logprobs only": dict(topk_prompt_logprobs=3),
        "both, last 3 positions": dict(prompt_logprobs=True, topk_prompt_logprobs=2, prompt_logprobs_last_n=3),
    }
    for what, kw in cases.items():
        for adapter, runtime_id in ((latest_ref("m-attn"), "m-attn"), (None, None)):
            ours = stack.builtin(job(PROMPT, max_tokens=1, temperature=0.0, **kw), runtime_id)
            theirs = stack.vllm(job(PROMPT, adapter, max_tokens=1, temperature=0.0, **kw))
            _same(ours, theirs, f"{what}, {adapter}")
            assert theirs.sequences[0].tokens == ours.sequences[0].tokens
    # compute_logprobs' values are training's forward.
    lp = stack.vllm(job(PROMPT, latest_ref("m-attn"), max_tokens=1, prompt_logprobs=True)).prompt_logprobs
    np.testing.assert_allclose(lp[1:], stack.forward_logprobs("m-attn", PROMPT), atol=1e-4)


def test_batched_prompt_logprobs_keep_vllm_alive(stack):
    generation = stack.sidecar.generation
    jobs = [job(PROMPT[: 3 + i], latest_ref("m-attn") if i % 2 else None, max_tokens=2, prompt_logprobs=True)
            for i in range(6)]
    with cf.ThreadPoolExecutor(6) as ex:
        results = list(ex.map(stack.vllm, jobs))
    assert all(r.prompt_logprobs is not None for r in results)
    assert stack.sidecar.is_ready() and stack.sidecar.generation == generation


def test_adapters_that_train_lm_head_are_refused(stack, tmp_path):
    stack.create("m-head")  # train_unembed=True
    stack.train_step("m-head", PROMPT[:4], PROMPT[4:])
    assert stack.adapters.flush(WAIT)
    assert "lm_head" in stack.backend.refusal(job(PROMPT, latest_ref("m-head")))
    snap = tmp_path / "snap"
    save_checkpoint(stack.runtime, "m-head", snap, with_optimizer=False)
    assert "lm_head" in stack.backend.refusal(job(PROMPT, str(snap)))
    with pytest.raises(AssertionError, match="built-in engine"):
        stack.vllm(job(PROMPT, str(snap)))
    assert stack.backend.refusal(job(PROMPT, latest_ref("m-attn"))) is None
