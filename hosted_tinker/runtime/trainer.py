"""`TrainingRuntime`: the base model, every live adapter, and the fused forward/backward.

One call of `forward_backward` takes the work of many models (each item one request, with its
own loss function) and runs it as one batch: rows are laid out adapter by adapter, the
`MultiLoRALinear` layers apply each row's own adapter, every datum's loss is computed with its
request's loss function, and one backward of the *sum* of all losses leaves each adapter with
exactly its own gradient (the losses share no parameters). Gradients accumulate in the
adapters' gradient slots until that adapter's `optim_step`; a pass that fails leaves them as
they were before it (`GradientPass`).

Which rows run in which micro-batch is the packing plan's (runtime/packing.py). Exactness: a
tenant gets the same bits alone or co-batched. Its rows go through the same micro-batch pieces
either way; several tenants share a micro-batch only where the `FusionPolicy` says the base
model treats rows independently (on CUDA by construction, runtime/batch_invariant.py; on CPU
where a probe proved it), and each tenant's loss is computed on its own rows.

On CUDA each micro-batch of a layout seen before is one CUDA graph replay (runtime/graphs.py), and
a pass waits for the device once, after launching all of its micro-batches (`wait`; an optimizer
step launched before it shares that wait).
"""

from __future__ import annotations

import contextlib
import time
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass
from itertools import groupby

import torch
import torch.nn.functional as F

from .. import faults
from .adamw import PendingSteps, launch_adamw
from .adapters import AdamParams, GradientPass, LoRAAdapter, LoRAConfig, SkippedStep, snapshot_gradient_rows
from .batch_invariant import (InvariantSettings, apply_cuda_settings, attention_implementation, no_mask_attention,
                              no_mask_kwargs, training_kernels)
from .graphs import CudaGraphCapture, StepGraphs
from .host_copies import Launched, to_host, wait_for_device
from .pass_io import PassStats, PendingPass, host_inputs
from .kernel_choices import KernelChoices, default_micro_batch_tokens
from .losses import LOSSES, merge_metrics, run_losses, topk_cross_entropy
from .moe_lora import attach_moe_lora
from .lora_plan import LoRARouting
from .multi_lora import MultiLoRALinear, attach_multi_lora
from .projections import discover
from .packing import MicroBatch, PackingPlan, RequestShape, RowRange, pack, segments_of, shared_shapes
from .recompute import RECOMPUTE_OFF, RecomputeChoice, recompute_activations
from ..requests.kinds import FBOutcome, FBWork


def token_logprobs(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """log p(target) per position, in float32: [rows, width, vocab] logits -> [rows, width]."""
    rows, width, vocab = logits.shape
    return -F.cross_entropy(logits.float().reshape(-1, vocab), targets.reshape(-1),
                            reduction="none").reshape(rows, width)


@dataclass
class ScoredRows:
    """What a micro-batch's losses read of its forward: per-token target logprobs [rows, width], the
    loss inputs the user sent or the server derived, the mask of real tokens, and with (N, K)
    targets each such run's [rows, width, K] logprobs (keyed by its first row) and the K weights."""
    logprobs: torch.Tensor
    inputs: dict[str, torch.Tensor]
    mask: torch.Tensor
    topk: dict[int, torch.Tensor]
    topk_weights: torch.Tensor | None


def _one_target_losses(works: list[FBWork], runs: list[RowRange], scored: ScoredRows, metric_sums) -> torch.Tensor:
    """Per-token losses of consecutive runs of one model with (N,) targets: one `run_losses` call,
    given only the inputs their losses take (their specs name them: run_losses slices every input
    it is given, per block, and there is a block per model)."""
    specs = [LOSSES[works[wi].loss_fn] for wi, _, _ in runs]
    used = {k: v for k, v in scored.inputs.items()
            if any(k in sp.required_inputs or k in sp.inputs for sp in specs)}
    tok_loss, run_metrics = run_losses(
        [(works[wi].loss_fn, works[wi].loss_config, rs, re) for wi, rs, re in runs], scored.logprobs, used,
        scored.mask)
    for (wi, _, _), metrics in zip(runs, run_metrics):
        merge_metrics(metric_sums[wi], metrics)
    return tok_loss


# Packing kinds (runtime/packing.py `RequestShape.kind`) where steps run as CUDA graphs: micro-batches
# of graphed and of eager requests are never shared, so a tenant's path never depends on others.
GRAPHED, EAGER = "graph", "eager"
# A request with images runs eagerly in micro-batches of its own: the fusion probe and the
# batch-invariant kernels cover text rows, not a vision tower (and text tenants must not change).
IMAGES = "images"


class TrainingRuntime(KernelChoices):
    def __init__(self, model: torch.nn.Module, base_model_name: str, *, device: torch.device,
                 max_tokens_per_micro_batch: int = 0, max_live_adapters: int = 64, check_fusion: bool = True,
                 recompute: RecomputeChoice = RECOMPUTE_OFF, cuda_graphs: bool = True, max_graphs: int = 64):
        self.model = model
        self.base_model_name = base_model_name
        self.device = device
        # On CUDA: the batch-invariant GEMM settings, before any probe runs (batch_invariant.py).
        self.invariant: InvariantSettings | None = apply_cuda_settings() if device.type == "cuda" else None
        # 0 = auto, as the --max-tokens-per-micro-batch flag.
        self.max_tokens_per_micro_batch = max_tokens_per_micro_batch or default_micro_batch_tokens(model, device)
        for p in model.parameters():
            p.requires_grad_(False)
        model.eval()  # no dropout: training through LoRA must be deterministic
        # Whether decoder layers recompute their activations in the backward (runtime/recompute.py).
        self.recompute = recompute
        if recompute.on:
            recompute_activations(self.base_module)
        self.forward_kwargs = self._causal_kwargs()
        # Where the model takes no such kwargs: the attention its training steps run with.
        self.attention = None if self.forward_kwargs else self._no_mask_attention()
        self.policy = self._fusion_policy()
        self.routing = LoRARouting(self.policy)
        # Every weight matrix of the decoder with its role (attention, MLP, unembedding, experts).
        self.projections = discover(model)
        self.layers: dict[str, MultiLoRALinear] = attach_multi_lora(model, self.routing, self.projections)
        self.layers.update(attach_moe_lora(model, self.routing, self.projections))
        self.logits_fp32 = self._logits_in_fp32()
        self.adapters: dict[str, LoRAAdapter] = {}
        # Adapters attached to the layers and resident on `device`, least recently used first.
        self.max_live_adapters = max_live_adapters
        self.live: OrderedDict[str, None] = OrderedDict()
        self.page_outs = 0
        cfg = model.config
        self.vocab_size = int(model.get_output_embeddings().out_features)
        self.max_context = int(getattr(cfg, "max_position_embeddings", None)
                               or getattr(getattr(cfg, "text_config", None), "max_position_embeddings", 1 << 20))
        self.image_token_id = getattr(cfg, "image_token_id", None)  # a vision-language model's
        self.last_pass = PassStats(models=0)  # no pass yet
        self._launched = False  # work queued since the last wait for the device (`wait`)
        self.graphs: StepGraphs | None = None
        self.graphs_how = "off on CPU" if device.type != "cuda" else "off (--cuda-graphs off)"
        if cuda_graphs and device.type == "cuda":
            self.graphs = StepGraphs(CudaGraphCapture(device), max_graphs=max_graphs)
            self.graphs_how = "on: a step of a layout seen before is one CUDA graph replay"
        if check_fusion:  # a rank of a pool checks once its model is sharded (runtime/distributed.py)
            self.check_fusion()

    @property
    def base_module(self) -> torch.nn.Module:
        """The transformers model itself (a pool's rank 0 wraps it: runtime/distributed.py)."""
        return self.model

    def _causal_kwargs(self) -> dict:
        """How the model is told "causal, right padding" (batch_invariant.no_mask_kwargs)."""
        return no_mask_kwargs(self.base_module)

    def _no_mask_attention(self) -> str | None:
        """The attention implementation that builds no mask (batch_invariant.no_mask_attention)."""
        return no_mask_attention(self.base_module)

    def _kernels(self):
        """Around a micro-batch and the probes: the batch-invariant kernels, and the attention that
        builds no mask."""
        stack = contextlib.ExitStack()
        stack.enter_context(training_kernels(self.device))
        stack.enter_context(attention_implementation(self.base_module, self.attention))
        return stack

    def close(self) -> None:
        """Nothing to release: everything lives in this process."""

    # -- adapters ------------------------------------------------------------------------------
    def create_adapter(self, model_id: str, config: LoRAConfig) -> LoRAAdapter:
        if model_id in self.adapters:
            raise ValueError(f"model {model_id!r} already has an adapter")
        adapter = LoRAAdapter(model_id, config, self.layers, self.device)
        self.adapters[model_id] = adapter
        self.ensure_live([model_id])
        return adapter

    def remove_adapter(self, model_id: str) -> None:
        adapter = self.adapters.pop(model_id, None)
        if adapter is not None:
            adapter.detach(self.layers)  # keeps its tensors: a failed `load` puts it back
            self.live.pop(model_id, None)

    def ensure_live(self, model_ids) -> None:
        """Page in the adapters about to run; page out least-recently-used idle ones over the limit.

        Paging moves weights, gradients and AdamW moments to CPU memory and detaches the adapter
        from the layers, so the device holds at most `max_live_adapters` tenants' state.
        """
        needed = [m for m in dict.fromkeys(model_ids) if m in self.adapters]
        for mid in needed:
            self.adapters[mid].attach(self.layers)  # no-op when already in its slot
            self.live[mid] = None
            self.live.move_to_end(mid)
        for mid in list(self.live):
            if len(self.live) <= self.max_live_adapters:
                break
            if mid in needed:
                continue
            self.adapters[mid].detach(self.layers, torch.device("cpu"))
            del self.live[mid]
            self.page_outs += 1

    def adapter(self, model_id: str) -> LoRAAdapter:
        try:
            return self.adapters[model_id]
        except KeyError:
            raise KeyError(f"model {model_id!r} is not loaded") from None

    # -- forward / backward --------------------------------------------------------------------
    def forward_backward(self, works: list[FBWork], *, after_phase: Callable[[bool, int], None] | None = None,
                         before_commit: Callable[[], None] | None = None) -> list[FBOutcome]:
        """Run all `works` fused, in the micro-batches of their packing plan; wait for the device
        once, then hand every datum its outputs (`launch_forward_backward`, `wait`, outcomes)."""
        pending = self.launch_forward_backward(works, after_phase=after_phase, before_commit=before_commit)
        self.wait()
        return pending.outcomes()

    def launch_forward_backward(self, works: list[FBWork], *, after_phase: Callable[[bool, int], None] | None = None,
                                before_commit: Callable[[], None] | None = None) -> "PendingPass":
        """Queue the fused pass of `works` without waiting for the device; its outputs are read by
        `PendingPass.outcomes()` after the runtime's next `wait()` (an optimizer step launched in
        between shares that one wait: `launch_optim_steps`).

        All or nothing for gradients: if launching raises, every adapter's gradients are what
        they were before the call; once it returns they are the adapters' `.grad`. For a rank of
        a pool (runtime/distributed.py): `after_phase(grad, micro_batches_run)` follows the
        gradient and the forward-only micro-batches, and `before_commit()` runs once they are all
        launched, its failure rolling the pass back like any other.
        """
        start = time.perf_counter()
        self.ensure_live([w.model_id for w in works])
        plan = self.plan(works)
        # Per request: "loss:sum" (float64 over its datums) plus any metrics its loss reports.
        metric_sums: list[dict[str, float]] = [{"loss:sum": 0.0} for _ in works]
        grad_pass = GradientPass([self.adapters[m] for m in dict.fromkeys(w.model_id for w in works
                                                                         if not w.forward_only)])
        try:
            launched = []
            for grad in (True, False):
                phase = plan.phase(grad)
                launched += [self._launch(mb, works, metric_sums) for mb in phase]
                if after_phase is not None:
                    after_phase(grad, len(phase))
            if before_commit is not None:
                before_commit()
        except BaseException:
            grad_pass.rollback()
            raise
        grad_pass.commit()
        self._launched = True
        return PendingPass(self._pass_done, works, launched, metric_sums, PassStats(models=len({w.model_id for w in works})),
                           start, before=grad_pass)

    def _pass_done(self, stats: PassStats) -> None:
        self.last_pass = stats

    def wait(self) -> None:
        """The device wait that makes everything launched since the last one readable: at most one
        per cycle (host_copies.wait_for_device, the sync the step audits allow)."""
        if self._launched:
            self._launched = False
            wait_for_device(self.device)

    # -- the packing plan (runtime/packing.py) -----------------------------------------------------
    def request_shapes(self, works: list[FBWork]) -> list[RequestShape]:
        """What the packing plan needs of each request. Where steps run as CUDA graphs, a loss that
        computes on the host (`Loss.host_side`) makes its request of the eager kind."""
        def kind(i: int, w: FBWork):
            if any(d.pixels is not None for d in w.data):
                return (IMAGES, i)  # eager, in micro-batches of this request only
            if self.graphs is None:
                return 0
            return EAGER if LOSSES[w.loss_fn].host_side else GRAPHED
        return [RequestShape(w.model_id, tuple(len(d.tokens) for d in w.data), w.forward_only, kind(i, w))
                for i, w in enumerate(works)]

    def plan(self, works: list[FBWork]) -> PackingPlan:
        return pack(self.request_shapes(works), self.max_tokens_per_micro_batch, may_mix=self.policy.mix_tenants,
                    order_key=self._adapter_shape)

    def _adapter_shape(self, model_id: str) -> tuple:
        """Adapters of one shape sit side by side in a micro-batch: the layers batch them into one call."""
        cfg = self.adapters[model_id].config
        return (cfg.rank, cfg.alpha, cfg.train_attn, cfg.train_mlp, cfg.train_unembed, cfg.target_modules or ())

    def mixing_shapes(self, works: list[FBWork]) -> set[tuple[int, int]]:
        """(width, rows) of every micro-batch of `works` that could hold several tenants: the shapes
        `FusionPolicy.mix_tenants` will be asked about, without asking."""
        return shared_shapes(self.request_shapes(works), self.max_tokens_per_micro_batch)

    def micro_batch_counts(self, works: list[FBWork]) -> tuple[int, int]:
        """How many gradient and forward-only micro-batches `forward_backward(works)` runs."""
        return self.plan(works).counts()

    # -- one micro-batch -----------------------------------------------------------------------------
    def _launch(self, mb: MicroBatch, works: list[FBWork], metric_sums) -> Launched:
        """Queue one micro-batch's work; its per-token outputs are copied to host memory without
        waiting. A graphed micro-batch is a replay of its layout's graph (`StepGraphs`)."""
        faults.check_poisoned("pass.poisoned_datum", (works[wi].data[di].tokens for wi, di in mb.rows))
        host, keys = self._host_inputs(mb, works)
        outputs = None
        if self.graphs is not None and mb.kind == GRAPHED:
            outputs = self.graphs.run(self._graph_key(mb, works), host,
                                      lambda t: self._step(mb, works, keys, t, None),
                                      put_back=lambda: self._put_back(mb), keep=lambda: self.routing.last_plans)
        static = outputs is not None  # a graph's outputs, overwritten by its next replay
        if not static:
            on_device = {k: v.to(self.device, non_blocking=True) for k, v in host.items()}
            outputs = self._step(mb, works, keys, on_device, metric_sums)
        return Launched(mb, *(to_host(t, static) for t in outputs))

    def _host_inputs(self, mb: MicroBatch, works: list[FBWork]) -> tuple[dict[str, torch.Tensor], tuple[str, ...]]:
        """The micro-batch's padded inputs as host tensors (pass_io.host_inputs)."""
        return host_inputs(mb, works, pin=self.device.type == "cuda",
                           pixel_dtype=next(self.model.parameters()).dtype)

    def _step(self, mb: MicroBatch, works: list[FBWork], keys: tuple[str, ...], t: dict[str, torch.Tensor],
              metric_sums) -> tuple[torch.Tensor, ...]:
        """Forward (and backward) of one micro-batch from its device inputs: what a graph captures.
        Returns per-token logprobs and losses ([rows, width] float32) and, with rows of (N, K)
        targets, their logprobs ([rows, width, largest K], 0 elsewhere)."""
        ids, targets = t["tokens"][0], t["tokens"][1]
        mask = t["floats"][0]
        inputs = {k: t["floats"][1 + i] for i, k in enumerate(keys)}
        segments = list(mb.segments)
        with self.routing.batch(segments), self._kernels(), torch.set_grad_enabled(mb.grad):
            # Right padding and a causal mask: real tokens never see the pads after them.
            logits = self.model(input_ids=ids, use_cache=False, **self.forward_kwargs, **self._image_kwargs(ids, t)).logits
            logprobs, topk = self._target_logprobs(mb, works, logits, targets, t.get("topk_targets"))
            del logits
            scored = ScoredRows(logprobs, inputs, mask, topk, t.get("topk_weights"))
            tok_loss = self._losses(works, mb, scored, metric_sums if metric_sums is not None else [{} for _ in works])
            if mb.grad and tok_loss.requires_grad:
                tok_loss.sum().backward()
        if not topk:
            return logprobs.detach(), tok_loss.detach()
        topk_out = torch.zeros_like(t["topk_weights"])
        for s, lp in topk.items():
            topk_out[s:s + lp.shape[0], :, :lp.shape[2]] = lp.detach()
        return logprobs.detach(), tok_loss.detach(), topk_out

    def _image_kwargs(self, ids: torch.Tensor, t: dict[str, torch.Tensor]) -> dict:
        """A micro-batch's images for a vision-language model's forward: pixels, grids, and which
        tokens are image tokens (for its multimodal rotary positions)."""
        if "pixel_values" not in t:
            return {}
        return {"pixel_values": t["pixel_values"], "image_grid_thw": t["image_grid_thw"],
                "mm_token_type_ids": (ids == self.image_token_id).long()}

    @staticmethod
    def _target_logprobs(mb: MicroBatch, works: list[FBWork], logits: torch.Tensor, targets: torch.Tensor,
                         topk_targets: torch.Tensor | None) -> tuple[torch.Tensor, dict[int, torch.Tensor]]:
        """Log p(target) per position, [rows, width] (0 on rows of (N, K) targets), and per run of
        (N, K) targets, keyed by its first row, its [rows, width, K] logprobs of the K targets.

        Without (N, K) rows this is one `token_logprobs` call, as it always was. With them, the
        logits are `split` into groups of rows -- runs of (N,) rows, and each (N, K) run alone --
        so that every tenant's rows take the op they take alone (each (N, K) run on a block of its
        own shape) and the backward of the split concatenates the groups' gradients: no tenant's
        gradient is ever summed with another's, not even with zeros (that would flip -0.0)."""
        if topk_targets is None:
            return token_logprobs(logits, targets), {}
        groups = segments_of([(s, works[wi].targets_k) if works[wi].targets_k else None
                              for wi, s, e in mb.runs for _ in range(s, e)])
        flat, topk = [], {}
        for (key, s, e), piece in zip(groups, logits.split([e - s for _, s, e in groups])):
            if key is None:
                flat.append(token_logprobs(piece, targets[s:e]))
                continue
            lp = torch.log_softmax(piece.float(), dim=-1).gather(-1, topk_targets[s:e, :, :key[1]])
            topk[s] = lp
            flat.append(torch.zeros_like(targets[s:e], dtype=lp.dtype))
        return torch.cat(flat), topk

    def _graph_key(self, mb: MicroBatch, works: list[FBWork]) -> tuple:
        """What a captured step depends on: the layout, each run's loss and config (constants of
        the graph), each model's adapter (config and slots: where its rows read and add), and
        where the slot stacks live."""
        runs = tuple((s, e, works[wi].loss_fn, tuple(sorted(works[wi].loss_config.items())), works[wi].targets_k)
                     for wi, s, e in mb.runs)
        adapters = tuple((mid, s, e, self.adapters[mid].config, self.adapters[mid].slots()) for mid, s, e in mb.segments)
        return (mb.grad, mb.width, len(mb.rows), runs, adapters, self.routing.storage_version)

    def _put_back(self, mb: MicroBatch) -> Callable[[], None]:
        """Before a new graph's eager warm-up: what puts its gradient rows back afterwards."""
        if not mb.grad:
            return lambda: None
        return snapshot_gradient_rows([self.adapters[mid] for mid, _, _ in mb.segments])

    @staticmethod
    def _losses(works: list[FBWork], mb: MicroBatch, scored: ScoredRows, metric_sums) -> torch.Tensor:
        """Per-token losses, one `run_losses` call per model with its own runs only: the loss ops
        then see the model's rows exactly as when it trains alone (row slices of the same shape),
        and never a block merged with another model's rows (elementwise kernels may round a value
        differently at another position in a bigger tensor, see invariance.py). A run of (N, K)
        targets takes `topk_cross_entropy` on its own logprobs and a contiguous copy of its own
        weights (its K columns of the micro-batch's), as alone."""
        parts = []
        for segment in mb.segments:
            mine = [run for run in mb.runs if segment.start <= run.start < segment.end]
            for topk_runs, chunk in groupby(mine, key=lambda run: bool(works[run.key].targets_k)):
                if not topk_runs:
                    parts.append(_one_target_losses(works, list(chunk), scored, metric_sums))
                    continue
                for wi, rs, re in chunk:
                    weights = scored.topk_weights[rs:re, :, :works[wi].targets_k].contiguous()
                    parts.append(topk_cross_entropy(scored.topk[rs], weights) * scored.mask[rs:re])
        return parts[0] if len(parts) == 1 else torch.cat(parts)

    # -- the fusion probe's run (kernel_choices.py) ------------------------------------------------
    def _probe_run(self, embeds: torch.Tensor, targets: torch.Tensor, weights: torch.Tensor):
        """What a micro-batch computes from the embeddings on: logprobs and input gradients with
        grad enabled, and logprobs of a forward-only pass."""
        x = embeds.detach().requires_grad_(True)
        with self._probe_tenants(embeds.shape[0]), self._kernels():
            with torch.enable_grad():
                lp = token_logprobs(self.model(inputs_embeds=x, use_cache=False, **self.forward_kwargs).logits, targets)
                (lp * weights).sum().backward()
            with torch.no_grad():
                lp_forward_only = token_logprobs(
                    self.model(inputs_embeds=embeds, use_cache=False, **self.forward_kwargs).logits, targets)
        return lp.detach(), x.grad, lp_forward_only

    # -- optimizer -----------------------------------------------------------------------------
    def optim_step(self, model_id: str, params: AdamParams) -> dict[str, float]:
        return self.optim_steps([(model_id, params)])[0]

    def optim_steps(self, steps: list[tuple[str, AdamParams]]) -> list[dict[str, float] | SkippedStep]:
        """Every ready model's AdamW step of a cycle, together (`launch_optim_steps`, `wait`,
        results). Each model's result is as if stepped alone."""
        pending = self.launch_optim_steps(steps)
        self.wait()
        return pending.results()

    def launch_optim_steps(self, steps: list[tuple[str, AdamParams]]) -> PendingSteps:
        """Queue the AdamW steps without waiting for the device (adamw.launch_adamw): no host sync
        inside; `PendingSteps.results()` after the next `wait()`."""
        pending = launch_adamw([(self.adapter(mid), params) for mid, params in steps], self.policy)
        self._launched = self._launched or pending.metrics is not None
        return pending
