"""The built-in engine's KV-cache budget, in tokens: how much KV cache its running jobs may hold.

It sizes the engine's pool of KV-cache pages (kv_cache.py), and the engine starts a job only while
every running job's worst case plus the job's fits it (admission.py), as vLLM's scheduler admits
only while its KV blocks last: so the sum of all tenants' requests can never outgrow the device,
whatever each one's own limits allow. A job's worst case is `num_samples x (len(prompt) +
max_tokens)` cached tokens (`job_kv_tokens`); a job larger than the whole budget could never run
and is refused when submitted.

`max_sampling_kv_tokens` chooses it (`choose_kv_budget`): a number of tokens, or 0 = auto:
- on CUDA, half the device's free memory at start-up (after the base model is loaded) over the
  model's per-token KV bytes; the other half is left to training on the same device (its
  activations, adapters and optimizer state) and to the allocator's slack;
- elsewhere (CPU, MPS), `DEFAULT_KV_TOKENS`: a fixed, generous bound that keeps start-up
  deterministic (free RAM is shared with everything else on the machine); set the setting to
  bound a big model's KV cache there.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from ..config.settings import DEFAULT_KV_TOKENS

if TYPE_CHECKING:
    from .jobs import SampleJob

# DEFAULT_KV_TOKENS, 4M tokens: 4 x the default max_sampled_tokens_per_request, so every request within
# the default per-request limits runs (the embedded model's KV: 2 layers x 2 x 2 kv heads x 16 x 4 B =
# 512 B per token, so 2 GiB at most; Qwen3-8B's in float32, 288 KiB per token, would need a setting).
AUTO_FREE_MEMORY_FRACTION = 0.5


@dataclass(frozen=True)
class KVBudget:
    tokens: int
    how: str  # how it was chosen, for the start-up summary


def job_kv_tokens(job: "SampleJob") -> int:
    """The most KV-cache tokens `job` can hold at once: every sample's prompt and all it may generate."""
    return job.num_samples * (len(job.prompt) + job.max_tokens)


def kv_bytes_per_token(model: torch.nn.Module) -> int:
    """Bytes of KV cache one token takes in `model`: layers x (K and V) x kv heads x head dim x dtype size."""
    config = getattr(model.config, "text_config", model.config)  # multimodal configs nest the LM's
    heads = config.num_attention_heads
    kv_heads = getattr(config, "num_key_value_heads", None) or heads
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // heads
    dtype_size = next(model.parameters()).element_size()
    return config.num_hidden_layers * 2 * kv_heads * head_dim * dtype_size


def choose_kv_budget(setting: int, model: torch.nn.Module, device: torch.device) -> KVBudget:
    """The budget `max_sampling_kv_tokens = setting` gives for `model` on `device` (see the module doc)."""
    per_token = kv_bytes_per_token(model)
    if setting > 0:
        return KVBudget(setting, f"max_sampling_kv_tokens, {_gib(setting * per_token)} of KV cache")
    if device.type == "cuda":
        free, _ = torch.cuda.mem_get_info(device)
        tokens = max(1, int(free * AUTO_FREE_MEMORY_FRACTION) // per_token)
        return KVBudget(tokens, f"auto: half of the {_gib(free)} free on {device} at start-up, "
                                f"{per_token} bytes per token")
    return KVBudget(DEFAULT_KV_TOKENS, f"auto: the default on {device.type}, {_gib(DEFAULT_KV_TOKENS * per_token)} "
                                       "of KV cache at most; set max_sampling_kv_tokens to bound it")


def _gib(n_bytes: int) -> str:
    return f"{n_bytes / 2**30:.2f} GiB"
