"""`TrainingRuntime`: the base model, every live adapter, and the fused forward/backward.

One call of `forward_backward` takes the work of many models (each item one request, with its
own loss function) and runs it as one batch: rows are laid out adapter by adapter, the
`MultiLoRALinear` layers apply each row's own adapter, every datum's loss is computed with its
request's loss function, and one backward of the *sum* of all losses leaves each adapter with
exactly its own gradient (the losses share no parameters). Gradients accumulate on the
adapters' tensors until that adapter's `optim_step`.
"""

from __future__ import annotations

import logging
import time
from collections import OrderedDict
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F

from .adapters import AdamParams, LoRAAdapter, LoRAConfig, adamw_step
from ..checkpoints.format import CheckpointError, LoadedCheckpoint, read_checkpoint, restore_adapter, save_adapter
from .losses import LOSS_INPUT_KEYS, merge_metrics, run_losses
from .multi_lora import LoRARouting, MultiLoRALinear, attach_multi_lora

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
                 max_tokens_per_micro_batch: int = 0, max_live_adapters: int = 64):
        self.model = model
        self.base_model_name = base_model_name
        self.device = device
        # 0 = auto, as the --max-tokens-per-micro-batch flag.
        self.max_tokens_per_micro_batch = max_tokens_per_micro_batch or default_micro_batch_tokens(model, device)
        for p in model.parameters():
            p.requires_grad_(False)
        model.eval()  # no dropout: training through LoRA must be deterministic
        self.routing = LoRARouting()
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
            adapter.detach(self.layers)
            self.live.pop(model_id, None)

    def ensure_live(self, model_ids) -> None:
        """Page in the adapters about to run; page out least-recently-used idle ones over the limit.

        Paging moves weights, gradients and AdamW moments to CPU memory and detaches the adapter
        from the layers, so the device holds at most `max_live_adapters` tenants' state.
        """
        needed = [m for m in dict.fromkeys(model_ids) if m in self.adapters]
        for mid in needed:
            if mid not in self.live:
                adapter = self.adapters[mid]
                adapter.move_to(self.device)
                adapter.attach(self.layers)
            self.live[mid] = None
            self.live.move_to_end(mid)
        for mid in list(self.live):
            if len(self.live) <= self.max_live_adapters:
                break
            if mid in needed:
                continue
            adapter = self.adapters[mid]
            adapter.detach(self.layers)
            adapter.move_to(torch.device("cpu"))
            del self.live[mid]
            self.page_outs += 1

    def adapter(self, model_id: str) -> LoRAAdapter:
        try:
            return self.adapters[model_id]
        except KeyError:
            raise KeyError(f"model {model_id!r} is not loaded") from None

    # -- forward / backward --------------------------------------------------------------------
    def forward_backward(self, works: list[FBWork]) -> list[FBOutcome]:
        """Run all `works` fused, in as few micro-batches as the token budget allows."""
        start = time.perf_counter()
        self.ensure_live([w.model_id for w in works])
        stats = PassStats(models=len({w.model_id for w in works}))
        per_datum: dict[tuple[int, int], dict[str, np.ndarray]] = {}
        # Per request: "loss:sum" (float64 over its datums) plus any metrics its loss reports.
        metric_sums: list[dict[str, float]] = [{"loss:sum": 0.0} for _ in works]
        for grad in (True, False):
            rows = [(wi, di) for wi, w in enumerate(works) if w.forward_only != grad for di in range(len(w.data))]
            batches = list(self._micro_batches(rows, works))
            if grad and len(batches) > 1:
                # Only when micro-batches follow each other (see LoRAAdapter.prepare_grads).
                for model_id in dict.fromkeys(w.model_id for w in works if not w.forward_only):
                    self.adapters[model_id].prepare_grads()
            for batch in batches:
                self._run_micro_batch(batch, works, grad, per_datum, metric_sums, stats)
        outcomes = []
        for wi, work in enumerate(works):
            outputs = [per_datum[(wi, di)] for di in range(len(work.data))]
            outcomes.append(FBOutcome(outputs=outputs, metrics=metric_sums[wi]))
            stats.datums += len(work.data)
        stats.seconds = time.perf_counter() - start
        self.last_pass = stats
        return outcomes

    def _micro_batches(self, rows: list[tuple[int, int]], works: list[FBWork]):
        """Bucket rows by padded width, then pack whole per-model groups into micro-batches.

        Every row is padded to a width that depends on its own length only (`bucket_width`), and
        a model's rows in a bucket are cut into pieces that depend on its own rows only. So a
        model's rows go through exactly the same shapes and the same gradient-accumulation order
        whether it trains alone or fused with other tenants: co-batching changes nothing in its
        results, bit for bit (the base projections treat rows independently). Bucketing also
        keeps padding waste low when long and short sequences share a cycle.
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
                        yield width, self._order_pieces(batch, works)
                        batch, size = [], 0
                    batch.append(piece)
                    size += len(piece)
            if batch:
                yield width, self._order_pieces(batch, works)

    def _order_pieces(self, pieces: list[list[tuple[int, int]]], works: list[FBWork]) -> list[tuple[int, int]]:
        """Lay a micro-batch's per-model pieces out so that same-shape adapters sit side by side.

        `MultiLoRALinear` batches consecutive segments of equal rank and row count into one
        matmul; the order of pieces within a micro-batch changes no model's results (rows are
        independent), only how many groups the layers run.
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
        ids = torch.zeros(rows, width, dtype=torch.long)
        targets = torch.zeros(rows, width, dtype=torch.long)
        mask = torch.zeros(rows, width)
        inputs = {k: torch.zeros(rows, width) for k in LOSS_INPUT_KEYS}
        for r, (wi, di) in enumerate(batch):
            d = works[wi].data[di]
            n = lengths[r]
            ids[r, :n] = torch.from_numpy(d.tokens)
            targets[r, :n] = torch.from_numpy(np.asarray(d.inputs["target_tokens"], dtype=np.int64))
            mask[r, :n] = 1.0
            for k in LOSS_INPUT_KEYS:
                if k in d.inputs:
                    inputs[k][r, :n] = torch.from_numpy(np.asarray(d.inputs[k], dtype=np.float32))
        ids, targets, mask = ids.to(self.device), targets.to(self.device), mask.to(self.device)
        inputs = {k: v.to(self.device) for k, v in inputs.items()}

        # Contiguous runs of rows that share a request: one adapter segment / one loss each.
        runs: list[tuple[int, int, int]] = []  # (work index, start, end)
        for r, (wi, _) in enumerate(batch):
            if runs and runs[-1][0] == wi:
                runs[-1] = (wi, runs[-1][1], r + 1)
            else:
                runs.append((wi, r, r + 1))
        segments: list[tuple[str | None, int, int]] = []
        for wi, s, e in runs:
            mid = works[wi].model_id
            if segments and segments[-1][0] == mid:
                segments[-1] = (mid, segments[-1][1], e)
            else:
                segments.append((mid, s, e))
        self.routing.segments = segments
        try:
            with torch.set_grad_enabled(grad):
                # Right padding and a causal mask: real tokens never see the pads after them.
                logits = self.model(input_ids=ids, use_cache=False).logits
                vocab = logits.shape[-1]
                logprobs = -F.cross_entropy(logits.float().reshape(-1, vocab), targets.reshape(-1),
                                            reduction="none").reshape(rows, width)
                del logits
                tok_loss, run_metrics = run_losses(
                    [(works[wi].loss_fn, works[wi].loss_config, s, e) for wi, s, e in runs], logprobs, inputs, mask)
                for (wi, _, _), m in zip(runs, run_metrics):
                    merge_metrics(metric_sums[wi], m)
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
        finally:
            self.routing.segments = []
        stats.micro_batches += 1
        stats.tokens += sum(lengths)
        stats.padded_tokens += rows * width

    # -- optimizer -----------------------------------------------------------------------------
    def optim_step(self, model_id: str, params: AdamParams) -> dict[str, float]:
        return self.optim_steps([(model_id, params)])[0]

    def optim_steps(self, steps: list[tuple[str, AdamParams]]) -> list[dict[str, float]]:
        """Every ready model's AdamW step of a cycle, together (one fused kernel per distinct
        set of hyper-parameters; see `adamw_step`). Each model's result is as if stepped alone."""
        return adamw_step([(self.adapter(mid), params) for mid, params in steps])

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
