"""Sampler snapshots are known by their checkpoint's content, not by its directory (issue 10:
"a sampler checkpoint re-saved under the same name keeps serving its first weights")."""

from __future__ import annotations

import httpx
import numpy as np
import pytest
import torch
from tinker import types

from helpers import BASE_MODEL, logprobs_of, sft_batch, sft_datum
from hosted_tinker.checkpoints.adapter_io import save_checkpoint
from hosted_tinker.runtime.adapters import AdamParams, LoRAConfig
from hosted_tinker.sampling.snapshots import SnapshotCache
from tiny_model import ce_work, random_seqs, tiny_runtime

PROMPT = [11, 12, 13, 14, 15, 16]


def test_resaved_checkpoint_gets_a_new_snapshot_and_the_old_one_goes(tmp_path):
    """ensure() on a directory re-saved with new weights loads them under a new id and evicts the
    old version at once; a version still used by a running request stays until the next call."""
    rt = tiny_runtime()
    rt.create_adapter("a", LoRAConfig(rank=4, seed=1))
    cache = SnapshotCache(rt.layers, torch.device("cpu"))
    out = tmp_path / "sampler"
    save_checkpoint(rt, "a", out, with_optimizer=False)
    first = cache.ensure(out)
    assert cache.ensure(out) == first and cache.loads == 1  # unchanged content: served from memory

    rt.forward_backward([ce_work("a", random_seqs(2, 3))])
    rt.optim_step("a", AdamParams(learning_rate=1e-1))
    save_checkpoint(rt, "a", out, with_optimizer=False, overwrite=True)
    second = cache.ensure(out, keep={first})  # a running request still samples the first version
    assert second != first and cache.loads == 2 and len(cache) == 2
    live = rt.adapter("a").weights
    layer_path = next(iter(live))
    assert torch.equal(rt.layers[layer_path].adapters[second].B, live[layer_path].B)
    assert not torch.equal(rt.layers[layer_path].adapters[first].B, live[layer_path].B)

    assert cache.ensure(out) == second  # the first version is free now: it goes
    assert first not in rt.layers[layer_path].adapters and len(cache) == 1


@pytest.mark.e2e
def test_resaved_sampler_checkpoint_serves_the_new_weights(server):
    """Through the SDK: save_weights_for_sampler twice under one name with training in between;
    a fresh sampling client on that path computes the new weights' logprobs."""
    full = PROMPT + [300, 301, 302, 303]
    with server.client("tml-resave") as sc:
        tc = sc.create_lora_training_client(base_model=BASE_MODEL, rank=8, seed=5).result()
        tc.forward_backward(sft_batch(4, seed=3), "cross_entropy").result()
        tc.optim_step(types.AdamParams(learning_rate=2e-2)).result()
        path = tc.save_weights_for_sampler("resaved").result().path
        first = sc.create_sampling_client(model_path=path).result()
        old = first.compute_logprobs(types.ModelInput.from_ints(full)).result()
        before_resave = _v1_greedy(server, tc.model_id)
        for _ in range(3):  # train hard towards something else
            tc.forward_backward([sft_datum(PROMPT + [900] * 8)], "cross_entropy").result()
            tc.optim_step(types.AdamParams(learning_rate=5e-2)).result()
        assert tc.save_weights_for_sampler("resaved").result().path == path
        now = logprobs_of(tc.forward([sft_datum(full)], "cross_entropy").result())[0]
        fresh = sc.create_sampling_client(model_path=path).result()
        new = fresh.compute_logprobs(types.ModelInput.from_ints(full)).result()
        np.testing.assert_allclose(new[1:], now, atol=2e-5, rtol=0)
        assert np.abs(np.asarray(new[1:]) - np.asarray(old[1:])).max() > 1e-3  # the weights did move
        # The OpenAI API naming the run (its latest sampler weights) or the path serves them too.
        greedy = fresh.sample(types.ModelInput.from_ints(PROMPT), 1,
                              types.SamplingParams(max_tokens=4, temperature=0.0, stop=[])).result().sequences[0]
        for model in (tc.model_id, path):
            tokens, logprobs = _v1_greedy(server, model)
            assert tokens == greedy.tokens
            np.testing.assert_allclose(logprobs, greedy.logprobs, atol=2e-5, rtol=0)
        assert np.abs(np.asarray(greedy.logprobs) - np.asarray(before_resave[1])).max() > 1e-3


def _v1_greedy(server, model: str) -> tuple[list[int], list[float]]:
    r = httpx.post(f"{server.base_url}/v1/completions", headers={"Authorization": "Bearer tml-resave"},
                   json={"model": model, "prompt": PROMPT, "max_tokens": 4, "temperature": 0, "logprobs": 1,
                         "ignore_eos": True, "return_tokens_as_token_ids": True}, timeout=60)
    assert r.status_code == 200, r.text
    lp = r.json()["choices"][0]["logprobs"]
    return [int(t.split(":", 1)[1]) for t in lp["tokens"]], lp["token_logprobs"]
