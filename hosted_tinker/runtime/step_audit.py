"""What a training step asks of the host, counted on any device: host syncs and matmuls.

On a GPU a step is fast only if the host never waits for the device inside it (a sync stalls the
launch queue and makes the step impossible to capture as a CUDA graph) and its GEMMs run on the
tensor cores (a 16-bit model's matmul with fp32 operands does not; a fp32 `_grouped_mm` even runs
as a host loop of one `mm` per group). Both are properties of the code, not of the device, so
they are counted here under a `TorchDispatchMode` on whatever device the step runs on -- the CPU
suite included -- from the aten ops the step dispatches:

- `SyncAudit` counts the ops that make the host wait for the device on CUDA: a scalar read
  (`.item()`, `float(t)`, `bool(t)`: `aten::_local_scalar_dense`), ops whose output size depends
  on the data (`nonzero`, `masked_select`, `unique`, boolean indexing, `bincount`,
  `repeat_interleave` without `output_size`), `equal`, copies from the device to the host, a
  `_grouped_mm` of other than bf16 operands (a host loop reading each group's offsets; an fp32 MoE
  body on the CPU still runs it, where it waits for nothing: on a device the runtime pads the
  groups instead, `moe_routing.pads_groups`), a tensor
  made from host data (`torch.tensor(...)`: a copy from pageable memory, which waits), and
  `Tensor.tolist()`; plus the runtime's own one sanctioned wait (`host_copies.wait_for_device`,
  which tells `sync_observers`).
  `.numpy()` of a host tensor is not a sync (the runtime reads its pinned host copies so).
- `MatmulAudit` records every matmul (`mm`, `bmm`, `addmm`, `baddbmm`, `_grouped_mm`, ...) with
  its operand dtypes, FLOPs and, for a grouped call, its group count.
- `host_op_counts` counts the aten ops a step dispatches (torch.profiler), all and top-level.

Ops nested inside another op's kernel are not seen (a dispatch mode sees what the Python side
and autograd dispatch), which is what a host pays per launch on a GPU.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch.utils._python_dispatch import TorchDispatchMode

aten = torch.ops.aten

# Ops that wait for the device on CUDA, whatever their arguments.
_ALWAYS_SYNC = {
    "aten::_local_scalar_dense", "aten::nonzero", "aten::masked_select", "aten::_unique", "aten::_unique2",
    "aten::unique_dim", "aten::unique_consecutive", "aten::unique_dim_consecutive", "aten::bincount",
    "aten::equal", "aten::is_nonzero", "aten::masked_scatter", "aten::masked_scatter_",
}
_MATMULS = {"aten::mm", "aten::bmm", "aten::addmm", "aten::baddbmm", "aten::addbmm", "aten::_grouped_mm",
            "aten::_scaled_mm", "aten::_scaled_grouped_mm", "aten::mv", "aten::dot", "aten::addmv"}

# Told of every sanctioned wait for the device (`host_copies.wait_for_device`).
sync_observers: list[Callable[[str], None]] = []


def _name(func) -> str:
    return func._schema.name


def _sync_reason(func, args, kwargs) -> str | None:
    """Why this op waits for the device on CUDA, or None."""
    name = _name(func)
    if name in _ALWAYS_SYNC:
        return name
    if name in ("aten::repeat_interleave",) and kwargs.get("output_size") is None and len(args) >= 1 \
            and isinstance(args[0], torch.Tensor) and (len(args) < 2 or isinstance(args[1], torch.Tensor)):
        return f"{name} without output_size"
    if name in ("aten::index", "aten::index_put", "aten::index_put_"):
        indices = args[1] if len(args) > 1 else kwargs.get("indices", ())
        if any(isinstance(i, torch.Tensor) and i.dtype == torch.bool for i in indices or ()):
            return f"{name} with a boolean mask"
    if name in ("aten::_to_copy", "aten::copy_"):
        src = args[1] if name == "aten::copy_" else args[0]
        dst_cpu = (args[0].device.type == "cpu" if name == "aten::copy_"
                   else kwargs.get("device") is not None and torch.device(kwargs["device"]).type == "cpu")
        non_blocking = (args[2] if name == "aten::copy_" and len(args) > 2 else kwargs.get("non_blocking", False))
        if isinstance(src, torch.Tensor) and src.device.type not in ("cpu", "meta") and dst_cpu and not non_blocking:
            return f"{name} to the host"  # a non-blocking copy into pinned memory waits for nothing
    if name == "aten::_grouped_mm" and args[0].dtype != torch.bfloat16:
        return f"{name} with {args[0].dtype} operands (a host loop on CUDA)"
    if name == "aten::lift_fresh":
        return "torch.tensor(...) of host data (a copy to the device, a sync on CUDA)"
    return None


class SyncAudit(TorchDispatchMode):
    """Counts the host syncs of what runs inside it (see the module docstring): `count`, and
    `reasons`, a Counter of why."""

    def __init__(self):
        super().__init__()
        self.reasons: Counter[str] = Counter()
        self._tolist = None

    @property
    def count(self) -> int:
        return sum(self.reasons.values())

    def _note(self, reason: str) -> None:
        self.reasons[reason] += 1

    def __enter__(self):
        original = self._tolist = torch.Tensor.tolist
        audit = self

        def tolist(t):
            audit._note("Tensor.tolist")
            return original(t)

        torch.Tensor.tolist = tolist
        sync_observers.append(self._note)
        return super().__enter__()

    def __exit__(self, *exc):
        torch.Tensor.tolist = self._tolist
        sync_observers.remove(self._note)
        return super().__exit__(*exc)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        reason = _sync_reason(func, args, kwargs)
        if reason is not None:
            self._note(reason)
        return func(*args, **kwargs)


@dataclass(frozen=True)
class Matmul:
    """One matmul a step dispatched: the op, its operands' dtypes, its FLOPs, its groups (1 if not
    grouped) and the output shape."""

    op: str
    dtypes: tuple[torch.dtype, ...]
    flops: int
    groups: int
    shape: tuple[int, ...]


def _flops(name: str, args, out: torch.Tensor) -> tuple[int, int]:
    """(FLOPs, groups) of one matmul from its operands and output."""
    tensors = [a for a in args if isinstance(a, torch.Tensor)]
    if name == "aten::_grouped_mm":
        a, b = tensors[0], tensors[1]
        groups = b.shape[0] if b.dim() == 3 else (a.shape[0] if a.dim() == 3 else out.shape[0])
        inner = a.shape[-1] if not (a.dim() == 2 and b.dim() == 2) else a.shape[1]
        rows = out.numel() // out.shape[-1] if not (a.dim() == 2 and b.dim() == 2) else a.shape[0]
        return 2 * rows * out.shape[-1] * inner, groups
    if name in ("aten::addmm", "aten::baddbmm", "aten::addbmm", "aten::addmv"):
        a = tensors[1]
    else:
        a = tensors[0]
    return 2 * out.numel() * a.shape[-1], 1


class MatmulAudit(TorchDispatchMode):
    """Records every matmul of what runs inside it (`calls`)."""

    def __init__(self):
        super().__init__()
        self.calls: list[Matmul] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        name = _name(func)
        if name in _MATMULS and isinstance(out, torch.Tensor):
            flops, groups = _flops(name, args, out)
            dtypes = tuple(a.dtype for a in args if isinstance(a, torch.Tensor))
            self.calls.append(Matmul(name, dtypes, flops, groups, tuple(out.shape)))
        return out

    def fp32_operands(self, min_flops: int) -> list[Matmul]:
        """The calls over `min_flops` FLOPs with a 32-bit float operand."""
        return [c for c in self.calls if c.flops > min_flops and torch.float32 in c.dtypes[:2]]

    def counts(self) -> Counter[str]:
        return Counter(c.op for c in self.calls)


def host_op_counts(fn) -> tuple[int, int]:
    """(all, top-level) aten ops that one call of fn dispatches, by torch.profiler on the host.

    "All" counts ops nested inside others too (e.g. the per-tensor loops inside the CPU
    implementations of multi-tensor kernels such as `_fused_adamw_`); "top-level" counts what
    the Python side dispatches, which on a GPU is one or more kernel launches each.
    """
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        fn()
    ops = [e for e in prof.events() if e.name.startswith("aten::")]
    top = [e for e in ops if e.cpu_parent is None or not e.cpu_parent.name.startswith("aten::")]
    return len(ops), len(top)
