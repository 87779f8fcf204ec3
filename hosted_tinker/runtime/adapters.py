"""One tenant's LoRA adapter: its config, its weights in every adapted projection, its optimizer.

An adapter owns plain float32 leaf tensors; the `MultiLoRALinear` layers only hold references
to them while the adapter is live. Paging an idle adapter out to CPU memory moves its weights,
gradients and AdamW moments together and detaches it from the layers.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass

import torch

from .multi_lora import LoRAWeights, MultiLoRALinear, module_kind

# Tinker does not document its LoRA alpha; we use a fixed alpha of 32 (scaling = 32 / rank),
# the value used in Thinking Machines' "LoRA Without Regret" write-up, and we write it into
# every exported adapter_config.json so PEFT and vLLM reproduce our outputs exactly.
DEFAULT_LORA_ALPHA = 32.0


@dataclass(frozen=True)
class LoRAConfig:
    rank: int = 32
    seed: int = 0
    train_mlp: bool = True
    train_attn: bool = True
    train_unembed: bool = True
    alpha: float = DEFAULT_LORA_ALPHA
    # Leaf projection names to adapt (e.g. ("q_proj", "v_proj")), on top of the train_* flags.
    # None = every projection of the enabled kinds. Set for adapters made elsewhere (PEFT), whose
    # target_modules are often a subset of a kind.
    target_modules: tuple[str, ...] | None = None

    def __post_init__(self) -> None:
        if self.target_modules is not None:  # a JSON manifest gives a list
            object.__setattr__(self, "target_modules", tuple(sorted(self.target_modules)))

    @property
    def scaling(self) -> float:
        return self.alpha / self.rank

    def adapts(self, module_path: str) -> bool:
        if self.target_modules is not None and module_path.rsplit(".", 1)[-1] not in self.target_modules:
            return False
        kind = module_kind(module_path)
        return {"attn": self.train_attn, "mlp": self.train_mlp, "unembed": self.train_unembed}[kind]

    def to_dict(self) -> dict:
        return asdict(self)


@dataclass(frozen=True)
class AdamParams:
    learning_rate: float = 1e-4
    beta1: float = 0.9
    beta2: float = 0.95
    eps: float = 1e-12
    weight_decay: float = 0.0
    grad_clip_norm: float = 0.0


class LoRAAdapter:
    """A model's trainable state: LoRA factors for each adapted projection plus AdamW state."""

    def __init__(self, adapter_id: str, config: LoRAConfig, layers: dict[str, MultiLoRALinear],
                 device: torch.device):
        self.adapter_id = adapter_id
        self.config = config
        self.device = device
        self.weights: dict[str, LoRAWeights] = {}
        # Deterministic from the seed alone (not from the global RNG or creation order), so two
        # servers give a model the same initial adapter.
        gen = torch.Generator(device="cpu").manual_seed(config.seed)
        for path in sorted(layers):
            if not config.adapts(path):
                continue
            layer = layers[path]
            # PEFT's default init: A ~ kaiming_uniform(a=sqrt(5)) = U(-1/sqrt(in), 1/sqrt(in)),
            # B = 0, so a fresh adapter leaves the model's outputs unchanged.
            bound = 1.0 / math.sqrt(layer.in_features)
            A = (torch.rand(config.rank, layer.in_features, generator=gen) * 2 - 1) * bound
            B = torch.zeros(layer.out_features, config.rank)
            self.weights[path] = LoRAWeights(
                A=A.to(device).requires_grad_(True), B=B.to(device).requires_grad_(True),
                scaling=config.scaling,
            )
        if not self.weights:
            raise ValueError("the LoRA config adapts no projection of this model")
        self.optimizer = torch.optim.AdamW(self.parameters(), lr=1e-4, betas=(0.9, 0.95), eps=1e-12,
                                           weight_decay=0.0)
        self.step = 0

    # -- tensors ---------------------------------------------------------------------------
    def parameters(self) -> list[torch.Tensor]:
        """Trainable tensors in a fixed order (sorted module path, A then B)."""
        return [t for path in sorted(self.weights) for t in (self.weights[path].A, self.weights[path].B)]

    def named_tensors(self) -> dict[str, torch.Tensor]:
        """PEFT-style names relative to the model root: '<path>.lora_A.weight' etc."""
        out = {}
        for path in sorted(self.weights):
            out[f"{path}.lora_A.weight"] = self.weights[path].A
            out[f"{path}.lora_B.weight"] = self.weights[path].B
        return out

    def attach(self, layers: dict[str, MultiLoRALinear]) -> None:
        for path, w in self.weights.items():
            layers[path].adapters[self.adapter_id] = w

    def detach(self, layers: dict[str, MultiLoRALinear]) -> None:
        for path in self.weights:
            layers[path].adapters.pop(self.adapter_id, None)

    def move_to(self, device: torch.device) -> None:
        """Move weights, gradients and optimizer moments (paging to/from CPU memory)."""
        if device == self.device:
            return
        with torch.no_grad():
            for w in self.weights.values():
                for name in ("A", "B"):
                    t = getattr(w, name)
                    # .data swap keeps tensor identity, so the optimizer's state keys stay valid.
                    t.data = t.data.to(device)
                    if t.grad is not None:
                        t.grad = t.grad.to(device)
            for state in self.optimizer.state.values():
                for k, v in state.items():
                    if isinstance(v, torch.Tensor) and k != "step":
                        state[k] = v.to(device)
        self.device = device

    # -- optimisation ------------------------------------------------------------------------
    def has_gradients(self) -> bool:
        return any(p.grad is not None for p in self.parameters())

    def optim_step(self, params: AdamParams) -> dict[str, float]:
        """AdamW with decoupled weight decay, exactly the request's hyper-parameters.

        Clipping (when grad_clip_norm > 0) scales this adapter's gradients to that global norm;
        the returned `grad_norm` is the norm before clipping.
        """
        tensors = self.parameters()
        grads = [p.grad for p in tensors if p.grad is not None]
        if grads:
            grad_norm = float(torch.linalg.vector_norm(
                torch.stack([torch.linalg.vector_norm(g, 2.0) for g in grads]), 2.0))
        else:
            grad_norm = 0.0
        if params.grad_clip_norm > 0 and grads:
            torch.nn.utils.clip_grad_norm_(tensors, params.grad_clip_norm)
        for group in self.optimizer.param_groups:
            group.update(lr=params.learning_rate, betas=(params.beta1, params.beta2), eps=params.eps,
                         weight_decay=params.weight_decay)
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        self.step += 1
        return {"grad_norm": grad_norm, "learning_rate": params.learning_rate}

    def zero_grad(self) -> None:
        self.optimizer.zero_grad(set_to_none=True)
