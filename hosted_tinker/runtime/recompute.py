"""Activation checkpointing: decoder layers recompute their activations in the backward.

A training pass keeps every decoder layer's activations until its backward: about 34 x hidden
bytes per token per layer in 16-bit (Korthikanti et al., "Reducing Activation Recomputation in
Large Transformer Models", 2022, with attention in a fused kernel). For a Qwen3-8B-shaped model
(36 x 4096) and an 8192-token micro-batch that is ~41 GB, more than what is left of an 80 GB
GPU beside the base model and 16 tenants' adapters. With recomputation a layer keeps only its
input, and runs its forward again inside the backward (torch.utils.checkpoint, non-reentrant):
about a third more compute for a fraction of the memory.

`--activation-checkpointing` chooses it (`choose_recompute`): on, off, or auto -- on where the
estimate above for a full micro-batch exceeds half of the device's free memory after the base
model is loaded (CUDA only; on CPU, memory is the machine's and auto is off).

Recomputation changes no result: the forward runs again on the same inputs with the same kernels
and gives the same bits, so gradients equal those of a pass without it, bit for bit.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import partial

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

# Bytes per token per layer of a 16-bit decoder layer's kept activations, in units of hidden size.
ACTIVATION_BYTES_PER_HIDDEN = 34
AUTO_FREE_MEMORY_FRACTION = 0.5


@dataclass(frozen=True)
class RecomputeChoice:
    on: bool
    how: str  # why, for the start-up summary


RECOMPUTE_OFF = RecomputeChoice(False, "off")


def decoder_layers(model: nn.Module) -> list[nn.Module]:
    """The model's repeated decoder layers: the `ModuleList` of the transformer body
    (`model.model.layers` in Qwen, Llama, Mistral and most decoder-only families)."""
    body = getattr(model, "model", model)
    layers = getattr(body, "layers", None)
    if not isinstance(layers, nn.ModuleList) or not len(layers):
        raise ValueError(f"found no decoder layers (model.layers) in {type(model).__name__} to recompute")
    return list(layers)


def recompute_activations(model: nn.Module) -> None:
    """Make every decoder layer recompute its activations in the backward of a training pass
    (grad enabled, no KV cache); sampling (no grad, with a cache) runs it as before. Its `forward`
    is wrapped, not its `__call__`, so module hooks (FSDP2's, with a sharded base) stay outside."""
    for layer in decoder_layers(model):
        layer.forward = partial(_forward_recomputed, layer.forward)


def _forward_recomputed(forward, *args, **kwargs):
    if torch.is_grad_enabled() and not kwargs.get("use_cache"):
        # No RNG state to keep (eval mode: no dropout), and none to save inside a CUDA graph capture.
        return checkpoint(forward, *args, use_reentrant=False, preserve_rng_state=False, **kwargs)
    return forward(*args, **kwargs)


def activation_bytes(model: nn.Module, tokens: int) -> int:
    """The estimate above: activations a pass over `tokens` tokens keeps without recomputation."""
    config = getattr(model.config, "text_config", model.config)
    return ACTIVATION_BYTES_PER_HIDDEN * config.hidden_size * config.num_hidden_layers * tokens


def choose_recompute(setting: str, model: nn.Module, device: torch.device, micro_batch_tokens: int) -> RecomputeChoice:
    """What `--activation-checkpointing setting` ("auto", "on" or "off") means for `model` on `device`."""
    if setting != "auto":
        return RecomputeChoice(setting == "on", f"set to {setting}")
    if device.type != "cuda":
        return RecomputeChoice(False, f"auto: off on {device.type}")
    need = activation_bytes(model, micro_batch_tokens)
    free, _ = torch.cuda.mem_get_info(device)
    on = need > free * AUTO_FREE_MEMORY_FRACTION
    return RecomputeChoice(on, f"auto: a {micro_batch_tokens}-token micro-batch keeps ~{need / 2**30:.1f} GiB of "
                               f"activations, {'more' if on else 'less'} than half the {free / 2**30:.1f} GiB free")
