"""FSDP2 for the base model (`--shard-base`): its weights sharded across the pool's ranks.

`fully_shard` is applied to every decoder layer and to the root (embeddings, final norm,
lm_head), after the multi-LoRA layers are attached: FSDP manages the frozen base projections
(`MultiLoRALinear.base`) and all-gathers each unit's weights just before it runs; the adapters'
slot stacks are not parameters, so every rank keeps a full copy of them (the pool keeps them
equal, runtime/distributed.py).

FSDP needs every rank in every all-gather, in the same order. The pool arranges that: each rank
runs the same number of gradient and of forward-only micro-batches (idle ones where its share is
short), rank 0's sampling and probe calls are mirrored by the other ranks, and here every
backward is made to reach every layer (`_inputs_need_grad`).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager

import torch
from torch import nn
from torch.distributed.fsdp import fully_shard

from .moe_lora import ExpertProjection
from .multi_lora import MultiLoRALinear, attach_multi_lora
from .projections import discover


def decoder_layers(model: nn.Module) -> nn.ModuleList:
    """The stack of decoder layers (`model.model.layers` in Qwen, Llama, Mistral ...; the text
    decoder's in a vision-language model, whose vision tower stays in the root unit: a forward
    with images then all-gathers what one without does, so ranks with and without images pair up)."""
    decoder = model.get_decoder() if hasattr(model, "get_decoder") else getattr(model, "model", None)
    layers = getattr(decoder, "layers", None)
    if isinstance(layers, nn.ModuleList) and len(layers):
        return layers
    lists = [m for m in model.modules() if isinstance(m, nn.ModuleList) and len(m)]
    if not lists:
        raise ValueError(f"{type(model).__name__} has no list of decoder layers to shard")
    return max(lists, key=len)


def shard_base(model: nn.Module, mesh) -> None:
    """Shard the (frozen, LoRA-attached) model over `mesh`, one FSDP unit per decoder layer plus the root.

    Resharding after forward also for the root (FSDP keeps the root's weights gathered until the
    backward by default): then every forward and every backward all-gathers every unit, whether a
    micro-batch has a backward or not, so ranks running different kinds of passes stay in step.
    """
    for layer in decoder_layers(model):
        fully_shard(layer, mesh=mesh, reshard_after_forward=True)
    fully_shard(model, mesh=mesh, reshard_after_forward=True)
    model.get_input_embeddings().register_forward_hook(_inputs_need_grad)


def _inputs_need_grad(module: nn.Module, inputs, output: torch.Tensor):
    """Embeddings that require grad make every backward run through every layer. Without it a
    micro-batch whose adapters only train lm_head stops its backward at the top, while another
    rank's goes down to the first layer: their backward all-gathers would not pair up."""
    if torch.is_grad_enabled() and not output.requires_grad:
        return output.requires_grad_()
    return None


@contextmanager
def root_unsharded(model: nn.Module) -> Iterator[None]:
    """The root unit's weights (embeddings, norm, lm_head) gathered while the body runs, for a
    call of one of its modules outside the model's forward (the fusion probe's embeddings)."""
    model.unshard()
    try:
        yield
    finally:
        model.reshard()


def transplant_lora_layers(model: nn.Module, layers: dict[str, MultiLoRALinear | ExpertProjection]) -> None:
    """Put the existing multi-LoRA layers (their adapters and sampler snapshots in their slots)
    into a freshly loaded copy of the base model, each around the copy's own projection; an MoE
    block's `MultiLoRAExperts` (its w1, w2, w3 layers) around the copy's experts module."""
    dense = {path: layer for path, layer in layers.items() if not isinstance(layer, ExpertProjection)}
    experts = {path.rpartition(".")[0]: layer.owner for path, layer in layers.items()
               if isinstance(layer, ExpertProjection)}
    attach_multi_lora(model, next(iter(dense.values())).routing, [p for p in discover(model) if p.kind != "experts"],
                      moved=dense)
    for path, owner in experts.items():
        fresh = model.get_submodule(path)
        if fresh.gate_up_proj.shape != owner.base.gate_up_proj.shape:
            raise ValueError(f"{path} is {tuple(fresh.gate_up_proj.shape)} in the reloaded model, "
                             f"not {tuple(owner.base.gate_up_proj.shape)}")
        owner.base = fresh
        parent, _, name = path.rpartition(".")
        setattr(model.get_submodule(parent), name, owner)


class ShardedBase:
    """Rank 0's base model under --shard-base, as the sampling engine and the runtime call it.

    A stable reference to a module that a relaunch rebuilds (FSDP's shards live on the old
    process group); a call from outside rank 0's own passes and probes (the sampling engine's)
    is first mirrored by the other ranks."""

    def __init__(self, module: nn.Module, before_call: Callable[[], None]):
        self.module = module
        self._before_call = before_call

    def __call__(self, *args, **kwargs):
        self._before_call()
        return self.module(*args, **kwargs)

    def __getattr__(self, name: str):  # only for names the handle lacks: config, parameters, ...
        if name == "module":  # not set yet (never delegate it, or this recurses)
            raise AttributeError(name)
        return getattr(self.module, name)
