"""The multi-LoRA runtime in process on a tiny Qwen3 built in the test (no files, no server), and
what the runtime-level tests feed it: requests, sequences, adapters with non-zero B."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from hosted_tinker.requests.kinds import DatumWork, FBWork
from hosted_tinker.runtime.adapters import LoRAAdapter
from hosted_tinker.runtime.trainer import TrainingRuntime

TINY_VOCAB = 128
CPU = torch.device("cpu")


@pytest.fixture(autouse=True, scope="module")
def one_torch_thread():
    """Tiny matrices: one intra-op thread avoids OpenMP spin contention on small shared CPUs.
    (An autouse fixture of every module that imports it.)"""
    prev = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(prev)


def tiny_qwen3(seed: int = 0) -> torch.nn.Module:
    """A 2-layer, hidden-32, vocab-128 Qwen3ForCausalLM with weights fixed by `seed` (fp32, eval)."""
    from transformers import Qwen3Config, Qwen3ForCausalLM

    cfg = Qwen3Config(vocab_size=TINY_VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, head_dim=8,
                      max_position_embeddings=64, tie_word_embeddings=False)
    torch.manual_seed(seed)
    return Qwen3ForCausalLM(cfg).float().eval()


def tiny_runtime(seed: int = 0) -> TrainingRuntime:
    return TrainingRuntime(tiny_qwen3(seed), "tiny-qwen3", device=CPU)


def randomize_b(adapter: LoRAAdapter, seed: int, std: float = 0.2) -> None:
    """Give an adapter non-zero B factors so it actually changes the model's outputs."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for w in adapter.weights.values():
            w.B.copy_(torch.randn(w.B.shape, generator=gen) * std)


def logits(rt: TrainingRuntime, ids: torch.Tensor, segments) -> torch.Tensor:
    with rt.routing.batch(segments), torch.no_grad():
        return rt.model(input_ids=ids, use_cache=False).logits


def ce_work(model_id: str, seqs: list[list[int]], *, forward_only: bool = False) -> FBWork:
    """A cross_entropy request: each sequence predicts itself shifted by one."""
    data = []
    for s in seqs:
        toks = np.asarray(s, dtype=np.int64)
        data.append(DatumWork(tokens=toks[:-1], inputs={
            "target_tokens": toks[1:], "weights": np.linspace(0.5, 1.5, len(toks) - 1).astype(np.float32)}))
    return FBWork(model_id=model_id, data=data, loss_fn="cross_entropy", loss_config={},
                  forward_only=forward_only)


def random_seqs(n: int, seed: int, lo: int = 4, hi: int = 12) -> list[list[int]]:
    rng = np.random.default_rng(seed)
    return [rng.integers(0, TINY_VOCAB, int(rng.integers(lo, hi))).tolist() for _ in range(n)]


def grads(adapter: LoRAAdapter) -> dict[str, torch.Tensor | None]:
    return {k: (None if v.grad is None else v.grad.clone()) for k, v in adapter.named_tensors().items()}


def tiny_decoder(kind: str, *, layers: int = 2, experts: int = 4, dtype: torch.dtype = torch.float32,
                 vocab: int = 1024, seed: int = 0) -> torch.nn.Module:
    """A random hidden-64 Qwen3 ("dense") or Qwen3-MoE ("moe": `experts` experts of 32, top-2)
    with `layers` layers, in `dtype`, eval: the bodies of the step audits and precision tests
    (random_work's token ids stay below 1000)."""
    import transformers as tf

    dims = dict(vocab_size=vocab, hidden_size=64, num_hidden_layers=layers, num_attention_heads=4,
                num_key_value_heads=2, head_dim=16, intermediate_size=128, tie_word_embeddings=False)
    torch.manual_seed(seed)
    if kind == "dense":
        model = tf.Qwen3ForCausalLM(tf.Qwen3Config(**dims))
    else:
        model = tf.Qwen3MoeForCausalLM(tf.Qwen3MoeConfig(**dims, moe_intermediate_size=32, num_experts=experts,
                                                         num_experts_per_tok=2))
        with torch.no_grad():  # transformers leaves 3-D expert weights uninitialised
            for p in model.parameters():
                if p.dim() == 3:
                    p.normal_(0, 0.1)
    return model.to(dtype).eval()
