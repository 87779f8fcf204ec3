"""What a training cycle asks of the host, counted on CPU (issue 34): what on a GPU decides whether
a step runs at the card's pace and can be captured as one graph.

On the real `TrainingRuntime` with bf16 bodies (what a GPU serves), dense and MoE, counted under
runtime/step_audit.py's dispatch modes from the aten ops the step dispatches:
- host syncs: a cycle (fused forward/backward + every optimizer step) waits for the device
  once -- the pass's wait, which the optimizer step launched before it shares -- and nothing
  else reads a device value (no `.item()`, `.tolist()`, `nonzero`, `bincount`, ...), also where
  a tenant clips, where one's gradient is not finite and where one's learning rate is huge;
- matmuls: none over a few thousand FLOPs runs with fp32 operands (the LoRA GEMMs are bf16 with
  fp32 accumulation), every grouped GEMM is bf16 (on CUDA one CUTLASS kernel; an fp32 one is a
  host loop of one `mm` per group), and the matmul calls of an MoE step do not grow with the
  expert count (no loop over groups);
- host ops per cycle: 16 tenants cost at most 1.5x one tenant's.
An fp32 MoE body (`--dtype float32`) on a GPU reads the host no more than a bf16 one: its expert
GEMMs run as a bmm per tenant over padded groups (runtime/moe_routing.py's `PaddedGroups`), not as
grouped GEMMs; counted here with that plan forced on the CPU (`device_plan`).
"""

from __future__ import annotations

import pytest
import torch

from hosted_tinker.runtime import moe_routing
from hosted_tinker.runtime.adapters import AdamParams, LoRAConfig, SkippedStep
from hosted_tinker.runtime.invariance import FusionPolicy
from hosted_tinker.runtime.step_audit import MatmulAudit, SyncAudit, host_op_counts
from hosted_tinker.runtime.trainer import TrainingRuntime
from helpers import random_work
from tiny_model import one_torch_thread, tiny_decoder  # noqa: F401  (autouse: one CPU thread)

CPU = torch.device("cpu")
KINDS = ["dense", "moe"]


def runtime(kind: str, *, tenants: int, ranks=(8,), layers: int = 2, experts: int = 4,
            dtype: torch.dtype = torch.bfloat16) -> TrainingRuntime:
    rt = TrainingRuntime(tiny_decoder(kind, layers=layers, experts=experts, dtype=dtype), kind, device=CPU)
    for t in range(tenants):
        rt.create_adapter(f"t{t}", LoRAConfig(rank=ranks[t % len(ranks)], seed=t))
    return rt


def works(n: int, step: int = 0, lengths=(24, 24)):
    return [random_work(100 * step + t, f"t{t}", "cross_entropy", {}, lengths=lengths) for t in range(n)]


def one_cycle(rt: TrainingRuntime, batch, steps):
    """A server cycle's training work, as the worker runs it: the pass, then the optimizer steps."""
    return rt.forward_backward(batch), rt.optim_steps(steps)


def one_wait_cycle(rt: TrainingRuntime, batch, steps):
    """The same with one wait: the pass and the optimizer steps launched, then both read."""
    fb = rt.launch_forward_backward(batch)
    opt = rt.launch_optim_steps(steps)
    rt.wait()
    return fb.outcomes(), opt.results()


@pytest.mark.parametrize("kind", KINDS)
def test_a_training_cycle_waits_for_the_device_once(kind):
    """Six tenants of two ranks: one clips, one's loss weights overflow its gradient norm, one's
    learning rate would overflow its weights. Their pass and their optimizer steps (clipping, the
    finite checks, the skips and the put-back included) each make one host sync, the wait; launched
    together they share it. So do passes that add to earlier gradients, and the steps of tenants
    whose slots are not consecutive."""
    rt = runtime(kind, tenants=6, ranks=(8, 4))
    adam = [AdamParams(learning_rate=1e-3, grad_clip_norm=1e-3 if t == 1 else 0.0) for t in range(6)]
    adam[4] = AdamParams(learning_rate=1e38)
    steps = [(f"t{t}", adam[t]) for t in range(6)]
    one_cycle(rt, works(6), steps)  # warm-up: the layout's plans and slot tensors are made
    batch = works(6, step=1)
    for d in batch[3].data:  # weights that overflow the gradient norm
        d.inputs["weights"][:] = 3e38
    with SyncAudit() as fb_audit:
        outcomes = rt.forward_backward(batch)
    with SyncAudit() as optim_audit:
        results = rt.optim_steps(steps)
    for audit in (fb_audit, optim_audit):  # as the worker calls them: one wait each, nothing else
        assert audit.count == 1 and audit.reasons["wait_for_device"] == 1, dict(audit.reasons)
    assert [isinstance(r, SkippedStep) for r in results] == [t in (3, 4) for t in range(6)], results
    assert "not finite" in results[3].reason and "learning_rate" in results[4].reason
    assert len(outcomes) == 6 and all(o.outputs for o in outcomes)
    with SyncAudit() as audit:  # launched together, they share the one wait
        outcomes, results = one_wait_cycle(rt, works(6, step=2), steps)
    assert audit.count == 1 and audit.reasons["wait_for_device"] == 1, dict(audit.reasons)
    assert [isinstance(r, SkippedStep) for r in results] == [t == 4 for t in range(6)], results
    # Gradients accumulated over two passes, then a step of tenants whose slots are not consecutive
    # (their gradient rows are saved, put back and zeroed by index): still one wait per call.
    some = [w for w in works(6, step=3) if w.model_id in ("t0", "t2", "t5")]
    for _ in range(2):  # warm-up: the index tensors of these slots are made once
        rt.forward_backward(some)
        rt.forward_backward(some)
        rt.optim_steps([s for s in steps if s[0] in ("t0", "t2", "t5")])
    for call in (lambda: rt.forward_backward(some), lambda: rt.forward_backward(some),
                 lambda: rt.optim_steps([s for s in steps if s[0] in ("t0", "t2", "t5")])):
        with SyncAudit() as audit:
            call()
        assert audit.count == 1 and audit.reasons["wait_for_device"] == 1, dict(audit.reasons)


@pytest.mark.parametrize("kind", KINDS)
def test_a_bf16_step_runs_no_large_fp32_matmul_and_no_grouped_loop(kind):
    """On a bf16 body every matmul over 4096 FLOPs of a cycle has 16-bit operands; every grouped
    GEMM is bf16; and an MoE step makes the same matmul calls with 4 experts as with 8."""
    calls = {}
    for experts in (4, 8) if kind == "moe" else (4,):
        rt = runtime(kind, tenants=4, experts=experts)
        steps = [(f"t{t}", AdamParams(learning_rate=1e-3)) for t in range(4)]
        one_cycle(rt, works(4), steps)
        with MatmulAudit() as audit:
            one_cycle(rt, works(4, step=1), steps)
        assert not audit.fp32_operands(4096), audit.fp32_operands(4096)[:5]
        grouped = [c for c in audit.calls if c.op == "aten::_grouped_mm"]
        assert all(set(c.dtypes[:2]) == {torch.bfloat16} for c in grouped), grouped[:5]
        assert (kind == "moe") == bool(grouped)
        calls[experts] = audit.counts()
    if kind == "moe":
        assert calls[4] == calls[8], calls


@pytest.fixture
def shared_like_a_gpu(monkeypatch):
    """The fusion probes' decisions as a GPU takes them (batch-invariant kernels: every shared call
    proven), whatever this CPU's kernels say: whether a CPU's batched matmul keeps each entry's bits
    is a property of its kernels (an AVX2-only CPU refuses grouped LoRA deltas that an AVX-512 one
    proves), and what is counted here is the shared path's ops, not the probes'."""
    for decision in ("mix_tenants", "group_lora", "stacked_norms"):
        monkeypatch.setattr(FusionPolicy, decision, lambda self, *a, **k: True)


@pytest.mark.parametrize("kind", KINDS)
def test_host_ops_per_cycle_grow_at_most_1_5x_from_1_to_16_tenants(kind, shared_like_a_gpu):
    """A cycle of 16 tenants (2 x 24 tokens each, one rank) dispatches at most 1.5x the aten ops of
    one tenant's, on a 4-layer body: the layers' calls are shared, what grows with the tenants is
    per tenant (its loss; on MoE its expert GEMMs, one grouped call per tenant)."""
    rt = runtime(kind, tenants=16, layers=4, ranks=(16,))
    steps = [(f"t{t}", AdamParams(learning_rate=1e-3)) for t in range(16)]
    counts = {}
    for n in (16, 1):
        one_cycle(rt, works(n), steps[:n])
        counts[n] = host_op_counts(lambda: one_cycle(rt, works(n, step=1), steps[:n]))[1]
    print(f"{kind}: host ops per cycle N=1 {counts[1]}, N=16 {counts[16]}: {counts[16] / counts[1]:.2f}x")
    assert counts[16] <= 1.5 * counts[1], counts



@pytest.fixture
def device_plan(monkeypatch):
    """The expert GEMM plan of a CUDA device, forced on the CPU (no CUDA here): off bf16, a bmm per
    tenant over padded groups (`moe_routing.pads_groups`). The CPU's own plan keeps torch's loop of
    one `mm` per group, which waits for nothing there. (Without such a switch, as before issue 44,
    the plan stays the CPU's: raising=False lets these tests show what that plan reads.)"""
    monkeypatch.setattr(moe_routing, "pads_groups", lambda x: x.dtype != torch.bfloat16, raising=False)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_an_moe_cycle_reads_the_host_as_often_at_16_tenants_as_at_1(device_plan, dtype):
    """Issue 44: an fp32 MoE body read the host once per expert GEMM -- torch's grouped GEMM of other
    than bf16 operands copies the group offsets to the host and loops one `mm` per group -- 46
    times a cycle at one tenant and 166 at 16 tenants (its frozen expert GEMMs run per tenant). On a
    device they now run as a bmm per tenant over padded groups: in either dtype a cycle's only host
    syncs are the pass's and the optimizer step's waits, at 1 tenant as at 16."""
    rt = runtime("moe", tenants=16, dtype=dtype)
    steps = [(f"t{t}", AdamParams(learning_rate=1e-3)) for t in range(16)]
    reasons = {}
    for n in (1, 16):
        one_cycle(rt, works(n), steps[:n])  # warm-up: the layout's plans and slot tensors are made
        with SyncAudit() as audit:
            one_cycle(rt, works(n, step=1), steps[:n])
        reasons[n] = dict(audit.reasons)
    assert reasons[1] == reasons[16] == {"wait_for_device": 2}, reasons


def test_an_fp32_moe_step_on_a_device_runs_no_grouped_loop(device_plan):
    """Issue 44: on an fp32 MoE body no grouped GEMM runs on a device (CUDA's fp32 `_grouped_mm` is a
    host loop of one `mm` per group); its expert GEMMs are bmm calls, as many with 8 experts as
    with 4."""
    calls = {}
    for experts in (4, 8):
        rt = runtime("moe", tenants=4, experts=experts, dtype=torch.float32)
        steps = [(f"t{t}", AdamParams(learning_rate=1e-3)) for t in range(4)]
        one_cycle(rt, works(4), steps)
        with MatmulAudit() as audit:
            one_cycle(rt, works(4, step=1), steps)
        calls[experts] = audit.counts()
        assert not calls[experts]["aten::_grouped_mm"], calls[experts]
        assert any(c.op == "aten::bmm" and c.shape[0] == experts for c in audit.calls)
    assert calls[4] == calls[8], calls
