"""`ModelRuntime`: what the server needs from whatever trains one base model's adapters.

Two implementations: `runtime.trainer.TrainingRuntime`, in this process, on one device, and
`runtime.distributed.PoolRuntime`, whose rank 0 is this process and whose passes are split over
a pool of torch.distributed ranks. This is the surface they offer the worker (which calls it on
the device loop's thread only) and the API (which reads the limits). Storage stays outside: the worker
records checkpoints and futures; the runtime only computes (checkpoints/adapter_io.py writes and reads
its adapters' files).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, Protocol

from .adapters import AdamParams, LoRAConfig, SkippedStep
from .recompute import RecomputeChoice
from ..requests.kinds import FBOutcome, FBWork
from .trainer import PassStats


class ModelRuntime(Protocol):
    base_model_name: str
    model: Any  # the base model as the sampling engine calls it
    vocab_size: int  # token ids a request may use
    max_context: int  # longest sequence a request may send
    layers: Mapping[str, Any]  # adaptable projections by module path
    adapters: dict[str, Any]  # model id -> its adapter (membership, `.step`; a failed load puts one back)
    last_pass: PassStats  # what the last forward_backward did
    recompute: RecomputeChoice  # whether decoder layers recompute activations in the backward, and why

    def create_adapter(self, model_id: str, config: LoRAConfig) -> Any: ...

    def remove_adapter(self, model_id: str) -> None: ...

    def ensure_live(self, model_ids) -> None:
        """Page these models' adapters in (and idle ones out, over the limit)."""
        ...

    def forward_backward(self, works: list[FBWork]) -> list[FBOutcome]:
        """One fused pass over every request; gradients accumulate per model."""
        ...

    def optim_steps(self, steps: list[tuple[str, AdamParams]]) -> list[dict[str, float] | SkippedStep]:
        """Each model's metrics, or `SkippedStep` (a user error) where its step was not finite."""
        ...

    def launch_forward_backward(self, works: list[FBWork]) -> Any:
        """`forward_backward` without the wait: `.outcomes()` after the next `wait()` (a worker pool's
        pass runs to its end at once: runtime/pass_io.py's `PendingPass`, `ReadyPass`)."""
        ...

    def launch_optim_steps(self, steps: list[tuple[str, AdamParams]]) -> Any:
        """`optim_steps` without the wait: `.results()` after the next `wait()`."""
        ...

    def wait(self) -> None:
        """Wait for the device once: everything launched since the last wait is then readable."""
        ...

    def adapter(self, model_id: str) -> Any: ...

    def describe_training(self) -> str:
        """One line for the start-up summary: tenant sharing, kernels, CUDA graphs, logits."""
        ...

    def close(self) -> None:
        """Release what lives outside this process (a pool's other ranks); after the device loop stopped."""
        ...
