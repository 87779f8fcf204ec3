"""`TrainingRuntime`: the base model, every live adapter, and the fused forward/backward.

One call of `forward_backward` takes the work of many models (each item one request, with its
own loss function) and runs it as one batch: rows are laid out adapter by adapter, the
`MultiLoRALinear` layers apply each row's own adapter, every datum's loss is computed with its
request's loss function, and one backward of the *sum* of all losses leaves each adapter with
exactly its own gradient (the losses share no parameters). Gradients accumulate in the
adapters' gradient slots until that adapter's `optim_step`; a pass that fails leaves them as
they were before it (`GradientPass`).

Exactness: a tenant gets the same bits alone or co-batched. Its rows go through the same
micro-batch shapes either way (`_micro_batches`); several tenants share a micro-batch only where
the `FusionPolicy` has proven on this machine that the base model treats rows independently
(otherwise each tenant's pieces run as micro-batches of their own), and each tenant's loss is
computed on its own rows.
"""

from __future__ import annotations

import logging
import time
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F

from .adapters import AdamParams, GradientPass, LoRAAdapter, LoRAConfig, adamw_step
from ..checkpoints.format import CheckpointError, LoadedCheckpoint, read_checkpoint, restore_adapter, save_adapter
from .invariance import FusionPolicy, RowIndependenceProbe
from .losses import LOSS_INPUT_KEYS, LOSSES, merge_metrics, run_losses
from .multi_lora import LoRARouting, MultiLoRALinear, attach_multi_lora, segments_of
from .recompute import RECOMPUTE_OFF, RecomputeChoice, recompute_activations

log = logging.getLogger(__name__)

@dataclass
class DatumWork:
    tokens: np.ndarray  # int64 [N]
    inputs: dict[str, np.ndarray]  # loss_fn_inputs, already validated


@dataclass
class FBWork:
    """One forward / forward_backward request of one model (already validated)."""

    model_id: str
    data: list[DatumWork]
    loss_fn: str
    loss_config: dict[str, float]
    forward_only: bool


@dataclass
class FBOutcome:
    outputs: list[dict[str, np.ndarray]]  # per datum: logprobs, elementwise_loss
    metrics: dict[str, float]


@dataclass
class PassStats:
    """What one fused pass did, for metrics and benchmarks."""

    models: int = 0
    datums: int = 0
    tokens: int = 0
    padded_tokens: int = 0
    micro_batches: int = 0
    seconds: float = 0.0


def bucket_width(n: int) -> int:
    """Padded width for a sequence of n tokens: 16, 24, 32, 48, 64, 96, ... (at most 1.5x n)."""
    width = 16
    while width < n:
        width = width * 3 // 2 if (width & (width - 1)) == 0 else width * 4 // 3
    return width


def token_logprobs(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """log p(target) per position, in float32: [rows, width, vocab] logits -> [rows, width]."""
    rows, width, vocab = logits.shape
    return -F.cross_entropy(logits.float().reshape(-1, vocab), targets.reshape(-1),
                            reduction="none").reshape(rows, width)


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


class TrainingRuntime:
    def __init__(self, model: torch.nn.Module, base_model_name: str, *, device: torch.device,
                 max_tokens_per_micro_batch: int = 0, max_live_adapters: int = 64, check_fusion: bool = True,
                 recompute: RecomputeChoice = RECOMPUTE_OFF):
        self.model = model
        self.base_model_name = base_model_name
        self.device = device
        # 0 = auto, as the --max-tokens-per-micro-batch flag.
        self.max_tokens_per_micro_batch = max_tokens_per_micro_batch or default_micro_batch_tokens(model, device)
        for p in model.parameters():
            p.requires_grad_(False)
        model.eval()  # no dropout: training through LoRA must be deterministic
        # Whether decoder layers recompute their activations in the backward (runtime/recompute.py).
        self.recompute = recompute
        if recompute.on:
            recompute_activations(self.base_module)
        self.policy = self._fusion_policy()
        self.routing = LoRARouting(self.policy)
        self.layers: dict[str, MultiLoRALinear] = attach_multi_lora(model, self.routing)
        self.adapters: dict[str, LoRAAdapter] = {}
        # Adapters attached to the layers and resident on `device`, least recently used first.
        self.max_live_adapters = max_live_adapters
        self.live: OrderedDict[str, None] = OrderedDict()
        self.page_outs = 0
        cfg = model.config
        self.vocab_size = int(model.get_output_embeddings().out_features)
        self.max_context = int(getattr(cfg, "max_position_embeddings", 1 << 20))
        self.last_pass = PassStats()
        if check_fusion:  # a rank of a pool checks once its model is sharded (runtime/distributed.py)
            self.check_fusion()

    @property
    def base_module(self) -> torch.nn.Module:
        """The transformers model itself (a pool's rank 0 wraps it: runtime/distributed.py)."""
        return self.model

    def _fusion_policy(self) -> FusionPolicy:
        return FusionPolicy(self.device, mixing_probe=RowIndependenceProbe(self._probe_sample, self._probe_run))

    def check_fusion(self) -> None:
        """Whether tenants may share micro-batches, decided on this machine before any request, on
        64 rows of the shortest bucket (0.1-0.4 s on the embedded model, 1 CPU thread); if that
        fails, they never do; each other shape is probed when first used.

        On CPU, where the plain model fails, the probe is tried once more with the input gradients
        of the frozen projections taken from transposed copies of their weights
        (`FrozenProjection`): on the 256x4 benchmark model that is what made the probe pass (its
        `lm_head` gradient was the one call whose rows changed bits), at the cost of one more copy
        of the projections' weights. If it fails that way too, the copies are dropped."""
        width = bucket_width(1)
        rows = max(2, min(64, self.max_tokens_per_micro_batch // width))
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
        """Run all `works` fused, in as few micro-batches as the token budget allows.

        All or nothing for gradients: if the pass raises, every adapter's gradients are what
        they were before the call. For a rank of a pool (runtime/distributed.py):
        `after_phase(grad, micro_batches_run)` follows the gradient and the forward-only
        micro-batches, and `before_commit()` runs once they are all done, its failure rolling
        the pass back like any other.
        """
        start = time.perf_counter()
        self.ensure_live([w.model_id for w in works])
        stats = PassStats(models=len({w.model_id for w in works}))
        per_datum: dict[tuple[int, int], dict[str, np.ndarray]] = {}
        # Per request: "loss:sum" (float64 over its datums) plus any metrics its loss reports.
        metric_sums: list[dict[str, float]] = [{"loss:sum": 0.0} for _ in works]
        grad_pass = GradientPass([self.adapters[m] for m in dict.fromkeys(w.model_id for w in works
                                                                         if not w.forward_only)])
        try:
            for grad in (True, False):
                run = 0
                for batch in self._micro_batches(self._phase_rows(works, grad), works):
                    self._run_micro_batch(batch, works, grad, per_datum, metric_sums, stats)
                    run += 1
                if after_phase is not None:
                    after_phase(grad, run)
            if before_commit is not None:
                before_commit()
        except BaseException:
            grad_pass.rollback()
            raise
        grad_pass.commit()
        outcomes = []
        for wi, work in enumerate(works):
            outputs = [per_datum[(wi, di)] for di in range(len(work.data))]
            outcomes.append(FBOutcome(outputs=outputs, metrics=metric_sums[wi]))
            stats.datums += len(work.data)
        stats.seconds = time.perf_counter() - start
        self.last_pass = stats
        return outcomes

    @staticmethod
    def _phase_rows(works: list[FBWork], grad: bool) -> list[tuple[int, int]]:
        """(work, datum) of the rows of the gradient phase (grad) or of the forward-only one."""
        return [(wi, di) for wi, w in enumerate(works) if w.forward_only != grad for di in range(len(w.data))]

    def mixing_shapes(self, works: list[FBWork]) -> set[tuple[int, int]]:
        """(width, rows) of every micro-batch of `works` that could hold several tenants: the shapes
        `FusionPolicy.mix_tenants` will be asked about, without asking."""
        return {(width, size) for grad in (True, False)
                for width, pieces, size in self._packs(self._phase_rows(works, grad), works) if len(pieces) > 1}

    def micro_batch_counts(self, works: list[FBWork]) -> tuple[int, int]:
        """How many gradient and forward-only micro-batches `forward_backward(works)` runs."""
        return tuple(sum(1 for _ in self._micro_batches(self._phase_rows(works, grad), works))  # type: ignore[return-value]
                     for grad in (True, False))

    def _micro_batches(self, rows: list[tuple[int, int]], works: list[FBWork]):
        """Bucket rows by padded width, then pack whole per-model pieces into micro-batches.

        Every row is padded to a width that depends on its own length only (`bucket_width`), and
        a model's rows in a bucket are cut into pieces that depend on its own rows only: the
        pieces a model runs alone. Pieces of several models share a micro-batch only where the
        policy has proven that the base model treats rows independently for that shape;
        otherwise each piece is a micro-batch of its own. Either way a model's rows go through
        exactly its solo computation, in its solo gradient-accumulation order: co-batching
        changes nothing in its results, bit for bit. Bucketing also keeps padding waste low when
        long and short sequences share a cycle.
        """
        for width, pieces, size in self._packs(rows, works):
            yield from self._release(width, pieces, size, works)

    def _packs(self, rows: list[tuple[int, int]], works: list[FBWork]):
        """(width, per-model pieces, rows) of each micro-batch before the policy is asked whether
        its pieces may run together (`_release`).
        """
        buckets: dict[int, dict[str, list[tuple[int, int]]]] = {}
        for wi, di in rows:
            width = bucket_width(len(works[wi].data[di].tokens))
            buckets.setdefault(width, {}).setdefault(works[wi].model_id, []).append((wi, di))
        for width in sorted(buckets):
            cap = max(1, self.max_tokens_per_micro_batch // width)
            batch: list[list[tuple[int, int]]] = []
            size = 0
            for model_id in sorted(buckets[width]):
                group = buckets[width][model_id]
                for i in range(0, len(group), cap):
                    piece = group[i:i + cap]
                    if batch and size + len(piece) > cap:
                        yield width, batch, size
                        batch, size = [], 0
                    batch.append(piece)
                    size += len(piece)
            if batch:
                yield width, batch, size

    def _release(self, width: int, pieces: list[list[tuple[int, int]]], rows: int, works: list[FBWork]):
        if len(pieces) > 1 and not self.policy.mix_tenants(width, rows):
            for piece in pieces:
                yield width, piece
        else:
            yield width, self._order_pieces(pieces, works)

    def _order_pieces(self, pieces: list[list[tuple[int, int]]], works: list[FBWork]) -> list[tuple[int, int]]:
        """Lay a micro-batch's per-model pieces out so that same-shape adapters sit side by side.

        The layers batch consecutive segments of equal rank and row count into one matmul where
        the policy allows it; the order of pieces within a micro-batch changes no model's results
        (rows are independent there), only how many groups the layers run.
        """
        def key(piece):
            cfg = self.adapters[works[piece[0][0]].model_id].config
            return (cfg.rank, cfg.alpha, cfg.train_attn, cfg.train_mlp, cfg.train_unembed,
                    cfg.target_modules or (), len(piece), works[piece[0][0]].model_id)

        return [row for piece in sorted(pieces, key=key) for row in piece]

    def _run_micro_batch(self, width_and_batch, works, grad, per_datum, metric_sums, stats: PassStats) -> None:
        width, batch = width_and_batch
        lengths = [len(works[wi].data[di].tokens) for wi, di in batch]
        rows = len(batch)
        # Padded inputs built in numpy and handed over once: no tensor op per datum.
        ids = np.zeros((rows, width), dtype=np.int64)
        targets = np.zeros((rows, width), dtype=np.int64)
        mask = np.zeros((rows, width), dtype=np.float32)
        inputs = {k: np.zeros((rows, width), dtype=np.float32) for k in LOSS_INPUT_KEYS}
        for r, (wi, di) in enumerate(batch):
            d = works[wi].data[di]
            n = lengths[r]
            ids[r, :n] = d.tokens
            targets[r, :n] = d.inputs["target_tokens"]
            mask[r, :n] = 1.0
            for k in LOSS_INPUT_KEYS:
                if k in d.inputs:
                    inputs[k][r, :n] = d.inputs[k]
        dev = self.device
        ids_t, targets_t, mask_t = (torch.from_numpy(a).to(dev) for a in (ids, targets, mask))
        inputs_t = {k: torch.from_numpy(v).to(dev) for k, v in inputs.items()}

        # Contiguous runs of rows that share a request (one loss each), and of rows that share a
        # model (one adapter segment each).
        runs = segments_of([wi for wi, _ in batch])
        segments = segments_of([works[wi].model_id for wi, _ in batch])
        with self.routing.batch(segments), torch.set_grad_enabled(grad):
            # Right padding and a causal mask: real tokens never see the pads after them.
            logits = self.model(input_ids=ids_t, use_cache=False).logits
            logprobs = token_logprobs(logits, targets_t)
            del logits
            tok_loss = self._losses(works, runs, segments, logprobs, inputs_t, mask_t, metric_sums)
            lp_cpu = logprobs.detach().cpu().numpy()
            el_cpu = tok_loss.detach().cpu().numpy()
            for r, (wi, di) in enumerate(batch):
                n = lengths[r]
                per_datum[(wi, di)] = {
                    "logprobs": lp_cpu[r, :n].astype(np.float32, copy=True),
                    "elementwise_loss": el_cpu[r, :n].astype(np.float32, copy=True),
                }
                metric_sums[wi]["loss:sum"] += float(el_cpu[r, :n].astype(np.float64).sum())
            if grad and tok_loss.requires_grad:
                tok_loss.sum().backward()
        stats.micro_batches += 1
        stats.tokens += sum(lengths)
        stats.padded_tokens += rows * width

    @staticmethod
    def _losses(works, runs, segments, logprobs, inputs, mask, metric_sums) -> torch.Tensor:
        """Per-token losses, one `run_losses` call per model with its own runs only: the loss ops
        then see the model's rows exactly as when it trains alone (row slices of the same shape),
        and never a block merged with another model's rows (elementwise kernels may round a value
        differently at another position in a bigger tensor, see invariance.py)."""
        parts = []
        for _, s, e in segments:
            mine = [(wi, rs, re) for wi, rs, re in runs if s <= rs < e]
            # Only the inputs its losses take (their specs name them): run_losses slices every
            # input it is given, per block, and there is a block per model.
            specs = [LOSSES[works[wi].loss_fn] for wi, _, _ in mine]
            used = {k: v for k, v in inputs.items() if any(k in sp.required_inputs or k in sp.inputs for sp in specs)}
            tok_loss, run_metrics = run_losses(
                [(works[wi].loss_fn, works[wi].loss_config, rs, re) for wi, rs, re in mine], logprobs, used, mask)
            parts.append(tok_loss)
            for (wi, _, _), metrics in zip(mine, run_metrics):
                merge_metrics(metric_sums[wi], metrics)
        return parts[0] if len(parts) == 1 else torch.cat(parts)

    # -- the fusion probe (see invariance.py) -----------------------------------------------------
    def _probe_sample(self, width: int, rows: int, seed: int) -> tuple[torch.Tensor, ...]:
        """Random probe rows: token embeddings of the model, target ids, loss weights."""
        gen = torch.Generator(device="cpu").manual_seed(seed * 7919 + width)
        ids = torch.randint(0, self.vocab_size, (rows, width), generator=gen).to(self.device)
        targets = torch.randint(0, self.vocab_size, (rows, width), generator=gen).to(self.device)
        weights = torch.randn(rows, width, generator=gen).to(self.device)
        with torch.no_grad():
            return self.model.get_input_embeddings()(ids), targets, weights

    def _probe_run(self, embeds: torch.Tensor, targets: torch.Tensor, weights: torch.Tensor):
        """What a micro-batch computes from the embeddings on: logprobs and input gradients with
        grad enabled, and logprobs of a forward-only pass."""
        x = embeds.detach().requires_grad_(True)
        with torch.enable_grad():
            lp = token_logprobs(self.model(inputs_embeds=x, use_cache=False).logits, targets)
            (lp * weights).sum().backward()
        with torch.no_grad():
            lp_forward_only = token_logprobs(self.model(inputs_embeds=embeds, use_cache=False).logits, targets)
        return lp.detach(), x.grad, lp_forward_only

    # -- optimizer -----------------------------------------------------------------------------
    def optim_step(self, model_id: str, params: AdamParams) -> dict[str, float]:
        return self.optim_steps([(model_id, params)])[0]

    def optim_steps(self, steps: list[tuple[str, AdamParams]]) -> list[dict[str, float]]:
        """Every ready model's AdamW step of a cycle, together (one fused kernel per distinct
        set of hyper-parameters; see `adamw_step`). Each model's result is as if stepped alone."""
        return adamw_step([(self.adapter(mid), params) for mid, params in steps], self.policy)

    # -- checkpoints ---------------------------------------------------------------------------
    def save(self, model_id: str, out_dir: Path, *, with_optimizer: bool, overwrite: bool = False) -> int:
        return save_adapter(self.adapter(model_id), out_dir, self.base_model_name,
                            with_optimizer=with_optimizer, overwrite=overwrite)

    def read(self, ckpt_dir: Path, *, with_optimizer: bool) -> LoadedCheckpoint:
        ckpt = read_checkpoint(ckpt_dir, with_optimizer=with_optimizer)
        if ckpt.base_model and ckpt.base_model != self.base_model_name:
            raise CheckpointError(
                f"checkpoint was trained on base model {ckpt.base_model!r}; this server serves "
                f"{self.base_model_name!r}")
        return ckpt

    def load(self, model_id: str, ckpt: LoadedCheckpoint) -> LoRAAdapter:
        """(Re)build `model_id`'s adapter from a checkpoint: its LoRA config comes from the files."""
        old = self.adapters.get(model_id)
        self.remove_adapter(model_id)
        try:
            adapter = self.create_adapter(model_id, ckpt.config)
            restore_adapter(adapter, ckpt)
        except Exception:
            self.remove_adapter(model_id)
            if old is not None:  # leave the model as it was
                self.adapters[model_id] = old
                self.ensure_live([model_id])
            raise
        return adapter
