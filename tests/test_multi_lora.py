"""Unit tests of the multi-tenant LoRA runtime on a tiny Qwen3 built in the test: per-row adapter
routing, gradient isolation between tenants, adapter removal, fresh-adapter identity,
seed-determinism, sum semantics under splitting, and paging an adapter between devices."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from hosted_tinker.requests.kinds import DatumWork, FBWork
from hosted_tinker.runtime.adapters import AdamParams, LoRAConfig, SkippedStep
from hosted_tinker.runtime.trainer import TrainingRuntime
from tiny_model import CPU, TINY_VOCAB as VOCAB, ce_work, grads, logits, one_torch_thread, random_seqs, randomize_b, \
    tiny_qwen3, tiny_runtime  # noqa: F401 (one_torch_thread: an autouse fixture)

# Adapter configs used across tests: different ranks and different train_* flags.
CFG_A = LoRAConfig(rank=4, seed=1, train_attn=True, train_mlp=False, train_unembed=True)
CFG_B = LoRAConfig(rank=8, seed=2, train_attn=False, train_mlp=True, train_unembed=False)


def assert_close(got: torch.Tensor, want: torch.Tensor, what: str, tol: float = 1e-5) -> None:
    """fp32 closeness relative to the tensor's scale (gradients of sums can be large)."""
    scale = float(want.abs().max()) or 1.0
    torch.testing.assert_close(got, want, rtol=tol, atol=tol * scale, msg=lambda m: f"{what}: {m}")


@pytest.fixture
def rt_ab():
    """A runtime with adapters a (rank 4, attn+unembed) and b (rank 8, mlp), both non-zero."""
    rt = tiny_runtime()
    randomize_b(rt.create_adapter("a", CFG_A), seed=10)
    randomize_b(rt.create_adapter("b", CFG_B), seed=20)
    return rt


def test_adapters_cover_exactly_their_flagged_projections(rt_ab):
    """train_* flags select projections: a adapts attn + lm_head, b only the MLP; ranks differ."""
    a, b = rt_ab.adapter("a"), rt_ab.adapter("b")
    assert {p.rsplit(".", 1)[-1] for p in a.weights} == {"q_proj", "k_proj", "v_proj", "o_proj", "lm_head"}
    assert {p.rsplit(".", 1)[-1] for p in b.weights} == {"gate_proj", "up_proj", "down_proj"}
    assert all(w.A.shape[0] == 4 and w.scaling == 32 / 4 for w in a.weights.values())
    assert all(w.A.shape[0] == 8 and w.B.shape[1] == 8 for w in b.weights.values())
    # Adapter tensors are not model parameters: the base stays frozen and unchanged by optimizers.
    assert all(not p.requires_grad for p in rt_ab.model.parameters())


def test_mixed_batch_rows_match_solo_runs(rt_ab):
    """Each row of a batch mixing a, b and base rows gets the logits of running it alone."""
    gen = torch.Generator().manual_seed(0)
    ids = torch.randint(0, VOCAB, (5, 9), generator=gen)
    row_adapters = ["a", None, "b", "b", "a"]
    segments = [("a", 0, 1), (None, 1, 2), ("b", 2, 4), ("a", 4, 5)]
    mixed = logits(rt_ab, ids, segments)
    base = logits(rt_ab, ids, [])
    for r, aid in enumerate(row_adapters):
        solo = logits(rt_ab, ids[r:r + 1], [(aid, 0, 1)])
        assert torch.allclose(mixed[r], solo[0], atol=1e-5, rtol=1e-5), f"row {r} ({aid})"
        if aid is not None:  # the adapters really change the outputs
            assert not torch.allclose(solo[0], base[r], atol=1e-3)
        else:
            assert torch.allclose(solo[0], base[r], atol=1e-6)


def test_fused_forward_logprobs_match_solo_with_padding(rt_ab):
    """forward over two models with different lengths (right-padded) equals per-model runs."""
    wa, wb = ce_work("a", random_seqs(3, 1), forward_only=True), ce_work("b", random_seqs(2, 2), forward_only=True)
    fused = rt_ab.forward_backward([wa, wb])
    # One micro-batch for both where this machine's policy proves rows independent (else one each).
    shared = rt_ab.policy.mix_tenants(16, 5)
    assert rt_ab.last_pass.micro_batches == (1 if shared else 2) and rt_ab.last_pass.models == 2
    solo_a, solo_b = rt_ab.forward_backward([wa])[0], rt_ab.forward_backward([wb])[0]
    for got, want in ((fused[0], solo_a), (fused[1], solo_b)):
        for o_got, o_want in zip(got.outputs, want.outputs):
            np.testing.assert_allclose(o_got["logprobs"], o_want["logprobs"], rtol=1e-5, atol=1e-5)
        assert got.metrics["loss:sum"] == pytest.approx(want.metrics["loss:sum"], rel=1e-5)
    assert not rt_ab.adapter("a").has_gradients() and not rt_ab.adapter("b").has_gradients()


def test_gradients_are_isolated_between_adapters(rt_ab):
    """a's gradients from a mixed a+b batch equal a's solo gradients; an a-only batch leaves
    b's tensors without any gradient."""
    wa, wb = ce_work("a", random_seqs(3, 3)), ce_work("b", random_seqs(4, 4))
    rt_ab.forward_backward([wa, wb])
    mixed_a, mixed_b = grads(rt_ab.adapter("a")), grads(rt_ab.adapter("b"))
    for adapter in rt_ab.adapters.values():
        adapter.zero_grad()

    rt_ab.forward_backward([wa])
    solo_a = grads(rt_ab.adapter("a"))
    assert all(g is None for g in grads(rt_ab.adapter("b")).values())  # untouched by a-only work
    rt_ab.adapter("a").zero_grad()
    rt_ab.forward_backward([wb])
    solo_b = grads(rt_ab.adapter("b"))
    assert all(g is None for g in grads(rt_ab.adapter("a")).values())

    for name in solo_a:
        assert_close(mixed_a[name], solo_a[name], name)
    for name in solo_b:
        assert_close(mixed_b[name], solo_b[name], name)
    assert any(g.abs().sum() > 0 for g in solo_a.values())


def test_split_batch_gradient_equals_whole_batch(rt_ab):
    """Sum semantics end to end: fb(4 datums) == fb(2) + fb(2) accumulated, and loss:sum adds."""
    seqs = random_seqs(4, 5)
    whole = rt_ab.forward_backward([ce_work("a", seqs)])[0].metrics["loss:sum"]
    g_whole = grads(rt_ab.adapter("a"))
    rt_ab.adapter("a").zero_grad()
    l1 = rt_ab.forward_backward([ce_work("a", seqs[:2])])[0].metrics["loss:sum"]
    l2 = rt_ab.forward_backward([ce_work("a", seqs[2:])])[0].metrics["loss:sum"]
    g_split = grads(rt_ab.adapter("a"))
    assert whole == pytest.approx(l1 + l2, rel=1e-5)
    for name in g_whole:
        assert_close(g_split[name], g_whole[name], name)


def test_topk_targets_are_the_sum_of_their_columns_in_any_split(rt_ab):
    """cross_entropy with (N, K) targets and weights is K (N,) datums, one per column: its [N, K]
    logprobs are theirs, its per-position loss the sum of theirs, its gradient theirs; and so it
    stays with every datum in a micro-batch of its own (the split invariance)."""
    rng, k = np.random.default_rng(3), 3
    topk, columns = [], []
    for s in random_seqs(4, 9):
        tokens = np.asarray(s[:-1], dtype=np.int64)
        targets = rng.integers(0, VOCAB, (len(tokens), k))
        weights = rng.normal(size=(len(tokens), k)).astype(np.float32)
        topk.append(DatumWork(tokens, {"target_tokens": targets, "weights": weights}))
        columns += [DatumWork(tokens, {"target_tokens": targets[:, j].copy(), "weights": weights[:, j].copy()})
                    for j in range(k)]

    def step(data):
        rt_ab.adapter("a").zero_grad()
        out = rt_ab.forward_backward([FBWork("a", data, "cross_entropy", {}, forward_only=False)])[0]
        return out, grads(rt_ab.adapter("a"))

    ref, g_ref = step(columns)
    whole, g_whole = step(topk)
    rt_ab.max_tokens_per_micro_batch = 16  # one row of the 16-token bucket per micro-batch
    split, g_split = step(topk)
    assert rt_ab.last_pass.micro_batches == len(topk)
    for out, g in ((whole, g_whole), (split, g_split)):
        assert out.metrics["loss:sum"] == pytest.approx(ref.metrics["loss:sum"], rel=1e-5)
        for i, o in enumerate(out.outputs):
            cols = ref.outputs[k * i:k * (i + 1)]
            np.testing.assert_allclose(o["logprobs"], np.stack([c["logprobs"] for c in cols], -1), rtol=1e-6)
            np.testing.assert_allclose(o["elementwise_loss"], sum(c["elementwise_loss"] for c in cols),
                                       rtol=1e-5, atol=1e-6)
        for name in g_ref:
            assert_close(g[name], g_ref[name], name)


def test_removing_an_adapter_leaves_the_others_unchanged(rt_ab):
    """remove_adapter(b) keeps a's outputs bit-identical; b's rows fall back to the base model."""
    ids = torch.randint(0, VOCAB, (2, 7), generator=torch.Generator().manual_seed(1))
    before_a = logits(rt_ab, ids, [("a", 0, 2)])
    base = logits(rt_ab, ids, [])
    rt_ab.remove_adapter("b")
    assert "b" not in rt_ab.adapters
    assert all("b" not in layer.adapters for layer in rt_ab.layers.values())
    assert torch.equal(logits(rt_ab, ids, [("a", 0, 2)]), before_a)
    assert torch.equal(logits(rt_ab, ids, [("b", 0, 2)]), base)
    with pytest.raises(KeyError, match="not loaded"):
        rt_ab.adapter("b")


def test_fresh_adapter_leaves_outputs_exactly_base():
    """A new adapter has B = 0, so its rows give exactly the base model's logits."""
    rt = tiny_runtime()
    ids = torch.randint(0, VOCAB, (3, 6), generator=torch.Generator().manual_seed(2))
    base = logits(rt, ids, [])
    fresh = rt.create_adapter("c", LoRAConfig(rank=4, seed=3))
    assert all(torch.count_nonzero(w.B) == 0 and torch.count_nonzero(w.A) > 0 for w in fresh.weights.values())
    assert torch.equal(logits(rt, ids, [("c", 0, 3)]), base)
    with pytest.raises(ValueError, match="already has an adapter"):
        rt.create_adapter("c", LoRAConfig(rank=4))


def test_adapter_init_is_deterministic_from_seed():
    """Same seed -> identical A factors regardless of global RNG state; another seed differs."""
    rt = tiny_runtime()
    torch.manual_seed(123)
    x = rt.create_adapter("x", LoRAConfig(rank=4, seed=7))
    torch.manual_seed(999)
    torch.rand(10)
    y = rt.create_adapter("y", LoRAConfig(rank=4, seed=7))
    z = rt.create_adapter("z", LoRAConfig(rank=4, seed=8))
    other_rt = tiny_runtime(seed=5)  # other base weights, same shapes
    w = other_rt.create_adapter("w", LoRAConfig(rank=4, seed=7))
    tx, ty, tz, tw = x.named_tensors(), y.named_tensors(), z.named_tensors(), w.named_tensors()
    assert list(tx) == list(ty) == list(tz) == list(tw)
    assert all(torch.equal(tx[k], ty[k]) and torch.equal(tx[k], tw[k]) for k in tx)
    assert any(not torch.equal(tx[k], tz[k]) for k in tx if "lora_A" in k)
    # PEFT's bound for A: U(-1/sqrt(in), 1/sqrt(in)).
    for path, wt in x.weights.items():
        assert wt.A.abs().max() <= 1 / np.sqrt(rt.layers[path].in_features)


def test_lora_config_that_adapts_nothing_is_rejected():
    """A config with every train_* flag off cannot create an adapter."""
    rt = tiny_runtime()
    with pytest.raises(ValueError, match="adapts no projection"):
        rt.create_adapter("n", LoRAConfig(rank=4, train_attn=False, train_mlp=False, train_unembed=False))


def _other_device() -> torch.device:
    """A device distinct from `cpu` for paging: the GPU when present, else the explicit cpu:0."""
    return torch.device("cuda") if torch.cuda.is_available() else torch.device("cpu", 0)


def test_move_to_round_trip_keeps_optimizer_state_usable():
    """Paging an adapter out and back (with pending grads and AdamW moments) trains exactly like
    an adapter that never moved."""
    rt = tiny_runtime()
    moved = rt.create_adapter("moved", LoRAConfig(rank=4, seed=11))
    still = rt.create_adapter("still", LoRAConfig(rank=4, seed=11))
    params = AdamParams(learning_rate=1e-2, weight_decay=0.01)
    seqs = random_seqs(3, 6)
    for _ in range(2):
        for mid in ("moved", "still"):
            rt.forward_backward([ce_work(mid, seqs)])
            rt.optim_step(mid, params)
    for mid in ("moved", "still"):  # pending gradients travel too
        rt.forward_backward([ce_work(mid, seqs)])

    ids_before = {id(p) for p in moved.parameters()}
    other = _other_device()
    moved.move_to(other)
    assert moved.device == other
    for p in moved.parameters():
        assert p.device.type == other.type and p.grad is not None and p.grad.device.type == other.type
        st = moved.optimizer.state[p]
        assert st["exp_avg"].device.type == other.type and st["exp_avg_sq"].device.type == other.type
    moved.move_to(CPU)
    assert moved.device == CPU and {id(p) for p in moved.parameters()} == ids_before
    assert all(p in moved.optimizer.state for p in moved.parameters())

    for mid in ("moved", "still"):
        rt.optim_step(mid, params)
        rt.forward_backward([ce_work(mid, seqs)])
        rt.optim_step(mid, params)
    tm, ts = moved.named_tensors(), still.named_tensors()
    for k in tm:
        assert torch.equal(tm[k], ts[k]), k
    assert moved.step == still.step == 4


def test_optim_step_reports_preclip_norm_and_clips():
    """optim_step returns the pre-clip gradient norm and zeroes gradients afterwards."""
    rt = tiny_runtime()
    ad = rt.create_adapter("a", LoRAConfig(rank=4, seed=0))
    rt.forward_backward([ce_work("a", random_seqs(2, 7))])
    norm = float(torch.linalg.vector_norm(torch.cat([p.grad.flatten() for p in ad.parameters() if p.grad is not None])))
    metrics = rt.optim_step("a", AdamParams(learning_rate=1e-3, grad_clip_norm=norm / 10))
    assert metrics["grad_norm"] == pytest.approx(norm, rel=1e-5)
    assert metrics["learning_rate"] == 1e-3
    assert not ad.has_gradients()


def test_multi_adapter_adamw_step_is_torch_adamw_and_many_equal_one():
    """`optim_steps` over several adapters with different hyper-parameters (clipping included)
    gives each adapter torch.optim.AdamW's update, and bit for bit what stepping it alone gives."""
    hps = {"a": AdamParams(learning_rate=1e-2, weight_decay=0.1),
           "b": AdamParams(learning_rate=3e-3, beta1=0.8, beta2=0.99, eps=1e-8, grad_clip_norm=1e-3),
           "c": AdamParams(learning_rate=1e-2, weight_decay=0.1)}  # same group as "a"
    together, alone = tiny_runtime(), tiny_runtime()
    refs = {}
    for rt in (together, alone):
        for i, mid in enumerate(hps):
            randomize_b(rt.create_adapter(mid, LoRAConfig(rank=4, seed=i)), seed=i)
    for mid in hps:  # reference: torch's own AdamW on copies of the same tensors
        ps = [p.detach().clone().requires_grad_(True) for p in together.adapter(mid).parameters()]
        hp = hps[mid]
        refs[mid] = (ps, torch.optim.AdamW(ps, lr=hp.learning_rate, betas=(hp.beta1, hp.beta2), eps=hp.eps,
                                           weight_decay=hp.weight_decay, foreach=False))
    for step in range(3):
        for rt in (together, alone):
            rt.forward_backward([ce_work(mid, random_seqs(2, 10 * step + i)) for i, mid in enumerate(hps)])
        for mid, (ps, opt) in refs.items():
            for p, q in zip(ps, together.adapter(mid).parameters()):
                p.grad = q.grad.clone()
            if hps[mid].grad_clip_norm:
                torch.nn.utils.clip_grad_norm_(ps, hps[mid].grad_clip_norm)
            opt.step()
        metrics = together.optim_steps(list(hps.items()))
        solo = [alone.optim_step(mid, hp) for mid, hp in hps.items()]
        assert [m["grad_norm"] for m in metrics] == [m["grad_norm"] for m in solo]
        assert metrics[1]["grad_norm"] > hps["b"].grad_clip_norm  # clipping really happened
    for mid, (ps, _) in refs.items():
        for p, q, r in zip(together.adapter(mid).parameters(), alone.adapter(mid).parameters(), ps):
            assert torch.equal(p, q), mid
            assert_close(p.detach(), r.detach(), f"{mid} vs torch.optim.AdamW", tol=1e-6)
        assert together.adapter(mid).step == 3


def test_a_step_proven_finite_copies_nothing_and_loaded_moments_keep_the_undo(monkeypatch):
    """An ordinary step is proven beforehand to leave the weights finite (`adamw._stays_finite`,
    from the gradient norm, the weights' norm and a bound on |exp_avg| kept across steps), so it
    makes no copy to undo itself. Moments loaded from elsewhere widen that bound when they are
    loaded: a step their huge values would blow up is still copied, and put back."""
    from hosted_tinker.runtime import adamw as adamw_module

    copied = []
    real = adamw_module._StateCopy
    monkeypatch.setattr(adamw_module, "_StateCopy", lambda adapter, params: copied.append(adapter.adapter_id)
                        or real(adapter, params))
    rt = tiny_runtime()
    for i in range(2):
        randomize_b(rt.create_adapter(f"t{i}", LoRAConfig(rank=4, seed=i)), seed=i)
    steps = [(f"t{i}", AdamParams(learning_rate=1e-2)) for i in range(2)]
    rt.forward_backward([ce_work(f"t{i}", random_seqs(2, 40 + i)) for i in range(2)])
    assert not any(isinstance(r, SkippedStep) for r in rt.optim_steps(steps)) and copied == []
    t1 = rt.adapter("t1")
    for p in t1.parameters():  # as `checkpoints.adapter_io.restore_adapter` puts moments in
        t1.optimizer.load(p, {"step": t1.optimizer.state[p]["step"], "exp_avg": torch.full_like(p, 1e30),
                              "exp_avg_sq": torch.zeros_like(p)})
    before = {k: v.clone() for k, v in t1.named_tensors().items()}
    rt.forward_backward([ce_work(f"t{i}", random_seqs(2, 50 + i)) for i in range(2)])
    results = rt.optim_steps(steps)
    assert copied == ["t1"]
    assert not isinstance(results[0], SkippedStep) and isinstance(results[1], SkippedStep)
    assert all(torch.equal(v, before[k]) for k, v in t1.named_tensors().items())


def test_micro_batch_default_follows_device_and_mlp_width():
    """Unset (0/None) = auto: 8192 on a GPU; on CPU the MLP activations of a micro-batch stay
    within ~6 MiB (2048 tokens at MLP 768, 1024 at MLP 1536), clamped to 512..8192; an explicit
    setting wins."""
    from transformers import Qwen3Config

    from hosted_tinker.runtime.kernel_choices import default_micro_batch_tokens

    def model(mlp: int) -> torch.nn.Module:
        m = torch.nn.Module()
        m.config = Qwen3Config(intermediate_size=mlp)
        return m

    assert [default_micro_batch_tokens(model(w), CPU) for w in (64, 768, 1536, 12288)] == [8192, 2048, 1024, 512]
    assert default_micro_batch_tokens(model(12288), torch.device("cuda")) == 8192
    assert tiny_runtime().max_tokens_per_micro_batch == 8192  # MLP 64
    assert TrainingRuntime(tiny_qwen3(), "t", device=CPU, max_tokens_per_micro_batch=300).max_tokens_per_micro_batch == 300


def test_the_unprobed_sampling_path_computes_the_same_deltas():
    """`routing.batch(..., exact=False)` (the sampler on CUDA): tenants of one shape in one LoRA
    call without probes or canonical pairs, no autograd Function. Same math as the exact path:
    equal logits up to float rounding, adapters with rows out of slot order included."""
    rt = tiny_runtime()
    for i, rank in enumerate((4, 4, 8, 4)):
        randomize_b(rt.create_adapter(f"s{i}", LoRAConfig(rank=rank, seed=i)), seed=i)
    ids = torch.randint(0, 100, (8, 5), generator=torch.Generator().manual_seed(0))
    segments = [("s3", 0, 2), ("s0", 2, 4), ("s2", 4, 6), (None, 6, 7), ("s1", 7, 8)]
    exact = logits(rt, ids, segments)
    with rt.routing.batch(segments, exact=False), torch.no_grad():
        fast = rt.model(input_ids=ids, use_cache=False).logits
    assert not torch.equal(exact, logits(rt, ids, []))  # the adapters change the outputs
    torch.testing.assert_close(fast, exact, rtol=1e-5, atol=1e-5)
