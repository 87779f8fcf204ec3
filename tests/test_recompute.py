"""Activation checkpointing (issue 14: "activation checkpointing as an option"), in process:
decoder layers that recompute their activations in the backward give the very same results,
keep far less for the backward, and leave forward-only passes and sampling alone."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from tinker import types

from hosted_tinker.runtime.adapters import AdamParams, LoRAConfig
from hosted_tinker.runtime.invariance import same_bits
from hosted_tinker.runtime.recompute import RecomputeChoice, choose_recompute
from hosted_tinker.runtime.trainer import TrainingRuntime
from helpers import API_KEY, BASE_MODEL, sft_batch
from server_process import ServerProcess
from tiny_model import ce_work, random_seqs, randomize_b, tiny_qwen3

CPU = torch.device("cpu")


def _runtime(recompute: bool) -> TrainingRuntime:
    rt = TrainingRuntime(tiny_qwen3(0), "tiny-qwen3", device=CPU, recompute=RecomputeChoice(recompute, "test"))
    for i in range(2):
        randomize_b(rt.create_adapter(f"t{i}", LoRAConfig(rank=4, seed=i)), seed=i)
    return rt


def _kept_bytes(fn) -> int:
    """Bytes of the tensors autograd keeps for the backward while `fn` runs, outside recomputed
    layers (inside one, torch.utils.checkpoint keeps nothing but the layer's inputs)."""
    kept = 0

    def pack(t: torch.Tensor):
        nonlocal kept
        kept += t.numel() * t.element_size()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        fn()
    return kept


def test_recomputed_layers_give_the_same_bits_and_keep_less_for_the_backward():
    plain, recomputed = _runtime(False), _runtime(True)
    calls = {"plain": 0, "recomputed": 0}
    for name, rt in (("plain", plain), ("recomputed", recomputed)):
        rt.model.model.layers[0].mlp.register_forward_pre_hook(  # entered: a recompute stops when it has all
            lambda *_, name=name: calls.__setitem__(name, calls[name] + 1))  # it needs, before the MLP returns
    works = [ce_work(f"t{i}", random_seqs(3, 10 + i, lo=20, hi=40)) for i in range(2)]
    kept = {}
    outs = {}
    for name, rt in (("plain", plain), ("recomputed", recomputed)):
        rt.forward_backward(works)  # a first step: the policy probes new shapes (model runs of its own)
        rt.optim_steps([(f"t{i}", AdamParams(learning_rate=1e-2)) for i in range(2)])
        calls[name] = 0
        kept[name] = _kept_bytes(lambda: outs.__setitem__(name, rt.forward_backward(works)))
        rt.optim_steps([(f"t{i}", AdamParams(learning_rate=1e-2)) for i in range(2)])
    # Layer 0's MLP ran once per micro-batch, and once more in each one's backward.
    passes = plain.last_pass.micro_batches
    assert passes == recomputed.last_pass.micro_batches and calls == {"plain": passes, "recomputed": 2 * passes}
    assert kept["recomputed"] < 0.5 * kept["plain"], kept
    for a, b in zip(outs["plain"], outs["recomputed"]):
        assert a.metrics["loss:sum"] == b.metrics["loss:sum"]
        for x, y in zip(a.outputs, b.outputs):
            np.testing.assert_array_equal(x["logprobs"], y["logprobs"])
    for i in range(2):
        for (k, p), q in zip(plain.adapter(f"t{i}").named_tensors().items(),
                             recomputed.adapter(f"t{i}").named_tensors().values()):
            assert same_bits(p, q), k

    calls.update(plain=0, recomputed=0)  # forward-only: nothing to recompute
    recomputed.forward_backward([ce_work("t0", random_seqs(2, 3), forward_only=True)])
    assert calls["recomputed"] == 1


def test_the_setting_is_on_off_or_auto_and_auto_is_off_on_cpu():
    model = tiny_qwen3(0)
    assert choose_recompute("on", model, CPU, 8192).on
    assert not choose_recompute("off", model, CPU, 8192).on
    auto = choose_recompute("auto", model, CPU, 8192)
    assert not auto.on and auto.how == "auto: off on cpu"


@pytest.mark.e2e
def test_a_server_with_activation_checkpointing_trains_and_samples_as_one_without(tmp_path):
    """Through the SDK: two steps and a sample on a server started with --activation-checkpointing
    on give the same losses, grad norms and sampled tokens as a server without it."""
    results = {}
    for setting in ("on", "off"):
        srv = ServerProcess(tmp_path / setting, args=("--activation-checkpointing", setting))
        srv.start()
        try:
            with srv.client(API_KEY) as sc:
                tc = sc.create_lora_training_client(base_model=BASE_MODEL, rank=4, seed=1).result()
                steps = []
                for step in range(2):
                    fb = tc.forward_backward(sft_batch(4, seed=step), "cross_entropy").result()
                    opt = tc.optim_step(types.AdamParams(learning_rate=1e-2)).result()
                    steps.append((fb.metrics["loss:sum"], opt.metrics["grad_norm"]))
                sampler = tc.save_weights_and_get_sampling_client()
                sample = sampler.sample(types.ModelInput.from_ints([1, 2, 3]), num_samples=2,
                                        sampling_params=types.SamplingParams(max_tokens=8, seed=5)).result()
                results[setting] = (steps, [s.tokens for s in sample.sequences])
            assert f"activation checkpointing {setting} (set to {setting})" in srv.log(tail=None)
        finally:
            srv.stop()
    assert results["on"] == results["off"]
