"""Batch-invariant kernels on CUDA: a row's bits do not depend on the other rows of its batch.

Tenants share micro-batches on a GPU only because of what this module sets. Measured on an H200
(torch 2.11, cu130; `../shared/reference/gpu-notes.md` and the closing note of issue 22):

- **GEMMs.** On Hopper the only batch dependence of cuBLAS GEMMs is split-K, chosen by the row
  count. vLLM's batch-invariant recipe turns it off instead of replacing the GEMMs: cuBLASLt as
  the BLAS library, `allow_bf16_reduced_precision_reduction = (False, False)` (on torch >= 2.10
  the second element forbids split-K) and a 1 KiB cuBLASLt workspace with
  `CUBLAS_WORKSPACE_CONFIG=:16:8`. The two variables are read when CUDA's BLAS handles are made,
  so they are set in the environment when this module is imported, before any CUDA work; the two
  flags are set around each training micro-batch (`training_kernels`) and the sampler keeps
  torch's defaults. With them, no GEMM of a Qwen3-1.7B-shaped layer changed a row's bits at any
  row count.
- **Attention.** FlashAttention-2's backward adds dQ across key blocks with atomics: at 512 and
  1024 tokens dQ differed between a batch of 2 and of 32 sequences, and between two runs of the
  same batch. cuDNN's attention gave the same bits at 128, 512 and 1024 tokens, in both, and is
  asked for here first (then the math kernel, also invariant). Torch's deterministic algorithms
  are on, warn-only, while a training micro-batch runs (deterministic index_add and the like);
  cuDNN's backward takes its deterministic algorithm only with warn_only=False, which would make
  any op without a deterministic implementation raise inside a step, so it runs its default one:
  measured invariant and repeatable at those lengths, and the GPU exactness tests pass with it.
- **Masks.** The trainer hands decoder models an explicit "no mask" (causal, right padding), so
  transformers never inspects position ids for packed sequences: that check read a tensor on the
  host in eager mode (a sync) and, inside a CUDA graph capture, built a dense mask that sent
  attention to another kernel (eager and replayed steps then differed from `o_proj` on). A model
  whose forward does not take that mapping (Qwen3-MoE, Mixtral: no `layer_types`) runs its
  training steps with an attention implementation of our own name (`no_mask_attention`): SDPA's
  own function, which transformers has no mask function for, so it builds and inspects no mask.

RMSNorm, softmax and cross-entropy reduce each row on its own (measured invariant). What is
left to construction in the runtime: one grouped LoRA call per projection, per-tenant loss and
norm reductions, gradients accumulated per tenant in fp32 (trainer.py, multi_lora.py, adamw.py,
adapters.py). The `FusionPolicy` probes stay as a guard.
"""

from __future__ import annotations

import logging
import os
from contextlib import contextmanager
from dataclasses import dataclass

import torch

log = logging.getLogger(__name__)

# Read by cuBLAS / cuBLASLt when their handles and workspaces are made, i.e. at the first GEMM.
CUBLAS_ENV = {"CUBLASLT_WORKSPACE_SIZE": "1", "CUBLAS_WORKSPACE_CONFIG": ":16:8"}
SET_BY_US: dict[str, str] = {}


def prepare_process_environment() -> None:
    """Put the cuBLAS settings in the environment unless the user set them (idempotent). Called
    on import: by the time a model is on a GPU it is too late."""
    for key, value in CUBLAS_ENV.items():
        if key not in os.environ:
            os.environ[key] = value
            SET_BY_US[key] = value


prepare_process_environment()


def child_environment(env: dict[str, str]) -> dict[str, str]:
    """`env` without the settings this module put there (a vLLM sidecar picks its own GEMMs)."""
    return {k: v for k, v in env.items() if not (k in SET_BY_US and SET_BY_US[k] == v)}


@dataclass(frozen=True)
class InvariantSettings:
    """What takes effect on this process's GPUs (for the start-up summary and /health)."""

    gemm: str
    attention: str
    ok: bool

    def describe(self) -> str:
        return f"GEMMs {self.gemm}; attention {self.attention}"


_checked: InvariantSettings | None = None


def apply_cuda_settings() -> InvariantSettings:
    """Check once that the GEMM settings can be made here (`training_kernels` makes them around
    each training micro-batch). `ok` is False where a part cannot; the probes then decide."""
    global _checked
    if _checked is not None:
        return _checked
    problems = []
    env = {k: os.environ.get(k) for k in CUBLAS_ENV}
    if any(env[k] != v for k, v in CUBLAS_ENV.items()):
        problems.append("environment " + ", ".join(f"{k}={env[k]}" for k in CUBLAS_ENV))
    try:
        with _invariant_gemms():
            pass
    except Exception as e:  # a torch older than 2.10 (no split-K switch), or no cuBLASLt
        problems.append(f"{type(e).__name__}: {e}")
    gemm = ("cuBLASLt, split-K off, 1 KiB workspace" if not problems
            else "NOT all batch-invariant: " + "; ".join(problems))
    _checked = InvariantSettings(gemm=gemm, attention="cuDNN (then math)", ok=not problems)
    (log.info if _checked.ok else log.warning)("batch-invariant CUDA settings: %s", _checked.describe())
    return _checked


@contextmanager
def _invariant_gemms():
    """cuBLASLt with split-K off, for what runs inside; torch's defaults restored after (the
    sampler keeps them: its eager decode steps pay ~0.1 ms of host time per cuBLASLt call)."""
    matmul = torch.backends.cuda.matmul
    library = torch.backends.cuda.preferred_blas_library()
    bf16 = matmul.allow_bf16_reduced_precision_reduction
    try:
        torch.backends.cuda.preferred_blas_library("cublaslt")
        matmul.allow_bf16_reduced_precision_reduction = (False, False)
        yield
    finally:
        matmul.allow_bf16_reduced_precision_reduction = bf16
        torch.backends.cuda.preferred_blas_library(library)


@contextmanager
def training_kernels(device: torch.device):
    """Around a training micro-batch (forward and backward) and the probes: batch-invariant GEMMs
    and attention on CUDA (see the module docstring). A no-op on CPU, where the probes decide."""
    if device.type != "cuda":
        yield
        return
    from torch.nn.attention import SDPBackend, sdpa_kernel
    import torch.utils.deterministic as det

    was = (torch.are_deterministic_algorithms_enabled(), torch.is_deterministic_algorithms_warn_only_enabled(),
           det.fill_uninitialized_memory)
    with _invariant_gemms(), sdpa_kernel([SDPBackend.CUDNN_ATTENTION, SDPBackend.MATH], set_priority=True):
        torch.use_deterministic_algorithms(True, warn_only=True)
        det.fill_uninitialized_memory = False  # no NaN fill of every new tensor: nothing reads them unwritten
        try:
            yield
        finally:
            torch.use_deterministic_algorithms(was[0], warn_only=was[1])
            det.fill_uninitialized_memory = was[2]


def no_mask_kwargs(model: torch.nn.Module) -> dict:
    """Keyword arguments that give a decoder model "causal, no padding mask" without letting it
    build or inspect one (see the module docstring), or {} where the model cannot take them.

    transformers' Qwen2/Qwen3-style models take `attention_mask` as {layer type: mask}; None per
    type is SDPA's is_causal. Only where every layer is full attention (a sliding window needs
    its mask)."""
    config = getattr(model, "config", None)
    types = list(getattr(config, "layer_types", None) or [])
    if not types or any(t != "full_attention" for t in types):
        return {}
    kwargs = {"attention_mask": {"full_attention": None}}
    device = next(model.parameters()).device
    # Distinct tokens: over equal ones (equal values), attention without a mask looks causal --
    # so GPT-OSS (eager attention, which reads None as no mask at all) passed as causal.
    ids = torch.arange(1, 9, device=device).unsqueeze(0) % model.get_input_embeddings().num_embeddings
    try:
        with torch.no_grad():
            plain = model(input_ids=ids, use_cache=False).logits.float()
            given = model(input_ids=ids, use_cache=False, **kwargs).logits.float()
    except Exception:
        return {}  # a model whose forward does not take the mapping: it builds its own mask
    return kwargs if torch.allclose(plain, given, atol=1e-2, rtol=1e-2) else {}


# An attention implementation transformers has an attention function for (SDPA's own) but no mask
# function: a model set to it builds no mask (`masking_utils._preprocess_mask_arguments` exits
# early), and SDPA reads the None mask as is_causal.
NO_MASK_ATTENTION = "hosted_tinker_sdpa_no_mask"


def no_mask_attention(model: torch.nn.Module) -> str | None:
    """For a causal decoder whose forward does not take `no_mask_kwargs`' mapping: the attention
    implementation to train it with so that transformers builds and inspects no mask (its
    packed-sequence check read a tensor on the host, a sync per forward), where its attention is
    SDPA over full (not sliding-window) causal layers and gives the same logits that way; else
    None."""
    from transformers import AttentionInterface
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    config = getattr(model, "config", None)
    if config is None or getattr(config, "_attn_implementation", None) != "sdpa":
        return None
    if any(t != "full_attention" for t in getattr(config, "layer_types", None) or []) or \
            getattr(config, "sliding_window", None) is not None and getattr(config, "use_sliding_window", True):
        return None
    AttentionInterface.register(NO_MASK_ATTENTION, sdpa_attention_forward)
    device = next(model.parameters()).device
    ids = torch.arange(1, 9, device=device).unsqueeze(0) % model.get_input_embeddings().num_embeddings
    try:
        with torch.no_grad():
            plain = model(input_ids=ids, use_cache=False).logits.float()
            with attention_implementation(model, NO_MASK_ATTENTION):
                given = model(input_ids=ids, use_cache=False).logits.float()
    except Exception:
        return None
    return NO_MASK_ATTENTION if torch.allclose(plain, given, atol=1e-2, rtol=1e-2) else None


@contextmanager
def attention_implementation(model: torch.nn.Module, name: str | None):
    """`model` runs with attention implementation `name` inside (None: as it is). The device loop
    alternates training and sampling on one thread, so the sampler never sees the switch."""
    if name is None:
        yield
        return
    config = model.config
    was = config._attn_implementation
    config._attn_implementation = name
    try:
        yield
    finally:
        config._attn_implementation = was
