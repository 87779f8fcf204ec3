"""`PoolRuntime`: one base model's runtime on a pool of torch.distributed ranks.

Rank 0 is the server's own process (`PoolRuntime`, a `TrainingRuntime` that also drives the
others); ranks 1.. are processes started by torchrun (`FollowerRuntime`, pool_worker.py). The
front end talks to rank 0 only. Rank 0 holds the truth: every adapter's weights, gradients and
AdamW state. The other ranks hold copies of the adapters' weights and compute their share of
each pass:

- a pass's requests are split across ranks by whole datums (`rank_shares.split_datums`: depends on the
  request alone, so a tenant's share and bits never depend on who it shares the cycle with);
  each rank runs its share through the same fused forward/backward as one rank does, with rank
  0's fusion decisions (`DecidedByRankZero`: rank 0 proves each micro-batch shape once and sends
  its answers with the pass, so the policy is the same on every rank);
- each adapter's new gradients are summed into rank 0's with one `reduce` per adapter (a sum
  whose order depends on that adapter's tensor alone), after every rank said its share worked;
  per-datum outputs and metrics are gathered to rank 0 and put back in request order;
- optimizer steps, checkpoints and loads run on rank 0; adapters whose weights changed are
  broadcast to the other ranks before the next pass (so optimizer steps are identical on every
  rank: they are rank 0's). Sampling runs on rank 0 (with a sharded base the others mirror
  each forward so that FSDP's all-gathers pair up).

A share that raises (one request's datum the model cannot take) aborts the pass on every rank, and
rank 0 raises it as the pass's error: the worker reruns the pass's requests in halves until that
request fails alone (isolation.py), as on one rank. A rank that dies mid-pass makes a collective
fail (`PoolBroken`), and so does a share that raises where the base is sharded (FSDP's collectives
no longer pair up): a `MachineFault`, the pass's requests fail with category `server`, nothing is
rerun, rank 0's gradients are rolled back to before the pass. A rank that died while the pool was
idle fails nothing: the next command finds it gone (`_ensure_pool`, `_send`), and the pool is
relaunched -- a new epoch, new processes, every adapter sent again from rank 0 -- before it goes out.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager, nullcontext

import torch
from torch import nn

from .. import faults
from ..errors import MachineFault
from .adamw import PendingSteps
from .adapters import AdamParams, GradientPass, LoRAAdapter, LoRAConfig, zero_grads
from .invariance import FusionPolicy
from .pool_launch import RankPool
from .rank_shares import merged_outcome, split_datums
from .rank_group import PoolBroken, RankGroup
from .recompute import RECOMPUTE_OFF, RecomputeChoice, recompute_activations
from .sharding import ShardedBase, root_unsharded, shard_base, transplant_lora_layers
from .packing import bucket_width
from ..requests.kinds import FBOutcome, FBWork
from .pass_io import ReadyPass
from .pool_messages import Mirror, PassShare, ShareResult, Stop, Sync, flat_tensors, unflatten_into
from .trainer import PassStats, TrainingRuntime

log = logging.getLogger(__name__)


class PassAborted(RuntimeError):
    """Another rank's share of this pass failed; every rank rolls its share back."""


class DecidedByRankZero(FusionPolicy):
    """A rank's policy whose tenant-mixing answers are rank 0's, sent with each pass (a rank must
    never probe alone: with a sharded base the probe's forwards are collectives). Kernel-level
    decisions (grouped LoRA matmuls) concern this rank's own kernels and are proven here."""

    def __init__(self, device: torch.device):
        super().__init__(device, mixing_probe=None)
        self._decided: dict[tuple[int, int], bool] = {}

    def adopt(self, decisions: dict[tuple[int, int], bool]) -> None:
        self._decided.update(decisions)

    def mix_tenants(self, width: int, rows: int) -> bool:
        try:
            return self._decided[(width, rows)]
        except KeyError:
            raise RuntimeError(f"rank 0 sent no decision for {rows} x {width} micro-batches") from None


class RankRuntime(TrainingRuntime):
    """One rank's `TrainingRuntime`: its share of a pass, kept in step with the other ranks."""

    # Every rank computes alike, and the other ranks never probe (a sharded base's weights are
    # DTensors, with no transposed copy to keep): the plain layout everywhere.
    may_transpose_frozen_weights = False

    def __init__(self, model, base_model_name: str, *, device: torch.device, group: RankGroup, shard: bool,
                 max_tokens_per_micro_batch: int = 0, max_live_adapters: int = 64,
                 recompute: RecomputeChoice = RECOMPUTE_OFF):
        self.group = group
        self.sharded = shard
        # No CUDA graphs in a pool: its passes run collectives between the ranks (eager, as the
        # sharded base's all-gathers must pair up).
        super().__init__(model, base_model_name, device=device, max_tokens_per_micro_batch=max_tokens_per_micro_batch,
                         max_live_adapters=max_live_adapters, check_fusion=False, recompute=recompute,
                         cuda_graphs=False)
        if shard:
            shard_base(self.base_module, group.mesh())

    def _causal_kwargs(self) -> dict:
        return {}  # no trial forward on one rank (a sharded base's forward is a collective)

    def _no_mask_attention(self) -> str | None:
        return None  # as `_causal_kwargs`

    def run_share(self, works: list[FBWork], pad: tuple[int, int], model_ids: list[str]) -> list[FBOutcome]:
        """This rank's share of a pass. Every rank says whether its share worked (one
        `all_gather`); only if all did are the new gradients reduced into rank 0's, else every
        rank rolls back (`PassAborted` where another rank failed)."""
        self.ensure_live(model_ids)
        trained = sorted({w.model_id for w in works if not w.forward_only})
        agreed = False

        def after_phase(grad: bool, run: int) -> None:
            for _ in range(pad[0 if grad else 1] - run):
                self._idle_pass(grad)

        def before_commit() -> None:
            nonlocal agreed
            agreed = True
            if not all(self.group.all_gather(True)):
                raise PassAborted("another rank of the worker pool failed its share of this pass")
            self._reduce_gradients(trained)

        try:
            # This process's own share (TrainingRuntime's launch: rank 0's own is the pool's pass).
            pending = TrainingRuntime.launch_forward_backward(self, works, after_phase=after_phase,
                                                              before_commit=before_commit)
            self.wait()
            return pending.outcomes()
        except (PoolBroken, PassAborted):
            raise
        except Exception as e:
            if self.sharded or agreed:  # the ranks' collectives no longer pair up
                self.group.broken = True
                raise PoolBroken(f"this rank's share of the pass failed ({type(e).__name__}: {e})") from e
            self.group.all_gather(False)  # the others wait to hear how this rank's share went
            raise

    def _reduce_gradients(self, model_ids: list[str]) -> None:
        """Each trained adapter's gradient rows (rank 0: what it accumulated so far plus its share;
        the others: their share only) summed into rank 0's, one adapter at a time."""
        for mid in model_ids:
            adapter = self.adapters[mid]
            views = [v for path in sorted(adapter.weights) for v in adapter.weights[path].grad_views]
            flat = flat_tensors(views, self.group.device)
            self.group.reduce(flat)
            if self.group.rank == 0:
                unflatten_into(flat, views)

    def _idle_pass(self, grad: bool) -> None:
        """A one-row micro-batch with no adapter: its all-gathers pair up with another rank's
        real micro-batch (sharded base only)."""
        ids = torch.zeros((1, bucket_width(1)), dtype=torch.long, device=self.device)
        with torch.set_grad_enabled(grad):
            logits = self.model(input_ids=ids, use_cache=False).logits
            if grad:
                logits.float().sum().backward()

    def _probe_sample(self, width: int, rows: int, seed: int):
        with root_unsharded(self.base_module) if self.sharded else nullcontext():
            return super()._probe_sample(width, rows, seed)


class FollowerRuntime(RankRuntime):
    """Ranks 1..: do what rank 0 says, until it says stop (or the pool breaks)."""

    def __init__(self, *args, epoch: int, **kwargs):
        self.epoch = epoch
        super().__init__(*args, **kwargs)

    def _fusion_policy(self) -> FusionPolicy:
        return DecidedByRankZero(self.device)

    def serve(self) -> None:
        """The command loop; returns on `Stop`, raises `PoolBroken` when the group fails."""
        while True:
            cmd = self.group.scatter(None)
            if isinstance(cmd, Stop):
                return
            if isinstance(cmd, PassShare):
                self._pass(cmd)
            elif isinstance(cmd, Mirror):
                self._mirror(cmd)
            else:
                raise RuntimeError(f"unknown command from rank 0: {cmd!r}")

    def _pass(self, cmd: PassShare) -> None:
        self._apply_sync(cmd.sync)
        self.policy.adopt(cmd.decisions)
        trained = sorted({w.model_id for w in cmd.works if not w.forward_only})
        try:
            outcomes = self.run_share(cmd.works, cmd.pad, cmd.model_ids)
            result = ShareResult(outcomes=outcomes, stats=self.last_pass)
            zero_grads([self.adapters[m] for m in trained])  # rank 0 holds them now
        except PassAborted:
            result = ShareResult()
        except PoolBroken:
            raise
        except Exception as e:
            log.exception("rank %d: its share of a pass failed", self.group.rank)
            result = ShareResult(error=f"{type(e).__name__}: {e}")
        if self.epoch == 1:  # where tests kill a rank mid-pass, once (not again after the relaunch)
            faults.crash_point("pool.rank_mid_pass")
        self.group.gather(result)

    def _apply_sync(self, sync: Sync) -> None:
        for mid in sync.removed:
            self.remove_adapter(mid)
        for mid, config in sync.changed:
            adapter = self.adapters.get(mid)
            if adapter is None or adapter.config != config:
                self.remove_adapter(mid)
                adapter = self.create_adapter(mid, config)
            params = adapter.parameters()
            flat = torch.empty(sum(p.numel() for p in params), dtype=params[0].dtype, device=self.group.device)
            self.group.broadcast(flat)
            unflatten_into(flat, params)

    def _mirror(self, cmd: Mirror) -> None:
        if cmd.call == "forward":
            self._idle_pass(grad=False)
        elif cmd.call == "probe_sample":
            self._probe_sample(*cmd.args)
        elif cmd.call == "probe_run":
            embeds_shape, targets_shape = cmd.args
            dtype = next(self.base_module.parameters()).dtype
            self._probe_run(torch.zeros(embeds_shape, dtype=dtype, device=self.device),
                            torch.zeros(targets_shape, dtype=torch.long, device=self.device),
                            torch.zeros(targets_shape, device=self.device))
        else:
            raise RuntimeError(f"unknown mirror call from rank 0: {cmd.call!r}")


class PoolRuntime(RankRuntime):
    """Rank 0: the `ModelRuntime` the worker and the API see, driving the pool's other ranks."""

    def __init__(self, model: nn.Module, base_model_name: str, *, device: torch.device, pool: RankPool,
                 reload_base: Callable[[], nn.Module], max_tokens_per_micro_batch: int = 0,
                 max_live_adapters: int = 64, recompute: RecomputeChoice = RECOMPUTE_OFF):
        self.pool = pool
        self.reload_base = reload_base  # the base model from disk, on the CPU: a relaunch re-shards it
        self.relaunches = 0
        self._own = 0  # > 0 while rank 0 runs its own pass or probe: nothing to mirror
        self._synced: dict[str, LoRAConfig] = {}  # what the other ranks hold
        self._dirty: set[str] = set()  # adapters whose weights changed since they last got them
        shard = pool.settings.shard_base
        super().__init__(ShardedBase(model, self._mirror_forward) if shard else model, base_model_name,
                         device=device, group=pool.group, shard=shard,
                         max_tokens_per_micro_batch=max_tokens_per_micro_batch, max_live_adapters=max_live_adapters,
                         recompute=recompute)
        with self._own_calls():
            self.check_fusion()

    @property
    def base_module(self) -> nn.Module:
        return self.model.module if isinstance(self.model, ShardedBase) else self.model

    @property
    def world(self) -> int:
        return self.group.world

    @contextmanager
    def _own_calls(self) -> Iterator[None]:
        self._own += 1
        try:
            yield
        finally:
            self._own -= 1

    # -- the pool ----------------------------------------------------------------------------------
    def _ensure_pool(self) -> None:
        """Relaunch the pool if a rank died (seen by a failed collective, torchrun's exit, or a
        restarted rank of another machine asking to rejoin), waiting for its ranks within
        --pool-timeout-s; a `MachineFault` if it cannot be brought back."""
        if self.pool.healthy():
            return
        log.warning("worker pool: a rank is gone (epoch %d); relaunching the other ranks", self.pool.epoch)
        try:
            self.group = self.pool.start()
        except Exception as e:
            raise MachineFault(f"the worker pool is down and could not be relaunched ({e}); resubmit") from e
        self.relaunches += 1
        self._synced.clear()  # new processes: every adapter goes to them again
        if self.sharded:
            self._rebase()
        log.info("worker pool: back (epoch %d, relaunch %d); adapters are resent from rank 0", self.pool.epoch,
                 self.relaunches)

    def _rebase(self) -> None:
        """Rank 0's shards belong to the old process group: load the base model again, move the
        multi-LoRA layers (adapters, snapshots) into it, and shard it over the new group."""
        fresh = self.reload_base()
        transplant_lora_layers(fresh, self.layers)
        for p in fresh.parameters():
            p.requires_grad_(False)
        fresh.eval()
        if self.recompute.on:
            recompute_activations(fresh)
        shard_base(fresh, self.group.mesh())
        self.model.module = fresh

    def _send(self, commands: Callable[[], list]) -> list:
        """One command per rank (made by `commands`), sent; returns them. A pool found broken as the
        command goes out -- a rank that died while the pool was idle: gloo saw its socket close --
        is relaunched and the command made and sent again: no rank had begun it, rank 0 had
        changed nothing."""
        sent = commands()
        try:
            self.group.scatter(sent)
        except PoolBroken as e:
            log.warning("worker pool: a rank was gone before this command went out (%s)", e)
            self._ensure_pool()
            sent = commands()
            self.group.scatter(sent)
        return sent

    def _mirror(self, call: str, *args) -> None:
        if self.sharded:
            self._send(lambda: [Mirror(call, args)] * self.world)

    def _mirror_forward(self) -> None:
        if not self._own:
            self._ensure_pool()
            self._mirror("forward")

    def _probe_sample(self, width: int, rows: int, seed: int):
        self._mirror("probe_sample", width, rows, seed)
        with self._own_calls():
            return super()._probe_sample(width, rows, seed)

    def _probe_run(self, embeds: torch.Tensor, targets: torch.Tensor, weights: torch.Tensor):
        self._mirror("probe_run", tuple(embeds.shape), tuple(targets.shape))
        with self._own_calls():
            return super()._probe_run(embeds, targets, weights)

    def close(self) -> None:
        """Tell the other ranks to stop, then stop this machine's torchrun."""
        if self.pool.healthy():
            try:
                self.group.scatter([Stop()] * self.world)
            except PoolBroken:
                log.warning("worker pool: a rank was gone at shutdown")
        self.pool.close()

    # -- adapters: rank 0 changes them; the others get them before the next pass -------------------
    def create_adapter(self, model_id: str, config: LoRAConfig) -> LoRAAdapter:
        adapter = super().create_adapter(model_id, config)
        self._dirty.add(model_id)
        return adapter

    def launch_optim_steps(self, steps: list[tuple[str, AdamParams]]) -> PendingSteps:
        pending = super().launch_optim_steps(steps)
        self._dirty.update(mid for mid, _ in steps)
        return pending

    def _sync(self) -> Sync:
        removed = [m for m in self._synced if m not in self.adapters]
        changed = [(m, a.config) for m, a in sorted(self.adapters.items())
                   if m in self._dirty or self._synced.get(m) != a.config]
        return Sync(removed, changed)

    def _send_weights(self, sync: Sync) -> None:
        for mid, _ in sync.changed:
            self.group.broadcast(flat_tensors(self.adapters[mid].parameters(), self.group.device))
        for mid in sync.removed:
            del self._synced[mid]
        self._synced.update(sync.changed)
        self._dirty.clear()

    # -- the pass -----------------------------------------------------------------------------------
    def launch_forward_backward(self, works: list[FBWork]) -> ReadyPass:
        """The pool's pass runs to its end at once (its ranks wait for one another's collectives)."""
        outcomes = self.forward_backward(works)
        return ReadyPass(outcomes, self.last_pass, before=self.last_before)

    def forward_backward(self, works: list[FBWork]) -> list[FBOutcome]:
        """One pass over the pool: each rank its share, rank 0 the gradients and the outputs.

        All or nothing for rank 0's gradients, as on one rank: until every rank's outputs are
        in, a failure puts back what they were before the pass."""
        start = time.perf_counter()
        self._ensure_pool()
        split = [split_datums(w, self.world) for w in works]
        shares = [[FBWork(w.model_id, [w.data[i] for i in split[wi][r]], w.loss_fn, w.loss_config, w.forward_only)
                   for wi, w in enumerate(works)] for r in range(self.world)]
        model_ids = sorted({w.model_id for w in works})
        results = self._run_shares(works, shares, model_ids)
        parts = [res.stats for res in results]
        self.last_pass = PassStats(models=len(model_ids), datums=sum(p.datums for p in parts),
                                   tokens=sum(p.tokens for p in parts),
                                   padded_tokens=sum(p.padded_tokens for p in parts),
                                   micro_batches=sum(p.micro_batches for p in parts),
                                   seconds=time.perf_counter() - start)
        return [merged_outcome(work, [res.outcomes[wi] for res in results], split[wi])
                for wi, work in enumerate(works)]

    def _run_shares(self, works: list[FBWork], shares: list[list[FBWork]], model_ids: list[str]) -> list[ShareResult]:
        """Every rank's share run (this rank's here), and every rank's result; raises the first
        rank's error, after each rank has put back its gradients."""
        error: Exception | None = None
        with self._own_calls():
            self.ensure_live(model_ids)
            trained = [self.adapters[m] for m in sorted({w.model_id for w in works if not w.forward_only})]
            fresh = [a for a in trained if not a.has_gradients()]
            before = self.last_before = GradientPass(trained)  # the gradients acknowledged so far
            try:
                sync, pad = self._send_shares(shares, model_ids)
                self._send_weights(sync)
                try:
                    mine, stats = self.run_share(shares[0], pad, model_ids), self.last_pass
                except PassAborted:  # another rank failed: its message comes with the results
                    mine, stats = None, None
                except PoolBroken:
                    raise
                except Exception as e:  # this rank's share failed; the others have rolled back
                    mine, stats, error = None, None, e
                results = self.group.gather(None)
            except PoolBroken as e:
                before.rollback()
                zero_grads(fresh)
                log.error("worker pool: %s", e)
                raise MachineFault(f"a rank of the worker pool failed during this pass ({e}); the pool is "
                                   "relaunched before the next one: resubmit") from e
        if error is not None:
            raise error
        for r, res in enumerate(results[1:], start=1):
            if res.error is not None:
                raise RuntimeError(f"rank {r} of the worker pool failed its share of the pass: {res.error}")
        if mine is None:  # aborted, yet no rank says why: the ranks disagree on the protocol
            raise RuntimeError("the pass was aborted by the worker pool without an error")
        results[0] = ShareResult(outcomes=mine, stats=stats)
        return results

    def _send_shares(self, shares: list[list[FBWork]], model_ids: list[str]):
        """Each rank's share, with the decisions rank 0 makes for every shape any share needs (probing
        new ones, mirrored where the base is sharded: one policy on every rank); the pass's sync
        message and its micro-batch padding."""
        shapes = sorted(set().union(*(self.mixing_shapes(share) for share in shares)))
        decisions = {shape: self.policy.mix_tenants(*shape) for shape in shapes}
        pad = (0, 0)
        if self.sharded:
            counts = [self.micro_batch_counts(share) for share in shares]
            pad = (max(c[0] for c in counts), max(c[1] for c in counts))

        def commands() -> list[PassShare]:
            sync = self._sync()  # after a relaunch: every adapter
            return [PassShare(sync, shares[r], decisions, pad, model_ids) for r in range(self.world)]
        return self._send(commands)[0].sync, pad
