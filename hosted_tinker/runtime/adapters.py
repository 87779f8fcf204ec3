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
        self.optimizer = AdamWState()
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
                for k, v in state.items():  # "step" too: the fused kernel wants it beside its tensor
                    state[k] = v.to(device)
        self.device = device

    # -- optimisation ------------------------------------------------------------------------
    def prepare_grads(self) -> None:
        """Give every tensor without a gradient a zero one, all in one buffer, before a backward.

        Why: gradients that the backward allocates land between the activations of the pass, and
        on CPU (glibc) the next micro-batch of the same fused call then page-faults in fresh
        memory: measured at hidden 512, 4 micro-batches in one call ran 10-25% slower than the
        same 4 in separate calls. One buffer per adapter, made before the pass, keeps the heap
        reusable. Accumulating onto zeros changes no bit (0 + g == g). With a single micro-batch
        there is nothing to protect, and letting the backward hand over its own tensors saves an
        add per tensor (measurable with many tiny tenants), so the runtime skips it then.
        """
        missing = [p for p in self.parameters() if p.grad is None]
        if not missing:
            return
        flat = torch.zeros(sum(p.numel() for p in missing), dtype=missing[0].dtype, device=missing[0].device)
        offset = 0
        for p in missing:
            p.grad = flat[offset:offset + p.numel()].view_as(p)
            offset += p.numel()

    def has_gradients(self) -> bool:
        return any(p.grad is not None for p in self.parameters())

    def optim_step(self, params: AdamParams) -> dict[str, float]:
        """One AdamW step of this adapter alone (see `adamw_step`)."""
        return adamw_step([(self, params)])[0]

    def zero_grad(self) -> None:
        for p in self.parameters():
            p.grad = None


class AdamWState:
    """AdamW moments per tensor, in torch.optim's layout: state[p] = {step, exp_avg, exp_avg_sq}.

    Not a torch.optim.Optimizer: every tenant has its own hyper-parameters at every step, and one
    cycle steps many tenants at once (`adamw_step`), which an optimizer object per adapter cannot.
    """

    def __init__(self) -> None:
        self.state: dict[torch.Tensor, dict[str, torch.Tensor]] = {}

    def state_for(self, p: torch.Tensor) -> dict[str, torch.Tensor]:
        st = self.state.get(p)
        if st is None:
            st = self.state[p] = {
                "step": torch.zeros((), dtype=torch.float32, device=p.device),
                "exp_avg": torch.zeros_like(p, memory_format=torch.preserve_format),
                "exp_avg_sq": torch.zeros_like(p, memory_format=torch.preserve_format),
            }
        return st


def adamw_step(items: list[tuple[LoRAAdapter, AdamParams]]) -> list[dict[str, float]]:
    """One AdamW step (decoupled weight decay) for each (adapter, its hyper-parameters).

    The step of many adapters costs about what one costs: one multi-tensor norm over every
    gradient, one host sync for all the norms, and one fused AdamW kernel per distinct set of
    hyper-parameters (torch's own `fused=True` AdamW kernel, CPU and CUDA). Every tensor's update
    depends only on its own gradient, moments and step, so an adapter gets the same bits whether
    it steps alone or with others.

    Clipping (grad_clip_norm > 0) scales an adapter's gradients by min(1, max_norm / (norm +
    1e-6)), as torch.nn.utils.clip_grad_norm_; the returned `grad_norm` is the norm before
    clipping. Tensors without a gradient are left alone (as torch.optim does).
    """
    with torch.no_grad():
        per_adapter: list[tuple[list[torch.Tensor], list[torch.Tensor]]] = []
        for adapter, _ in items:
            params = [p for p in adapter.parameters() if p.grad is not None]
            per_adapter.append((params, [p.grad for p in params]))
        all_grads = [g for _, grads in per_adapter for g in grads]
        norms: list[float] = [0.0] * len(items)
        if all_grads:
            tensor_norms = torch._foreach_norm(all_grads, 2.0)
            totals, i = [], 0
            for _, grads in per_adapter:
                totals.append(torch.linalg.vector_norm(torch.stack(tensor_norms[i:i + len(grads)]), 2.0)
                              if grads else tensor_norms[0].new_zeros(()))
                i += len(grads)
            norms = torch.stack(totals).tolist()  # the one host sync
        groups: dict[tuple, list[int]] = {}
        for k, ((adapter, hp), (params, grads)) in enumerate(zip(items, per_adapter)):
            if hp.grad_clip_norm > 0 and grads:
                coef = min(1.0, hp.grad_clip_norm / (norms[k] + 1e-6))
                if coef < 1.0:
                    torch._foreach_mul_(grads, coef)
            if params:
                key = (hp.learning_rate, hp.beta1, hp.beta2, hp.eps, hp.weight_decay, params[0].device)
                groups.setdefault(key, []).append(k)
        for (lr, beta1, beta2, eps, wd, _), members in groups.items():
            ps, gs, m1, m2, steps = [], [], [], [], []
            for k in members:
                adapter = items[k][0]
                params, grads = per_adapter[k]
                for p, g in zip(params, grads):
                    st = adapter.optimizer.state_for(p)
                    ps.append(p)
                    gs.append(g)
                    m1.append(st["exp_avg"])
                    m2.append(st["exp_avg_sq"])
                    steps.append(st["step"])
            torch._foreach_add_(steps, 1)
            torch._fused_adamw_(ps, gs, m1, m2, [], steps, lr=lr, beta1=beta1, beta2=beta2,
                                weight_decay=wd, eps=eps, amsgrad=False, maximize=False)
        results = []
        for k, (adapter, hp) in enumerate(items):
            adapter.zero_grad()
            adapter.step += 1
            results.append({"grad_norm": norms[k], "learning_rate": hp.learning_rate})
        return results
