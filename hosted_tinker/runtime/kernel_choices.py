"""What a training step may do on this machine, decided at start-up by measuring it: whether
tenants share micro-batches (the fusion probe, invariance.py; on CPU retried with the frozen
projections' input gradients from transposed weights), whether a 16-bit base's logits come from a
float32-output GEMM, and the start-up summary's line of both; and, unless configured, how many
tokens a micro-batch holds.

A mixin of `TrainingRuntime`, which runs the probe's rows like a micro-batch (`_probe_run`); a
pool's ranks override where rank 0 alone decides (runtime/distributed.py).
"""

from __future__ import annotations

import contextlib
import logging

import torch

from .batch_invariant import training_kernels
from .invariance import FusionPolicy, RowIndependenceProbe
from .moe_lora import ExpertProjection, describe_expert_gemms
from .multi_lora import fp32_logits_refused
from .packing import bucket_width, max_rows

log = logging.getLogger(__name__)


def default_micro_batch_tokens(model: torch.nn.Module, device: torch.device) -> int:
    """Padded tokens per micro-batch when not configured.

    On a GPU, bigger passes fill the device better (8192 keeps the fp32 logits of a 150k-token
    vocabulary near 5 GB). On CPU, a pass whose MLP activations (tokens x intermediate size,
    fp32) outgrow ~6 MiB of cache runs slower per token than several smaller ones: measured
    with benchmarks/multi_tenant.py, the best sizes were 2048 tokens at hidden 256 / MLP 768 and
    1024 at hidden 512 / MLP 1536, where one 4096-token pass was 1.8x slower per token.
    """
    if device.type != "cpu":
        return 8192
    cfg = getattr(model, "config", None)
    mlp = int(getattr(cfg, "intermediate_size", 0) or 4 * int(getattr(cfg, "hidden_size", 1024)))
    tokens = (6 << 20) // (4 * mlp)
    return max(512, min(8192, 1 << max(0, tokens.bit_length() - 1)))  # a power of two, floor


class KernelChoices:
    """The start-up checks of `TrainingRuntime` (see the module docstring)."""

    def _logits_in_fp32(self) -> str:
        """A 16-bit base on CUDA computes its logits with a float32 result (multi_lora.Fp32Linear)."""
        head = next((layer for layer in self.layers.values() if layer.role == "unembed"), None)
        dtype = next(self.base_module.parameters()).dtype
        if head is None or dtype == torch.float32:
            return f"{str(dtype).removeprefix('torch.')} (the model's dtype)"
        if self.device.type != "cuda":
            return f"{str(dtype).removeprefix('torch.')}, then float32 (16-bit fp32-output GEMMs are CUDA's)"
        with training_kernels(self.device):
            refused = fp32_logits_refused(head.base.weight)
        if refused:
            log.warning("logits stay %s (then float32): a float32-output unembedding GEMM %s", dtype, refused)
            return f"{str(dtype).removeprefix('torch.')}, then float32 ({refused})"
        head.fp32_output = True
        return "float32 (a 16-bit GEMM with a float32 result)"

    def _fusion_policy(self) -> FusionPolicy:
        return FusionPolicy(self.device, mixing_probe=RowIndependenceProbe(self._probe_sample, self._probe_run))

    def check_fusion(self) -> None:
        """Whether tenants may share micro-batches, decided on this machine before any request, on
        the rows of a micro-batch of the shortest bucket (at most 64) (0.1-0.4 s on the embedded model, 1 CPU thread); if that
        fails, they never do; each other shape is probed when first used.

        On CPU, where the plain model fails, the probe is tried once more with the input gradients
        of the frozen projections taken from transposed copies of their weights
        (`FrozenProjection`): on the 256x4 benchmark model that is what made the probe pass (its
        `lm_head` gradient was the one call whose rows changed bits), at the cost of one more copy
        of the projections' weights. If it fails that way too, the copies are dropped."""
        width = bucket_width(1)
        # As many rows as packing puts in a micro-batch of that width, up to 64 (the probe's cost);
        # at least 2, or there is nothing to share.
        rows = max(2, min(64, max_rows(self.max_tokens_per_micro_batch, width)))
        if (self.policy.check_at_startup(width, rows) or self.device.type != "cpu"
                or not self.may_transpose_frozen_weights):
            return
        extra = self._keep_transposed_weights(True)
        log.info("probing again with the input gradients of frozen projections from transposed weight copies "
                 "(+%.1f MiB)", extra / 2**20)
        retry = self._fusion_policy()
        retry.input_grads = f"from transposed weight copies (+{extra / 2**20:.1f} MiB)"
        if retry.check_at_startup(width, rows):
            self.policy = self.routing.policy = retry
        else:
            self._keep_transposed_weights(False)
            self.policy.mixing_refused += "; also with input gradients from transposed weight copies"

    # A pool's ranks must all compute alike and rank 0 alone decides (runtime/distributed.py).
    may_transpose_frozen_weights = True

    def _keep_transposed_weights(self, keep: bool) -> int:
        return sum(layer.keep_transposed_weight(keep) for layer in self.layers.values())

    def describe_training(self) -> str:
        """One line for the start-up summary: which path a training step takes on this machine."""
        p = self.policy.describe()
        share = ("tenants share micro-batches" if p["mix_tenants"]
                 else f"each tenant its own micro-batches ({p['mix_tenants_refused_because']})")
        parts = [share]
        if self.invariant is not None:
            parts.append(f"batch-invariant kernels: {self.invariant.describe()}")
        parts += [f"CUDA graphs {self.graphs_how}", f"logits {self.logits_fp32}"]
        experts = describe_expert_gemms(self.layers)
        return "; ".join(parts + ([experts] if experts else []))

    # -- the fusion probe (see invariance.py) -----------------------------------------------------
    def _probe_sample(self, width: int, rows: int, seed: int) -> tuple[torch.Tensor, ...]:
        """Random probe rows: token embeddings of the model, target ids, loss weights."""
        gen = torch.Generator(device="cpu").manual_seed(seed * 7919 + width)
        ids = torch.randint(0, self.vocab_size, (rows, width), generator=gen).to(self.device)
        targets = torch.randint(0, self.vocab_size, (rows, width), generator=gen).to(self.device)
        weights = torch.randn(rows, width, generator=gen).to(self.device)
        with torch.no_grad():
            return self.model.get_input_embeddings()(ids), targets, weights

    def _probe_tenants(self, rows: int):
        """Each probe row its own tenant, where the model has LoRA-adapted experts: their GEMMs run
        per (tenant, expert) group (moe_routing.py), so a row's expert GEMMs see the same rows in a
        batch as alone, as a tenant's do; run as one tenant, the probe would measure whether an
        expert's rows keep their bits as its group grows, which no batch depends on (and which
        fails, e.g. with 1024-wide experts on AVX-512)."""
        if not any(isinstance(layer, ExpertProjection) for layer in self.layers.values()):
            return contextlib.nullcontext()
        return self.routing.batch([(f"probe row {i}", i, i + 1) for i in range(rows)])
