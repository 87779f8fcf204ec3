"""What crosses between host and device in a step, without waiting for the device: a micro-batch's
outputs copied into pinned memory on CUDA (queued), constants made once and kept on the device,
and the cycle's one wait for the device, after its work is launched (`TrainingRuntime.wait`).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .packing import MicroBatch
from .step_audit import sync_observers


@dataclass
class Launched:
    """A micro-batch whose work is queued: its outputs arrive in host memory by `_collect`."""

    mb: MicroBatch
    logprobs: torch.Tensor  # [rows, width] float32, host (pinned on CUDA)
    losses: torch.Tensor  # [rows, width] float32, host
    topk: torch.Tensor | None = None  # [rows, width, K] float32, host: the logprobs of rows with (N, K) targets


def to_host(t: torch.Tensor, static: bool) -> torch.Tensor:
    """`t` in host memory, its copy queued (pinned memory on CUDA: the copy does not wait). A
    CPU tensor is its own host copy unless it is a graph's static output."""
    if t.device.type == "cpu":
        return t.clone() if static else t
    out = torch.empty(t.shape, dtype=t.dtype, pin_memory=True)
    out.copy_(t, non_blocking=True)
    return out


_DEVICE_CONSTANTS: dict[tuple, torch.Tensor] = {}


def device_constant(values: tuple, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """`values` as a tensor on `device`, made once per distinct tuple (slot indices, clip bounds: a
    training loop repeats them; at most 1024 kept), so a step seen before copies nothing from
    the host (a copy from pageable host memory waits for the device on CUDA)."""
    key = (values, dtype, device)
    got = _DEVICE_CONSTANTS.get(key)
    if got is None:
        if len(_DEVICE_CONSTANTS) >= 1024:
            _DEVICE_CONSTANTS.clear()
        got = _DEVICE_CONSTANTS[key] = torch.tensor(values, dtype=dtype, device=device)
    return got


def wait_for_device(device: torch.device) -> None:
    """The pass's one wait for the device: allowed under `torch.cuda.set_sync_debug_mode("error")`
    (the GPU tests run a step that way: any other sync raises). `step_audit.sync_observers` hear
    of it on every device (the CPU suite counts a cycle's syncs)."""
    for observe in sync_observers:
        observe("wait_for_device")
    if device.type != "cuda":
        return
    mode = torch.cuda.get_sync_debug_mode()
    torch.cuda.set_sync_debug_mode(0)
    try:
        torch.cuda.current_stream(device).synchronize()
    finally:
        torch.cuda.set_sync_debug_mode(mode)
