"""Which weight matrices of a decoder a LoRA covers, found by their role, not by a name list.

Tinker's `train_attn`, `train_mlp` and `train_unembed` name roles: every weight matrix of the
decoder layers' attention, of their MLP, and the unembedding. `discover` walks the text decoder's
layers and reports each weight matrix it finds as a `Projection` (module path, role, kind):

- kind "linear": an `nn.Linear` (any name: Llama's q_proj, Phi's dense/fc1/fc2, GPT-NeoX's
  dense_h_to_4h, ...);
- kind "conv1d": transformers' `Conv1D` (GPT-2), a linear layer whose weight is stored [in, out];
- kind "fused": one module computing several projections (Phi3's qkv_proj and gate_up_proj,
  GPT-NeoX's query_key_value, GPT-2's c_attn). Tinker trains these as separate LoRAs, one per
  component (q, k, v; gate, up), which is what the cookbook's `fused_projection_map` merges;
  `FUSED_LAYOUTS` says where each component's outputs sit in the fused output;
- kind "experts": a mixture-of-experts block's expert weights (3-D parameters in transformers
  >= 5): role "mlp" where `moe_lora.py` gives them LoRA (per-expert w1, w2, w3), else role
  "experts", refused by name to a LoRA with `train_mlp`;
- kind "unknown": a linear module whose role or layout this server does not know (a fused-looking
  projection without a layout, a linear outside the attention and MLP): never adapted silently,
  `refusal` names it to any LoRA config whose flags could cover it.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field

import torch
from torch import nn
from transformers.pytorch_utils import Conv1D

ROLES = ("attn", "mlp", "unembed")  # the roles `train_attn`, `train_mlp`, `train_unembed` cover


@dataclass(frozen=True)
class Projection:
    """One adaptable weight matrix (or fused group of them) of the served model."""

    path: str  # dotted module path in the model, as PEFT names it under "base_model.model."
    role: str  # "attn", "mlp", "unembed", "experts", or "unknown" (see `refusal`)
    kind: str  # "linear", "conv1d", "fused", "experts", "unknown"
    # kind "fused": (component name, indices of its outputs in the fused output), in Tinker's order
    components: tuple[tuple[str, tuple[int, ...]], ...] = field(default=(), compare=False)
    why: str = ""  # kind "unknown": what is not known about it

    def describe(self) -> str:
        leaf = self.path.rsplit(".", 1)[-1]
        if self.kind == "experts" and self.role in ROLES:
            return f"{leaf} (w1, w3, w2 per expert)"
        if self.kind == "fused":
            return f"{leaf} (as {', '.join(name.removesuffix('_proj') for name, _ in self.components)})"
        return leaf


# -- the layouts of fused projections -----------------------------------------------------------

def _consecutive(*sizes: tuple[str, int]) -> tuple[tuple[str, tuple[int, ...]], ...]:
    out, start = [], 0
    for name, n in sizes:
        out.append((name, tuple(range(start, start + n))))
        start += n
    return tuple(out)


def _phi3_qkv(attn: nn.Module, config) -> tuple:
    head_dim = attn.head_dim
    q, kv = config.num_attention_heads * head_dim, config.num_key_value_heads * head_dim
    return _consecutive(("q_proj", q), ("k_proj", kv), ("v_proj", kv))


def _gate_up_halves(mlp: nn.Module, config) -> tuple:
    n = config.intermediate_size
    return _consecutive(("gate_proj", n), ("up_proj", n))


def _neox_qkv(attn: nn.Module, config) -> tuple:
    # GPT-NeoX views the output as [heads, 3 * head_size] and chunks each head into q, k, v.
    d, heads = attn.head_size, config.num_attention_heads
    return tuple((name, tuple(h * 3 * d + i * d + j for h in range(heads) for j in range(d)))
                 for i, name in enumerate(("q_proj", "k_proj", "v_proj")))


def _gated_delta_qkv(attn: nn.Module, config) -> tuple:
    # Qwen3.5's linear attention: Q | K | V, the value part wider; Tinker names them in_proj_q/k/v.
    return _consecutive(("in_proj_q", attn.key_dim), ("in_proj_k", attn.key_dim), ("in_proj_v", attn.value_dim))


def _gpt2_qkv(attn: nn.Module, config) -> tuple:
    d = attn.split_size
    return _consecutive(("q_proj", d), ("k_proj", d), ("v_proj", d))


# (class of the attention or MLP module, child name) -> its components (read from the module
# and the text config, as the module's own forward splits its output).
FUSED_LAYOUTS = {
    ("Phi3Attention", "qkv_proj"): _phi3_qkv,
    ("Phi3MLP", "gate_up_proj"): _gate_up_halves,
    ("GPTNeoXAttention", "query_key_value"): _neox_qkv,
    ("GPT2Attention", "c_attn"): _gpt2_qkv,
    ("Qwen3_5GatedDeltaNet", "in_proj_qkv"): _gated_delta_qkv,
    ("Qwen3_5MoeGatedDeltaNet", "in_proj_qkv"): _gated_delta_qkv,
}
# Names that say a projection is fused; one without a layout above is refused, not trained whole
# (a single LoRA over it would not be Tinker's layout, and the cookbook could not merge it).
_FUSED_NAME = re.compile(r"qkv|query_key_value|c_attn|gate_up|w_pack", re.IGNORECASE)


# -- finding the decoder ------------------------------------------------------------------------

def _block_role(name: str, module: nn.Module) -> str | None:
    """The role of a decoder layer's child (its attention or MLP block), or None."""
    cls = type(module).__name__.lower()
    if "attention" in cls or "deltanet" in cls or name in ("self_attn", "attn", "linear_attn", "attention",
                                                            "self_attention"):
        return "attn"
    if any(s in cls for s in ("mlp", "feedforward", "moe", "sparse")) or name in ("mlp", "feed_forward", "ffn"):
        return "mlp"
    return None


def _decoder_layers(model: nn.Module) -> tuple[str, nn.ModuleList] | None:
    """(path, layers) of the text decoder's layer list: the ModuleList under `get_decoder()` whose
    layers have an attention block (a vision tower's blocks are not under the text decoder). Any
    layer may show it: Qwen3.5's first layers have linear attention, its full attention comes later."""
    decoder = model.get_decoder() if hasattr(model, "get_decoder") else None
    decoder = decoder if isinstance(decoder, nn.Module) else model
    prefix = next(p for p, m in model.named_modules() if m is decoder)
    for path, module in decoder.named_modules():
        if isinstance(module, nn.ModuleList) and any(
                _block_role(n, c) == "attn" for layer in module for n, c in layer.named_children()):
            return ".".join(p for p in (prefix, path) if p), module
    return None


def _linear_kind(module: nn.Module) -> str | None:
    if isinstance(module, nn.Linear):
        return "linear"
    if isinstance(module, Conv1D):
        return "conv1d"
    return None


def is_fused_experts(module: nn.Module) -> bool:
    """A transformers >= 5 experts module with 3-D weights (`use_experts_implementation`)."""
    w = getattr(module, "gate_up_proj", None) if hasattr(module, "is_transposed") else None
    return isinstance(w, nn.Parameter) and w.dim() == 3


def experts_unsupported(module: nn.Module) -> str | None:
    """Why an experts module cannot take LoRA here (moe_lora.py), or None."""
    if not is_fused_experts(module):
        return f"{type(module).__name__} is not a fused experts module (3-D gate_up_proj and down_proj)"
    if not getattr(module, "has_gate", True) or getattr(module, "has_post_expert_norm", False):
        return "experts without a fused gate/up projection or with a post-expert norm are not supported"
    if getattr(module, "_is_expert_parallel", False):
        return "expert-parallel experts are not supported"
    return None


def _in_block(block_path: str, block: nn.Module, role: str, config) -> list[Projection]:
    found: list[Projection] = []
    for path, module in block.named_modules():
        full = f"{block_path}.{path}" if path else block_path
        if isinstance(module, nn.modules.conv._ConvNd):
            continue  # a convolution over time (Qwen3.5's depthwise conv1d), not a projection: Tinker leaves it
        params3d = [n for n, p in module.named_parameters(recurse=False) if p.ndim == 3]
        if params3d:
            why = experts_unsupported(module)
            found.append(Projection(full, "experts" if why else "mlp", "experts",
                                    why=f"{', '.join(params3d)}: {why}" if why else ", ".join(params3d)))
            continue
        kind = _linear_kind(module)
        if kind is None:
            continue
        parent_path, _, leaf = full.rpartition(".")
        parent = block.get_submodule(parent_path[len(block_path) + 1:]) if parent_path != block_path else block
        layout = FUSED_LAYOUTS.get((type(parent).__name__, leaf))
        if layout is not None:
            found.append(Projection(full, role, "fused", components=layout(parent, config)))
        elif _FUSED_NAME.search(leaf):
            found.append(Projection(full, "unknown", "unknown",
                                    why=f"a fused {type(parent).__name__} projection whose layout this server "
                                        "does not know"))
        else:
            found.append(Projection(full, role, kind))
    return found


def discover(model: nn.Module) -> list[Projection]:
    """Every weight matrix of `model`'s decoder layers and its unembedding, with its role."""
    config = model.config.get_text_config() if hasattr(model.config, "get_text_config") else model.config
    found: list[Projection] = []
    head = model.get_output_embeddings()
    located = _decoder_layers(model)
    if located is None:  # no layer list we know: every linear of the model is refused, none left out
        found += [Projection(p, "unknown", "unknown", why="no decoder layers with an attention block were found")
                  for p, m in model.named_modules() if _linear_kind(m) and m is not head]
    else:
        layers_path, layers = located
        for i, layer in enumerate(layers):
            for name, child in layer.named_children():
                child_path = f"{layers_path}.{i}.{name}"
                role = _block_role(name, child)
                if role is not None:
                    found += _in_block(child_path, child, role, config)
                else:  # a norm has no projection; a linear here has no role we know
                    found += [Projection(f"{child_path}.{p}" if p else child_path, "unknown", "unknown",
                                         why="a projection outside the attention and MLP blocks")
                              for p, m in child.named_modules() if _linear_kind(m)]
    if _linear_kind(head):
        path = next(p for p, m in model.named_modules() if m is head)
        found.append(Projection(path, "unembed", _linear_kind(head)))
    return found


# -- what a LoRA config may not ask for -----------------------------------------------------------

def experts_refusal(projections: list[Projection], train_mlp: bool) -> str | None:
    """Why a LoRA with `train_mlp` cannot be made on this model's experts, or None: experts of a
    kind `moe_lora.py` cannot adapt (their role stays "experts") are named, never left out silently."""
    experts = [p for p in projections if p.role == "experts"]
    if not train_mlp or not experts:
        return None
    return (f"expert weights {experts[0].path} ({experts[0].why}; and {len(experts) - 1} more expert blocks) "
            "cannot be adapted; set train_mlp=False to train attention (and unembedding) only")


def refusal(projections: list[Projection], flags: dict[str, bool]) -> str | None:
    """Why a LoRA with these train_* flags ({role: on}) cannot be made, or None: a projection it
    asks for that cannot be adapted is named, never skipped."""
    unknown = [p for p in projections if p.role == "unknown"]
    if unknown and (flags["attn"] or flags["mlp"]):
        p = unknown[0]
        return (f"{p.path} cannot be adapted: {p.why}; a LoRA with train_attn or train_mlp would leave it out"
                + (f" (and {len(unknown) - 1} more like it)" if len(unknown) > 1 else ""))
    return experts_refusal(projections, flags["mlp"])


def coverage(projections: list[Projection]) -> str:
    """What a LoRA covers on this model, by role, for the start-up summary."""
    parts = []
    for role, label in (("attn", "attention"), ("mlp", "MLP"), ("unembed", "unembed")):
        names = dict.fromkeys(p.describe() for p in projections if p.role == role)
        if names:
            parts.append(f"{label} {' '.join(names)}")
    for role, label in (("experts", "refused experts"), ("unknown", "refused")):
        names = dict.fromkeys(p.path.rsplit(".", 1)[-1] for p in projections if p.role == role)
        if names:
            parts.append(f"{label} {' '.join(names)}")
    return "; ".join(parts) or "nothing"


# -- the modules a LoRA runs on ---------------------------------------------------------------------

def as_linear(module: nn.Module, rows: tuple[int, ...] | None = None) -> nn.Linear:
    """An `nn.Linear` computing `module` (a Linear or a Conv1D), or only its output `rows`: a
    Conv1D's [in, out] weight is stored transposed, as [out, in]. Frozen, on the module's device."""
    weight, bias = module.weight, module.bias
    if isinstance(module, Conv1D):
        weight = weight.t()
    if rows is not None:
        index = torch.tensor(rows, device=weight.device)
        weight = weight.index_select(0, index)
        bias = None if bias is None else bias.index_select(0, index)
    linear = nn.Linear(weight.shape[1], weight.shape[0], bias=bias is not None, device="meta")
    linear.weight = nn.Parameter(weight.detach().contiguous(), requires_grad=False)
    if bias is not None:
        linear.bias = nn.Parameter(bias.detach().contiguous(), requires_grad=False)
    return linear


class SplitProjection(nn.Module):
    """A fused projection run as its components (each its own projection, with its own LoRAs):
    their outputs, concatenated, put back where the fused module had them."""

    def __init__(self, components: dict[str, nn.Module], rows: tuple[tuple[int, ...], ...]):
        super().__init__()
        self.names = tuple(components)
        for name, module in components.items():
            self.add_module(name, module)
        order = [i for r in rows for i in r]  # fused output index of each concatenated output
        self.out_features = len(order)
        inverse = torch.empty(len(order), dtype=torch.long)
        inverse[torch.tensor(order)] = torch.arange(len(order))
        # Consecutive components (Phi3, GPT-2) need no reordering; GPT-NeoX interleaves heads.
        self.inverse = None if order == list(range(len(order))) else inverse

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = torch.cat([getattr(self, name)(x) for name in self.names], dim=-1)
        if self.inverse is None:
            return y
        if self.inverse.device != y.device:
            self.inverse = self.inverse.to(y.device)
        return y.index_select(-1, self.inverse)


# -- the names a checkpoint gives them ----------------------------------------------------------------

# A vision-language model's text decoder sits under "model.language_model." (Qwen3-VL, Qwen3.5);
# Tinker names its LoRAs as the text model's ("model.layers..."), and the cookbook's weight tools
# put "language_model." back when they merge (its merge profiles' `has_language_model_prefix`).
_VL_TEXT, _TEXT = "model.language_model.", "model."


def tinker_name(name: str) -> str:
    """The name a checkpoint gives the LoRA tensor `name` of the served model (Tinker's)."""
    return _TEXT + name[len(_VL_TEXT):] if name.startswith(_VL_TEXT) else name


def served_names(tensors: dict[str, torch.Tensor], lora_paths) -> dict[str, torch.Tensor]:
    """A checkpoint's `tensors` under the served model's names (the inverse of `tinker_name`), for
    a model whose LoRA paths are `lora_paths`."""
    if not any(p.startswith(_VL_TEXT) for p in lora_paths):
        return tensors
    return {_VL_TEXT + k[len(_TEXT):] if k.startswith(_TEXT) and not k.startswith(_VL_TEXT) else k: v
            for k, v in tensors.items()}
