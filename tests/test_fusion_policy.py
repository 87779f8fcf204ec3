"""The multi-LoRA runtime's machinery for exact co-batching (issues 10, 12, 14), in process:
the probes behind `FusionPolicy`, slots and the once-per-batch plan, all-or-nothing gradients,
and the optimizer's fallback when torch's private fused kernels are gone."""

from __future__ import annotations

import collections

import numpy as np
import pytest
import torch

from hosted_tinker.runtime import torch_compat
from hosted_tinker.runtime.adapters import AdamParams, LoRAConfig, SkippedStep
from hosted_tinker.runtime.invariance import FusionPolicy, RowIndependenceProbe, probe_blocks, same_bits, row_norms
from hosted_tinker.runtime.lora_plan import LoRARouting
from hosted_tinker.runtime.trainer import TrainingRuntime
from tiny_model import ce_work, grads, random_seqs, randomize_b, tiny_qwen3, tiny_runtime


def test_row_probe_refuses_a_batch_dependent_computation_and_proves_a_row_wise_one():
    """The mixing probe compares planted row blocks with the same rows run alone: a computation
    that mixes rows (centring over the batch) is refused, a row-wise one is proven."""
    def sample(width, rows, seed):
        return (torch.randn(rows, width, generator=torch.Generator().manual_seed(seed)),)

    assert RowIndependenceProbe(sample, lambda x: (x * 3 + 1,))(16, 9)
    assert not RowIndependenceProbe(sample, lambda x: (x - x.mean(0),))(16, 9)
    assert probe_blocks(9) == [(0, 1), (3, 2), (6, 3)] and probe_blocks(2) == [(0, 1), (1, 1)]
    assert not same_bits(torch.tensor([0.0]), torch.tensor([-0.0]))  # torch.equal would say equal


def test_a_refusal_at_startup_turns_mixing_off_and_decisions_are_kept_per_thread_count():
    """If the start-up probe fails, tenants never share micro-batches (no further probing);
    otherwise each shape is probed once per CPU thread count and remembered."""
    asked = []
    policy = FusionPolicy(torch.device("cpu"), mixing_probe=lambda w, r: asked.append((w, r)) or r != 64)
    assert not policy.check_at_startup(16, 64)
    assert not policy.mix_tenants(16, 8) and asked == [(16, 64)]
    assert policy.describe()["mix_tenants"] is False

    asked.clear()
    policy = FusionPolicy(torch.device("cpu"), mixing_probe=lambda w, r: asked.append((w, r)) or True)
    threads = torch.get_num_threads()
    try:
        assert policy.check_at_startup(16, 8) and policy.mix_tenants(16, 8) and policy.mix_tenants(24, 3)
        torch.set_num_threads(1 if threads != 1 else 2)
        assert policy.mix_tenants(16, 8)
    finally:
        torch.set_num_threads(threads)
    assert asked == [(16, 8), (24, 3), (16, 8)]


def test_a_frozen_projection_can_take_its_input_gradient_from_a_transposed_copy():
    """With the copy kept, the forward is the same call (same bits) and the input gradient is
    `F.linear(gy, W.T contiguous)` -- the forward's layout -- equal to autograd's up to rounding."""
    layer = tiny_runtime().layers["model.layers.0.mlp.down_proj"]  # 64 -> 32
    W = layer.base.weight
    x = torch.randn(3, 5, 64, generator=torch.Generator().manual_seed(0))
    gy = torch.randn(3, 5, 32, generator=torch.Generator().manual_seed(1))

    def run():
        xi = x.clone().requires_grad_(True)
        y = layer(xi)
        y.backward(gy)
        return y.detach(), xi.grad

    plain_y, plain_gx = run()
    assert layer.keep_transposed_weight(True) == W.numel() * 4 and layer.weight_t.is_contiguous()
    y, gx = run()
    assert same_bits(y, plain_y)
    assert same_bits(gx, torch.nn.functional.linear(gy, W.t().contiguous()))
    torch.testing.assert_close(gx, plain_gx)
    assert layer.keep_transposed_weight(False) == 0 and layer.weight_t is None


class _ProbedStub(TrainingRuntime):
    """The real runtime and policy with a stand-in for what the mixing probe runs: whether the real
    model keeps rows' bits depends on this CPU's kernels, so the test decides it. The stand-in's
    rows change bits with the batch's row count unless `helped` says the layout in use helps."""

    helped = staticmethod(lambda rt: False)

    def _probe_run(self, embeds, targets, weights):
        rows = embeds[:, :, 0].clone()
        return (rows if self.helped(self) else rows + embeds.shape[0],)


def test_where_the_plain_model_changes_rows_bits_the_runtime_tries_transposed_weight_copies():
    """At start-up on CPU, a failed mixing probe is tried again with the frozen projections' input
    gradients from transposed weight copies: kept where that passes, dropped where it does not."""
    class TransposedHelps(_ProbedStub):
        helped = staticmethod(lambda rt: all(layer.weight_t is not None for layer in rt.layers.values()))

    rt = TransposedHelps(tiny_qwen3(0), "tiny-qwen3", device=torch.device("cpu"))
    assert rt.policy.describe()["mix_tenants"] is True and rt.routing.policy is rt.policy
    assert rt.policy.describe()["frozen_input_grads"].startswith("from transposed weight copies (+")

    rt = _ProbedStub(tiny_qwen3(0), "tiny-qwen3", device=torch.device("cpu"))
    assert all(layer.weight_t is None for layer in rt.layers.values())
    assert rt.policy.describe()["mix_tenants"] is False and rt.policy.input_grads == "autograd"
    assert rt.policy.mixing_refused.endswith("also with input gradients from transposed weight copies")


def test_adapters_live_in_preallocated_slots_and_the_plan_is_built_once_per_batch():
    """Adapter tensors are views of their layer's slot stack (no stacking per forward), one
    forward builds one plan per distinct kind of layer, not one per layer, and the next step with
    the same rows reuses them (a training loop repeats its layout every step)."""
    rt = tiny_runtime()
    for i in range(3):
        rt.create_adapter(f"t{i}", LoRAConfig(rank=4, seed=i))
    layer = rt.layers["model.layers.0.self_attn.q_proj"]
    stack = layer.stacks[4]
    for i in range(3):
        w = rt.adapter(f"t{i}").weights["model.layers.0.self_attn.q_proj"]
        assert w.A.data_ptr() == stack.A[w.slot].data_ptr()
    builds = collections.Counter()
    build = LoRARouting._build

    def counting(self, layer, *args):
        builds[(layer.in_features, layer.out_features)] += 1
        return build(self, layer, *args)

    works = [ce_work(f"t{i}", random_seqs(2, i)) for i in range(3)]
    LoRARouting._build = counting
    try:
        rt.forward_backward(works)
        # q/o (32x32), k/v (32x16), gate/up (32x64), down (64x32), lm_head (32x128): once each
        # per row layout, for 2 layers x 7 projections + lm_head. One micro-batch where this
        # machine's policy lets the three share it, else one each (three layouts).
        layouts = rt.last_pass.micro_batches
        assert set(builds.values()) == {layouts} and len(builds) == 5
        assert layouts == (1 if rt.policy.mix_tenants(16, 6) else 3)
        rt.forward_backward(works)
        assert set(builds.values()) == {layouts}
        rt.create_adapter("t3", LoRAConfig(rank=4, seed=3))  # a new slot: plans read slots
        rt.forward_backward(works)
        assert set(builds.values()) == {2 * layouts}
    finally:
        LoRARouting._build = build


def test_a_plan_kept_across_batches_follows_an_adapter_made_again_with_another_shape():
    """Plans are kept per row layout. An adapter deleted and made again under the same id, with
    another rank and scaling, gets plans of its own: the same bits as in a runtime that never
    knew the first one."""
    kept, fresh = tiny_runtime(), tiny_runtime()
    seqs = random_seqs(2, 11)
    randomize_b(kept.create_adapter("a", LoRAConfig(rank=4, seed=1)), seed=1)
    kept.forward_backward([ce_work("a", seqs)])
    kept.remove_adapter("a")
    for rt in (kept, fresh):
        randomize_b(rt.create_adapter("a", LoRAConfig(rank=8, alpha=4.0, seed=2)), seed=2)
    got, want = (rt.forward_backward([ce_work("a", seqs)])[0] for rt in (kept, fresh))
    for p, q in zip(got.outputs, want.outputs):
        assert same_bits(torch.as_tensor(p["logprobs"]), torch.as_tensor(q["logprobs"]))
    g_kept, g_fresh = grads(kept.adapter("a")), grads(fresh.adapter("a"))
    assert all(same_bits(g_kept[k], g_fresh[k]) for k in g_fresh)


def test_consecutive_slots_take_autograds_own_nodes_with_the_grouped_functions_bits():
    """A call over consecutive slots runs as autograd's own bmm nodes on views of the stack, with
    the weight gradients added by AccumulateGrad straight into the stack's rows; every other call
    (a canonical pair, slots out of order) runs the `GroupedLoRA` function that the fusion probe
    checks. Both must give the same bits -- output, input gradient and the rows' gradients -- for
    fp32 and bf16, and for an incoming gradient that is not contiguous."""
    from hosted_tinker.runtime.lora_ops import GroupedLoRA, lora_delta
    from hosted_tinker.runtime.lora_slots import LoRACall, SlotStack

    gen = torch.Generator().manual_seed(0)
    for tokens, d_in, d_out, rank, n, dtype in [(256, 64, 64, 16, 1, torch.float32),
                                                (96, 128, 40, 8, 3, torch.float32),
                                                (130, 96, 256, 4, 5, torch.float32),
                                                (64, 256, 128, 16, 2, torch.bfloat16)]:
        stack = SlotStack(rank, d_in, d_out, torch.device("cpu"))
        stack.put(7, _weights(rank, d_in, d_out, gen))  # grows to 8 slots; slots 1..n are used below
        with torch.no_grad():
            stack.A.copy_(torch.randn(stack.A.shape, generator=gen))
            stack.B.copy_(torch.randn(stack.B.shape, generator=gen))
        x = torch.randn(n, tokens, d_in, generator=gen).to(dtype)
        for grad_out in (torch.randn(n, tokens, d_out, generator=gen).to(dtype),
                         torch.randn(n, d_out, tokens, generator=gen).to(dtype).transpose(1, 2)):
            results = []
            # A 16-bit base's calls all run the function (bf16 math, see lora_forward): gathered, or
            # on views of consecutive slots with the gradients added in place.
            paths = ("gathered", "views", "autograd") if dtype == torch.float32 else ("gathered", "views")
            for path in paths:
                stack.grad_A.zero_()
                stack.grad_B.zero_()
                xg = x.clone().requires_grad_(True)
                if path != "autograd":
                    call = LoRACall(rank, n, 1, torch.arange(1, n + 1), 1.5, None if path == "gathered" else 1, False)
                    out = GroupedLoRA.apply(xg, torch.zeros((), requires_grad=True), stack, call, xg.dtype)
                else:
                    out = lora_delta(xg, *stack.leaves(1, n), 1.5)
                out.backward(grad_out)
                results.append((out.detach(), xg.grad, stack.grad_A.clone(), stack.grad_B.clone()))
            assert all(same_bits(a, b) for r in results[1:] for a, b in zip(results[0], r)), \
                (tokens, d_in, d_out, rank, n, dtype)


def _weights(rank: int, d_in: int, d_out: int, gen: torch.Generator):
    from hosted_tinker.runtime.lora_slots import LoRAWeights

    return LoRAWeights(A=torch.randn(rank, d_in, generator=gen), B=torch.randn(d_out, rank, generator=gen),
                       scaling=1.5)


def test_stepping_some_tenants_keeps_the_pending_gradients_of_a_tenant_between_them():
    """The optimizer zeroes the gradient rows of the tenants it steps -- all at once where their
    slots are consecutive, by index where a tenant that is not stepping sits between them -- and
    never the rows of a tenant whose gradients wait for its own optim_step."""
    rt = tiny_runtime()
    for i in range(3):
        randomize_b(rt.create_adapter(f"t{i}", LoRAConfig(rank=4, seed=i)), seed=i)
    rt.forward_backward([ce_work(f"t{i}", random_seqs(2, 20 + i)) for i in range(3)])
    waiting = grads(rt.adapter("t1"))
    rt.optim_steps([("t0", AdamParams(learning_rate=1e-2)), ("t2", AdamParams(learning_rate=1e-2))])
    assert not rt.adapter("t0").has_gradients() and not rt.adapter("t2").has_gradients()
    assert all(same_bits(v, waiting[k]) for k, v in grads(rt.adapter("t1")).items())
    rt.optim_steps([("t1", AdamParams(learning_rate=1e-2))])
    layer = rt.layers["model.layers.0.self_attn.q_proj"]
    assert not layer.stacks[4].grad_A.any() and not layer.stacks[4].grad_B.any()


def test_lora_kernel_calls_do_not_grow_with_same_shape_tenants():
    """Where this machine's policy proves sharing, 1 and 8 same-shape tenants cost the same LoRA
    kernel calls: one grouped matmul pair and one gradient add per factor and layer (autograd's
    AccumulateGrad into the stack's rows, not one per tenant), and tenants created one after
    another sit in consecutive slots: their factors are views of the stack and their gradients
    are added in place (no index_add_)."""
    rt = tiny_runtime()
    for i in range(8):
        randomize_b(rt.create_adapter(f"t{i}", LoRAConfig(rank=4, seed=i)), seed=i)
    seqs = [random_seqs(2, 50 + i, lo=9, hi=10) for i in range(8)]  # 2 rows x 8 tokens each

    def kernel_calls(n: int) -> collections.Counter:
        works = [ce_work(f"t{i}", seqs[i]) for i in range(n)]
        rt.forward_backward(works)  # probes (first sight of a shape) run outside the profile
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
            rt.forward_backward(works)
        return collections.Counter(e.name for e in prof.events()
                                   if e.name in ("aten::bmm", "aten::index_add_", "torch::autograd::AccumulateGrad"))

    one, eight = kernel_calls(1), kernel_calls(8)
    layer = rt.layers["model.layers.0.self_attn.q_proj"]
    if not (rt.policy.mix_tenants(16, 16) and rt.policy.group_lora(16, 32, 32, 4, 8, torch.float32)):
        pytest.skip(f"this machine's policy does not share these calls: {rt.policy.describe()}")
    assert eight == one and 0 < one["torch::autograd::AccumulateGrad"] <= 2 * len(rt.layers) + 1
    assert one["aten::index_add_"] == 0  # consecutive slots: gradients added in place
    assert layer.stacks[4].capacity >= 8


def test_a_tenant_run_as_its_canonical_pair_gets_the_gradients_of_a_plain_run():
    """Where a one-entry batched matmul is not proven to give a tenant its pair's bits, the tenant
    runs as its canonical pair (itself and a copy): same logprobs and gradients as the plain
    path up to rounding, and its gradient rows take one copy's share, not both."""
    class PairsOnly(TrainingRuntime):
        def _fusion_policy(self):
            return FusionPolicy(self.device, mixing_probe=None, grouping_probe=lambda *shape: False)

    paired, plain = PairsOnly(tiny_qwen3(0), "tiny-qwen3", device=torch.device("cpu")), tiny_runtime()
    calls = []
    build = LoRARouting._build

    def recording(self, *args):
        plan = build(self, *args)
        calls.extend(c for c in (plan.calls if plan else []) if c is not None)
        return plan

    outs = {}
    for name, rt in (("paired", paired), ("plain", plain)):
        randomize_b(rt.create_adapter("a", LoRAConfig(rank=4, seed=1)), seed=1)
        LoRARouting._build = recording
        try:
            outs[name] = rt.forward_backward([ce_work("a", random_seqs(3, 7))])[0]
        finally:
            LoRARouting._build = build
        if name == "paired":
            assert calls and all(c.pair for c in calls)
    for p, q in zip(outs["paired"].outputs, outs["plain"].outputs):
        np.testing.assert_allclose(p["logprobs"], q["logprobs"], rtol=1e-5, atol=1e-5)
    g_paired, g_plain = grads(paired.adapter("a")), grads(plain.adapter("a"))
    for k in g_plain:
        torch.testing.assert_close(g_paired[k], g_plain[k], rtol=1e-4, atol=1e-6)


def test_a_failed_pass_leaves_earlier_gradients_as_they_were():
    """A forward_backward that raises part way (here: in its second micro-batch, after the first
    one's backward has added to the gradients) leaves every adapter's gradients as the earlier,
    acknowledged calls left them; training then goes on exactly as if it had never run."""
    def runtime_with_history():
        rt = tiny_runtime()
        for mid in ("a", "b"):
            randomize_b(rt.create_adapter(mid, LoRAConfig(rank=4, seed=len(mid))), seed=3)
        rt.forward_backward([ce_work("a", random_seqs(2, 1))])  # acknowledged: a has gradients
        return rt

    failing, clean = runtime_with_history(), runtime_with_history()
    before = grads(failing.adapter("a"))
    # Two lengths -> two padding buckets -> two micro-batches; the fault hits the second.
    doomed = [ce_work("a", random_seqs(2, 2, lo=4, hi=8) + random_seqs(2, 3, lo=30, hi=40)),
              ce_work("b", random_seqs(2, 4))]
    forwards = []

    def fault(module, args):
        forwards.append(args[0].shape)
        if len(forwards) == 2:
            raise RuntimeError("injected device fault")

    hook = failing.layers["model.layers.1.mlp.down_proj"].register_forward_pre_hook(fault)
    with pytest.raises(RuntimeError, match="injected"):
        failing.forward_backward(doomed)
    hook.remove()
    assert len(forwards) == 2  # the first micro-batch did run its backward
    after = grads(failing.adapter("a"))
    assert all(same_bits(after[k], before[k]) for k in before)
    assert not failing.adapter("b").has_gradients()

    for rt in (failing, clean):
        rt.forward_backward([ce_work("a", random_seqs(2, 5)), ce_work("b", random_seqs(2, 6))])
        rt.optim_steps([("a", AdamParams(learning_rate=1e-2)), ("b", AdamParams(learning_rate=1e-2))])
    for mid in ("a", "b"):
        got, want = failing.adapter(mid).named_tensors(), clean.adapter(mid).named_tensors()
        assert all(same_bits(got[k], want[k]) for k in want), mid


def test_gradient_norms_reduce_only_the_slots_of_the_tenants_stepping(monkeypatch):
    """Stepping one of eight live tenants sums that tenant's gradient rows, not every slot of each
    layer's stack (with 16 live tenants, that made a lone tenant's AdamW step 2.3x slower), and its
    grad_norm keeps the bits it has when all eight step together."""
    from hosted_tinker.runtime import adamw as adamw_module

    rt = tiny_runtime()
    for i in range(8):
        randomize_b(rt.create_adapter(f"t{i}", LoRAConfig(rank=4, seed=i)), seed=i)
    rt.forward_backward([ce_work(f"t{i}", random_seqs(2, i)) for i in range(8)])
    saved = {f"t{i}": grads(rt.adapter(f"t{i}")) for i in range(8)}
    reduced_rows = []

    def counting(t):
        reduced_rows.append(t.shape[0])
        return row_norms(t)

    monkeypatch.setattr(adamw_module, "row_norms", counting)
    norms = adamw_module.grad_norms([rt.adapter(f"t{i}") for i in range(8)], rt.policy)
    assert reduced_rows and max(reduced_rows) <= 8
    reduced_rows.clear()
    alone = adamw_module.grad_norms([rt.adapter("t5")], rt.policy)
    assert reduced_rows and max(reduced_rows) <= 2  # its own row, or its canonical pair
    assert alone == [norms[5]]
    assert all(torch.equal(v, saved["t5"][k]) for k, v in grads(rt.adapter("t5")).items())


def test_the_weight_check_after_a_step_undoes_only_the_tenant_it_broke(monkeypatch):
    """The stepped weights are measured after the step with one reduction per slot stack over the
    stepping tenants' rows (`adamw.tensor_norms`, as the gradient norms), each tenant judged on its
    own rows: the one whose huge learning rate overflowed its weights is put back, and the tenants
    stepping with it keep the bits they get alone (a check over the stack as a whole would have
    undone them all)."""
    from hosted_tinker.runtime import adamw as adamw_module

    hps = {f"t{i}": AdamParams(learning_rate=1e-2) for i in range(6)}
    hps["t3"] = AdamParams(learning_rate=1e38)
    together, alone = tiny_runtime(), tiny_runtime()
    for rt in (together, alone):
        for i in range(6):
            randomize_b(rt.create_adapter(f"t{i}", LoRAConfig(rank=4, seed=i)), seed=i)
        rt.forward_backward([ce_work(f"t{i}", random_seqs(2, 30 + i)) for i in range(6)])
    before = {k: v.clone() for k, v in together.adapter("t3").named_tensors().items()}
    reduced_rows = []

    def counting(t):
        reduced_rows.append(t.shape[0])
        return row_norms(t)

    monkeypatch.setattr(adamw_module, "row_norms", counting)
    results = together.optim_steps(list(hps.items()))
    stacks = {id(w.stack) for w in together.adapter("t0").weights.values()}
    assert max(reduced_rows) <= 6
    if not together.policy.describe()["stacked_norm_shapes_refused"]:
        # A and B of each stack: gradients, and weights after the step
        assert len(reduced_rows) == 2 * 2 * len(stacks)
    assert [isinstance(r, SkippedStep) for r in results] == [mid == "t3" for mid in hps]
    got = together.adapter("t3").named_tensors()
    assert all(same_bits(got[k], v) for k, v in before.items()) and not together.adapter("t3").optimizer.state
    for mid, hp in hps.items():
        solo = alone.optim_step(mid, hp)
        assert isinstance(solo, SkippedStep) == (mid == "t3")
        if mid != "t3":
            assert solo == results[list(hps).index(mid)]
        want, got = alone.adapter(mid).named_tensors(), together.adapter(mid).named_tensors()
        assert all(same_bits(got[k], want[k]) for k in want), mid


def test_optimizer_without_torchs_private_kernels_matches_and_stays_exact(monkeypatch):
    """If a torch upgrade removes `_fused_adamw_` / `_foreach_*` (simulated by hiding them from
    the wrappers), AdamW runs through torch's public per-tensor code: the same update as
    torch.optim.AdamW, and an adapter's bits do not depend on who steps with it."""
    for name in ("_FUSED_ADAMW", "_FOREACH_MUL", "_FOREACH_ADD", "_FOREACH_ZERO"):
        monkeypatch.setattr(torch_compat, name, None)
    hps = {"a": AdamParams(learning_rate=1e-2, weight_decay=0.1, grad_clip_norm=1e-3),
           "b": AdamParams(learning_rate=3e-3, beta1=0.8, beta2=0.99, eps=1e-8)}
    together, alone = tiny_runtime(), tiny_runtime()
    for rt in (together, alone):
        for i, mid in enumerate(hps):
            randomize_b(rt.create_adapter(mid, LoRAConfig(rank=4, seed=i)), seed=i)
    ref = {mid: [p.detach().clone().requires_grad_(True) for p in together.adapter(mid).parameters()] for mid in hps}
    opts = {mid: torch.optim.AdamW(ref[mid], lr=hp.learning_rate, betas=(hp.beta1, hp.beta2), eps=hp.eps,
                                   weight_decay=hp.weight_decay, foreach=False) for mid, hp in hps.items()}
    for step in range(2):
        for rt in (together, alone):
            rt.forward_backward([ce_work(mid, random_seqs(2, 10 * step + i)) for i, mid in enumerate(hps)])
        for mid, ps in ref.items():
            for p, q in zip(ps, together.adapter(mid).parameters()):
                p.grad = q.grad.clone()
            if hps[mid].grad_clip_norm:
                torch.nn.utils.clip_grad_norm_(ps, hps[mid].grad_clip_norm)
            opts[mid].step()
        metrics = together.optim_steps(list(hps.items()))
        solo = [alone.optim_step(mid, hp) for mid, hp in hps.items()]
        assert [m["grad_norm"] for m in metrics] == [m["grad_norm"] for m in solo]
    for mid in hps:
        for p, q, r in zip(together.adapter(mid).parameters(), alone.adapter(mid).parameters(), ref[mid]):
            assert same_bits(p, q), mid
            np.testing.assert_allclose(p.detach().numpy(), r.detach().numpy(), rtol=1e-5, atol=1e-6)
        st = together.adapter(mid).optimizer.state[together.adapter(mid).parameters()[0]]
        assert float(st["step"]) == 2.0


def test_the_grouping_probe_also_checks_a_transposed_incoming_gradient(monkeypatch):
    """The LoRA backward takes the incoming gradient in the layout autograd hands over (no copy to
    make it contiguous: that was a Python hook per layer). So the grouping probe checks a
    transposed gradient too: a kernel that changes an entry's bits only when the gradient is
    transposed and the batch holds more than two entries is refused."""
    from hosted_tinker.runtime import invariance

    honest = invariance.lora_backward

    def transposed_batches_differ(gd, xs, A, B, h, scaling, need_x, datums=1):
        grad_x, grad_A, grad_B = honest(gd, xs, A, B, h, scaling, need_x, datums)
        if not gd.is_contiguous() and gd.shape[0] > 2:
            grad_A = grad_A * (1 + 2 ** -20)
        return grad_x, grad_A, grad_B

    assert invariance.grouped_lora_matches_pairs(24, 32, 16, 4, 4, torch.float32, torch.device("cpu"))
    monkeypatch.setattr(invariance, "lora_backward", transposed_batches_differ)
    assert invariance.grouped_lora_matches_pairs(24, 32, 16, 4, 2, torch.float32, torch.device("cpu"))
    assert not invariance.grouped_lora_matches_pairs(24, 32, 16, 4, 4, torch.float32, torch.device("cpu"))
