"""Unit tests of the loss contract (shared/reference/losses.md): config resolution, datum
validation messages, hand-computed per-token losses and gradients, and sum semantics."""

from __future__ import annotations

import math
import re

import numpy as np
import pytest
import torch

from hosted_tinker.runtime.losses import (
    KNOWN_UNSUPPORTED,
    LOSSES,
    Loss,
    LossInputError,
    LossOut,
    check_one_targets_shape,
    merge_metrics,
    per_token_loss,
    prepare_inputs,
    resolve_loss_config,
    run_losses,
    topk_cross_entropy,
    validate_data,
    validate_datum,
)

# ---------------------------------------------------------------------------------------------
# resolve_loss_config
# ---------------------------------------------------------------------------------------------


def test_config_defaults():
    """Documented defaults: ppo 0.8/1.2 ratio bounds, cispo 0/4, no config for CE and IS."""
    assert resolve_loss_config("cross_entropy", {}) == {}
    assert resolve_loss_config("importance_sampling", {}) == {}
    assert resolve_loss_config("ppo", {}) == {"clip_low_threshold": 0.8, "clip_high_threshold": 1.2}
    assert resolve_loss_config("cispo", {}) == {"clip_low_threshold": 0.0, "clip_high_threshold": 4.0}
    assert resolve_loss_config("ppo", {"clip_high_threshold": 1.5}) == {
        "clip_low_threshold": 0.8, "clip_high_threshold": 1.5}
    assert resolve_loss_config("dro", {"beta": 2}) == {"beta": 2.0}


def test_config_unknown_keys_are_rejected():
    """A key the loss does not use is an error that names the key and the loss's own keys."""
    with pytest.raises(LossInputError, match=r"\['epsilon'\].*'ppo'.*clip_high_threshold"):
        resolve_loss_config("ppo", {"epsilon": 0.2})
    with pytest.raises(LossInputError, match=r"\['beta'\].*'cross_entropy'.*none"):
        resolve_loss_config("cross_entropy", {"beta": 0.1})


def test_dro_needs_beta():
    """dro has no default beta: omitting it is an error naming loss_fn_config['beta']."""
    with pytest.raises(LossInputError, match=r"'dro' needs loss_fn_config\['beta'\]"):
        resolve_loss_config("dro", {})


@pytest.mark.parametrize("bad", [float("nan"), float("inf"), "0.5"])
def test_config_values_must_be_finite_numbers(bad):
    """Non-finite or string config values are rejected with the key named."""
    with pytest.raises(LossInputError, match=r"clip_low_threshold.*finite number"):
        resolve_loss_config("ppo", {"clip_low_threshold": bad})


def test_unknown_loss_name():
    """An unknown loss name lists the supported ones."""
    with pytest.raises(LossInputError, match=r"unknown loss_fn 'mse'; expected one of \['cispo', 'cross_entropy'"):
        resolve_loss_config("mse", {})


@pytest.mark.parametrize("name", sorted(KNOWN_UNSUPPORTED))
def test_known_unsupported_losses_are_refused_not_mapped(name):
    """Server-side custom losses get their explicit refusal message, never a fallback."""
    with pytest.raises(LossInputError) as exc:
        resolve_loss_config(name, {})
    assert str(exc.value) == KNOWN_UNSUPPORTED[name]
    assert f"'{name}'" in str(exc.value) or name == "custom"


def test_clip_low_above_high_is_rejected():
    """clip_low_threshold > clip_high_threshold is an error; equal bounds are allowed."""
    with pytest.raises(LossInputError, match="clip_low_threshold 1.3 is above clip_high_threshold 1.2"):
        resolve_loss_config("ppo", {"clip_low_threshold": 1.3})
    with pytest.raises(LossInputError, match="above"):
        resolve_loss_config("cispo", {"clip_low_threshold": 2.0, "clip_high_threshold": 1.0})
    assert resolve_loss_config("ppo", {"clip_low_threshold": 1.0, "clip_high_threshold": 1.0})


# ---------------------------------------------------------------------------------------------
# validate_datum
# ---------------------------------------------------------------------------------------------

V, CTX, IDX, MAX_K = 50, 16, 7, 4


def ce_inputs(n: int) -> dict[str, np.ndarray]:
    return {"target_tokens": np.arange(n, dtype=np.int64) % V, "weights": np.ones(n, np.float32)}


def rl_inputs(n: int) -> dict[str, np.ndarray]:
    return {"target_tokens": np.arange(n, dtype=np.int64) % V, "logprobs": -np.ones(n, np.float32),
            "advantages": np.ones(n, np.float32)}


def check(tokens, inputs, loss_fn="cross_entropy"):
    validate_datum(IDX, np.asarray(tokens, dtype=np.int64), inputs, loss_fn, V, CTX, MAX_K)


def test_valid_datums_pass():
    """Good CE and RL datums validate; RL needs no weights; weights may be negative."""
    check([1, 2, 3], ce_inputs(3))
    for name in ("importance_sampling", "ppo", "cispo", "dro"):
        check([1, 2, 3], rl_inputs(3), name)
    inputs = ce_inputs(3)
    inputs["weights"] = np.array([-2.5, 0.0, 3.0], np.float32)  # forward_backward_custom sends these
    check([1, 2, 3], inputs)
    inputs["target_tokens"] = np.array([1.0, 2.0, 3.0])  # integral floats are fine
    check([1, 2, 3], inputs)


# Each: an unusable datum (its loss, tokens, its inputs from the loss's good ones) and what its error names.
DATUM_FAULTS = [
    ("cross_entropy", [], lambda d: {}, "model_input", "is empty"),
    ("cross_entropy", list(range(CTX + 1)), lambda d: ce_inputs(CTX + 1), "model_input", "above the model's context of 16"),
    ("cross_entropy", [1, V, 2], None, "model_input", f"token {V} at position 1 is outside the vocabulary [0, {V})"),
    ("cross_entropy", [-1, 2, 3], None, "model_input", "token -1 at position 0"),
    ("cross_entropy", [1, 2, 3], lambda d: {k: v for k, v in d.items() if k != "weights"}, "weights", "needs"),
    ("cross_entropy", [1, 2, 3], lambda d: {k: v for k, v in d.items() if k != "target_tokens"}, "target_tokens", "needs"),
    ("ppo", [1, 2, 3], lambda d: {k: v for k, v in d.items() if k != "advantages"}, "advantages", "needs"),
    ("ppo", [1, 2, 3], lambda d: {k: v for k, v in d.items() if k != "logprobs"}, "logprobs", "needs"),
    ("cross_entropy", [1, 2, 3], lambda d: {**d, "weights": np.ones(2, np.float32)}, "weights", "has shape [2], expected [3]"),
    ("cross_entropy", [1, 2, 3], lambda d: {**d, "weights": np.ones((3, 1), np.float32)}, "weights", "has shape [3, 1], expected [3]"),
    ("cross_entropy", [1, 2, 3], lambda d: {**d, "target_tokens": np.arange(4)}, "target_tokens", "has shape [4], expected [3]"),
    ("cross_entropy", [1, 2, 3], lambda d: {**d, "target_tokens": np.array([1.0, 2.5, 3.0])}, "target_tokens", "must be integers"),
    ("cross_entropy", [1, 2, 3], lambda d: {**d, "target_tokens": np.array([1, 2, V + 4])}, "target", f"target token {V + 4} at position 2"),
    ("cross_entropy", [1, 2, 3], lambda d: {**d, "target_tokens": np.array([-3, 2, 1])}, "target", "target token -3 at position 0"),
    ("cross_entropy", [1, 2, 3], lambda d: {**d, "weights": np.array([1, np.nan, 1], np.float32)}, "weights", "non-finite value at position 1"),
    ("ppo", [1, 2, 3], lambda d: {**d, "logprobs": np.array([-1, -1, -np.inf], np.float32)}, "logprobs", "non-finite value at position 2"),
    ("dro", [1, 2, 3], lambda d: {**d, "advantages": np.array([np.inf, 0, 0], np.float32)}, "advantages", "non-finite value at position 0"),
    ("importance_sampling", [1, 2, 3], lambda d: {**d, "advantages": np.ones(5, np.float32)}, "advantages", "expected [3]"),
    # (N, K) targets: cross_entropy's only, weights alike, K bounded
    ("cross_entropy", [1, 2, 3], lambda d: {**d, "target_tokens": np.ones((3, 2), np.int64)}, "weights",
     "has shape [3], expected [3, 2] (one weight per target)"),
    ("cross_entropy", [1, 2, 3], lambda d: {**d, "weights": np.ones((3, 2), np.float32)}, "weights",
     "has shape [3, 2], expected [3] (one value per model_input token)"),
    ("cross_entropy", [1, 2, 3], lambda d: {"target_tokens": np.ones((3, 2), np.int64), "weights": np.ones((3, 3), np.float32)},
     "weights", "has shape [3, 3], expected [3, 2]"),
    ("cross_entropy", [1, 2, 3], lambda d: {"target_tokens": np.ones((2, 2), np.int64), "weights": np.ones((2, 2), np.float32)},
     "target_tokens", "has shape [2, 2], expected [3, 2] (K targets per model_input token)"),
    ("cross_entropy", [1, 2, 3], lambda d: {**d, "target_tokens": np.ones((3, MAX_K + 1), np.int64)}, "target_tokens",
     f"has shape [3, {MAX_K + 1}], expected [3] or [3, K] with 1 <= K <= {MAX_K} (this server's max_targets_per_position)"),
    ("cross_entropy", [1, 2, 3], lambda d: {**d, "target_tokens": np.ones((3, 0), np.int64)}, "target_tokens",
     "expected [3] or [3, K] with 1 <= K"),
    ("cross_entropy", [1, 2, 3], lambda d: {**d, "target_tokens": np.ones((3, 1, 1), np.int64)}, "target_tokens",
     "has shape [3, 1, 1], expected [3] or [3, K] (one target, or K, per model_input token)"),
    ("cross_entropy", [1, 2, 3], lambda d: {"target_tokens": np.array([[1, 2], [3, V], [4, 5]]), "weights": np.ones((3, 2), np.float32)},
     "target", f"target token {V} at position 1 (target 1) is outside the vocabulary"),
    ("cross_entropy", [1, 2, 3], lambda d: {"target_tokens": np.ones((3, 2), np.int64), "weights": np.array([[1, 1], [1, 1], [np.inf, 1]], np.float32)},
     "weights", "non-finite value at position 2 (target 0)"),
    ("importance_sampling", [1, 2, 3], lambda d: {**d, "target_tokens": np.ones((3, 2), np.int64)}, "target_tokens",
     "has shape [3, 2], expected [3] (one target per model_input token): loss 'importance_sampling' needs the "
     "sampler's logprob of each position's one token; only cross_entropy takes [N, K] targets"),
    ("ppo", [1, 2, 3], lambda d: {**d, "target_tokens": np.ones((3, 2), np.int64)}, "target_tokens", "only cross_entropy"),
]


@pytest.mark.parametrize("loss_fn, tokens, mutate, field_name, fragment", DATUM_FAULTS)
def test_validate_datum_errors_name_datum_and_field(loss_fn, tokens, mutate, field_name, fragment):
    """Every validation failure is a LossInputError naming the datum index and the field."""
    base = ce_inputs(len(tokens)) if loss_fn == "cross_entropy" else rl_inputs(len(tokens))
    inputs = base if mutate is None else mutate(base)
    with pytest.raises(LossInputError) as exc:
        check(tokens, inputs, loss_fn)
    msg = str(exc.value)
    assert msg.startswith(f"datum {IDX}:"), msg
    assert field_name in msg and fragment in msg, msg


def good_inputs(loss_fn: str, n: int) -> dict[str, np.ndarray]:
    return ce_inputs(n) if loss_fn == "cross_entropy" else rl_inputs(n)


@pytest.mark.parametrize("loss_fn, tokens, mutate, field_name, fragment", DATUM_FAULTS)
def test_validate_data_gives_the_first_faulty_datums_error(loss_fn, tokens, mutate, field_name, fragment):
    """A request's datums checked together (`validate_data`: values checked once over all of them)
    fail with the very error `validate_datum` gives the faulty one, first, last or between good ones."""
    inputs = good_inputs(loss_fn, len(tokens))
    bad = (np.asarray(tokens, np.int64), inputs if mutate is None else mutate(inputs))
    with pytest.raises(LossInputError) as alone:
        validate_datum(IDX, *bad, loss_fn, V, CTX, MAX_K)
    for at in (0, 1, 3):
        data = [(np.arange(1, 4, dtype=np.int64), good_inputs(loss_fn, 3)) for _ in range(3)]
        data.insert(at, bad)
        with pytest.raises(LossInputError) as together:
            validate_data(data, loss_fn, V, CTX, MAX_K)
        assert str(together.value) == str(alone.value).replace(f"datum {IDX}:", f"datum {at}:", 1)


def test_validate_data_finds_a_fault_in_any_datum_of_many():
    """Seeded: requests of 1-40 good datums of mixed lengths (int and whole-float targets, K targets
    alike) pass; one value spoiled anywhere (a token or target out of the vocabulary at either end,
    a fractional or NaN float target, a non-finite float input) fails as `validate_datum` fails."""
    rng = np.random.default_rng(5)
    for case in range(300):
        loss_fn = ("cross_entropy", "ppo", "importance_sampling")[case % 3]
        k = int(rng.integers(1, MAX_K + 1)) if loss_fn == "cross_entropy" and case % 4 == 0 else 0
        data = []
        for _ in range(int(rng.integers(1, 41))):
            n = int(rng.integers(1, CTX + 1))
            inputs = good_inputs(loss_fn, n)
            inputs["target_tokens"] = rng.integers(0, V, (n, k) if k else n)
            if k:
                inputs["weights"] = rng.standard_normal((n, k)).astype(np.float32)
            if rng.random() < 0.3:  # sent as floats: whole numbers are fine
                inputs["target_tokens"] = inputs["target_tokens"].astype(np.float32)
            data.append((rng.integers(0, V, n), inputs))
        validate_data(data, loss_fn, V, CTX, MAX_K)
        i = int(rng.integers(len(data)))
        tokens, inputs = data[i]
        key = str(rng.choice(["tokens", "target_tokens", *(k for k in inputs if k != "target_tokens")]))
        arr = tokens if key == "tokens" else inputs[key]
        arr = arr.astype(np.float32) if key == "target_tokens" and rng.random() < 0.5 else arr.copy()
        at = tuple(int(rng.integers(d)) for d in arr.shape)
        if key == "tokens" or key == "target_tokens" and arr.dtype.kind == "i":
            arr[at] = (-1, V, V + 10**6)[case % 3]
        elif key == "target_tokens":
            arr[at] = (0.5, np.nan, V)[case % 3]
        else:
            arr[at] = (np.nan, np.inf, -np.inf)[case % 3]
        data[i] = (arr, inputs) if key == "tokens" else (tokens, {**inputs, key: arr})
        with pytest.raises(LossInputError) as together:
            validate_data(data, loss_fn, V, CTX, MAX_K)
        with pytest.raises(LossInputError) as alone:
            validate_datum(i, *data[i], loss_fn, V, CTX, MAX_K)
        assert str(together.value) == str(alone.value)


def test_one_targets_shape_per_request():
    """(N,) targets, or (N, K) ones with one K, in every datum of a request: its outputs come back
    as one tensor per field with one trailing shape."""
    check_one_targets_shape([0, 0, 0])
    check_one_targets_shape([5, 5])
    for ks, fragment in (([0, 3], "datum 1: loss_fn_inputs['target_tokens'] has shape [N, 3] but datum 0's is [N]"),
                         ([4, 4, 2], "datum 2: loss_fn_inputs['target_tokens'] has shape [N, 2] but datum 0's is [N, 4]")):
        with pytest.raises(LossInputError, match=re.escape(fragment)):
            check_one_targets_shape(ks)


def test_topk_cross_entropy_sums_weighted_logprobs_over_k():
    lp = t([[-1.0, -2.0], [-0.5, -3.0]], grad=True)
    w = t([[0.75, 0.25], [1.0, -2.0]])
    loss = topk_cross_entropy(lp, w)
    assert loss.tolist() == [1.25, 0.5 - 6.0]
    loss.sum().backward()
    assert lp.grad.tolist() == (-w).tolist()


# ---------------------------------------------------------------------------------------------
# per_token_loss against hand-computed values
# ---------------------------------------------------------------------------------------------

LP = [-1.0, -2.0, -0.5, -0.3, -3.0]     # target_logprobs (current policy)
SLP = [-1.2, -1.5, -0.5, -1.0, -2.5]    # sampler's logprobs
ADV = [1.0, -2.0, 0.5, -1.0, 1.0]
RATIO = [math.exp(a - b) for a, b in zip(LP, SLP)]  # 1.2214, 0.6065, 1.0, 2.0138, 0.6065


def t(x, grad=False):
    return torch.tensor(x, dtype=torch.float64, requires_grad=grad)


def loss_and_grad(loss_fn, config, inputs):
    lp = t(LP, grad=True)
    tok = per_token_loss(loss_fn, config, lp, inputs)
    (g,) = torch.autograd.grad(tok.sum(), lp)
    return tok.detach().tolist(), g.tolist()


def test_cross_entropy_values_and_gradient():
    """CE per-token loss is -weights*logprob (negative weights included); d/dlp = -weights."""
    w = [1.0, 0.5, -2.0, 0.0, 3.0]
    tok, g = loss_and_grad("cross_entropy", {}, {"weights": t(w)})
    assert tok == pytest.approx([-(a * b) for a, b in zip(LP, w)])
    assert tok[:3] == pytest.approx([1.0, 1.0, -1.0])
    assert g == pytest.approx([-x for x in w])


def test_importance_sampling_values_and_gradient():
    """IS per-token loss is -ratio*A; d/dlp = -ratio*A."""
    tok, g = loss_and_grad("importance_sampling", {}, {"logprobs": t(SLP), "advantages": t(ADV)})
    expected = [-(r * a) for r, a in zip(RATIO, ADV)]
    assert tok == pytest.approx(expected, rel=1e-12)
    assert g == pytest.approx(expected, rel=1e-12)


def test_ppo_clipping_both_sides_with_both_advantage_signs():
    """PPO takes min(r*A, clip(r)*A): clipped (zero grad) when the ratio moves in A's favour
    past a bound, unclipped (grad -r*A) otherwise."""
    cfg = resolve_loss_config("ppo", {})  # ratio bounds 0.8 / 1.2
    tok, g = loss_and_grad("ppo", cfg, {"logprobs": t(SLP), "advantages": t(ADV)})
    # token 0: r=1.221 > 1.2, A>0  -> clipped high: objective 1.2*1 ; no gradient
    # token 1: r=0.607 < 0.8, A<0  -> clipped low:  objective 0.8*(-2) = -1.6 ; no gradient
    # token 2: r=1 inside, A>0      -> r*A = 0.5 ; grad -0.5
    # token 3: r=2.014 > 1.2, A<0   -> unclipped (min picks r*A = -2.014) ; grad +2.014
    # token 4: r=0.607 < 0.8, A>0   -> unclipped (min picks r*A = 0.607) ; grad -0.607
    expected = [-1.2, 1.6, -0.5, RATIO[3], -RATIO[4]]
    assert tok == pytest.approx(expected, rel=1e-12)
    assert g == pytest.approx([0.0, 0.0, -0.5, RATIO[3], -RATIO[4]], rel=1e-12, abs=1e-15)


def test_ppo_custom_bounds_are_ratio_bounds_not_epsilons():
    """clip_low/high_threshold are used as ratio bounds directly (0.5..1.1, not 1±eps)."""
    cfg = resolve_loss_config("ppo", {"clip_low_threshold": 0.5, "clip_high_threshold": 1.1})
    tok, _ = loss_and_grad("ppo", cfg, {"logprobs": t(SLP), "advantages": t(ADV)})
    assert tok[0] == pytest.approx(-1.1)  # r=1.22 clipped to 1.1 with A=1
    assert tok[1] == pytest.approx(RATIO[1] * 2.0)  # r=0.607 inside [0.5, 1.1]: unclipped


def test_cispo_values_and_stop_gradient():
    """CISPO is -stopgrad(clip(r))*lp*A: d/dlp equals -clip(r)*A (no gradient through r)."""
    cfg = {"clip_low_threshold": 0.8, "clip_high_threshold": 1.2}
    tok, g = loss_and_grad("cispo", cfg, {"logprobs": t(SLP), "advantages": t(ADV)})
    clipped = [min(max(r, 0.8), 1.2) for r in RATIO]
    assert clipped[:2] == pytest.approx([1.2, 0.8])
    assert tok == pytest.approx([-(c * lp * a) for c, lp, a in zip(clipped, LP, ADV)], rel=1e-12)
    assert g == pytest.approx([-(c * a) for c, a in zip(clipped, ADV)], rel=1e-12)
    # Default bounds 0..4 clip a large ratio to 4.
    cfg = resolve_loss_config("cispo", {})
    lp = t([0.0], grad=True)
    tok = per_token_loss("cispo", cfg, lp, {"logprobs": t([-3.0]), "advantages": t([2.0])})
    (g,) = torch.autograd.grad(tok.sum(), lp)
    assert g.item() == pytest.approx(-4.0 * 2.0)


def test_dro_values_and_gradient():
    """DRO is -(lp*A - beta/2*(lp - slp)^2); d/dlp = -(A - beta*(lp - slp))."""
    beta = 0.7
    tok, g = loss_and_grad("dro", {"beta": beta}, {"logprobs": t(SLP), "advantages": t(ADV)})
    assert tok == pytest.approx(
        [-(lp * a - 0.5 * beta * (lp - s) ** 2) for lp, s, a in zip(LP, SLP, ADV)], rel=1e-12)
    assert g == pytest.approx([-(a - beta * (lp - s)) for lp, s, a in zip(LP, SLP, ADV)], rel=1e-12)


def test_zero_advantage_and_zero_weight_contribute_exactly_zero():
    """Padding/masking relies on zero weights/advantages giving exactly 0 loss and gradient."""
    zeros = t([0.0] * len(LP))
    for name in ("importance_sampling", "ppo", "cispo"):
        cfg = resolve_loss_config(name, {})
        tok, g = loss_and_grad(name, cfg, {"logprobs": t(SLP), "advantages": zeros})
        assert all(x == 0.0 for x in tok) and all(x == 0.0 for x in g)
    tok, g = loss_and_grad("cross_entropy", {}, {"weights": zeros})
    assert all(x == 0.0 for x in tok) and all(x == 0.0 for x in g)


# ---------------------------------------------------------------------------------------------
# Sum semantics
# ---------------------------------------------------------------------------------------------

CONFIGS = {"cross_entropy": {}, "importance_sampling": {}, "ppo": resolve_loss_config("ppo", {}),
           "cispo": resolve_loss_config("cispo", {}), "dro": {"beta": 0.3}}


@pytest.mark.parametrize("name", sorted(CONFIGS))
def test_loss_of_concatenation_is_sum_of_parts(name):
    """Loss and gradient of a concatenated sequence equal the sums over its parts (no mean), for
    every token-wise loss (gspo's ratio is per datum: see test_gspo_batch_is_the_sum_of_its_datums)."""
    gen = torch.Generator().manual_seed(0)
    n1, n2 = 3, 5
    lp = -torch.rand(n1 + n2, generator=gen, dtype=torch.float64)
    inputs = {"weights": torch.randn(n1 + n2, generator=gen, dtype=torch.float64),
              "logprobs": -torch.rand(n1 + n2, generator=gen, dtype=torch.float64),
              "advantages": torch.randn(n1 + n2, generator=gen, dtype=torch.float64)}
    cfg = CONFIGS[name]

    whole_lp = lp.clone().requires_grad_(True)
    whole = per_token_loss(name, cfg, whole_lp, inputs).sum()
    (g_whole,) = torch.autograd.grad(whole, whole_lp)

    parts, grads = [], []
    for sl in (slice(0, n1), slice(n1, n1 + n2)):
        part_lp = lp[sl].clone().requires_grad_(True)
        part = per_token_loss(name, cfg, part_lp, {k: v[sl] for k, v in inputs.items()}).sum()
        (g,) = torch.autograd.grad(part, part_lp)
        parts.append(part.item())
        grads.append(g)
    assert whole.item() == pytest.approx(sum(parts), rel=1e-12)
    assert torch.allclose(g_whole, torch.cat(grads), rtol=1e-12, atol=0)

    # A padded [rows, T] block with zero weights/advantages in the padding gives the same sum.
    block_lp = torch.zeros(2, n2, dtype=torch.float64)
    block_lp[0, :n1], block_lp[1] = lp[:n1], lp[n1:]
    block_in = {}
    for k, v in inputs.items():
        b = torch.zeros(2, n2, dtype=torch.float64)
        b[0, :n1], b[1] = v[:n1], v[n1:]
        block_in[k] = b
    mask = torch.zeros(2, n2, dtype=torch.float64)
    mask[0, :n1], mask[1] = 1, 1
    block = (per_token_loss(name, cfg, block_lp, block_in) * mask).sum()
    assert block.item() == pytest.approx(sum(parts), rel=1e-12)


# ---------------------------------------------------------------------------------------------
# SDK 0.38: gspo, stable_reinforce, per-row clip bounds, sequence_ratio_mask
# ---------------------------------------------------------------------------------------------


def test_new_loss_configs_defaults_and_keys():
    """gspo takes ppo's ratio bounds; stable_reinforce takes only kl_coeff (default 0.01, >= 0)."""
    assert resolve_loss_config("gspo", {}) == {"clip_low_threshold": 0.8, "clip_high_threshold": 1.2}
    assert resolve_loss_config("stable_reinforce", {}) == {"kl_coeff": 0.01}
    assert resolve_loss_config("stable_reinforce", {"kl_coeff": 0}) == {"kl_coeff": 0.0}
    with pytest.raises(LossInputError, match=r"\['beta'\].*'stable_reinforce'.*\['kl_coeff'\]"):
        resolve_loss_config("stable_reinforce", {"beta": 0.1})
    with pytest.raises(LossInputError, match=r"\['kl_coeff'\].*'gspo'.*clip_high_threshold"):
        resolve_loss_config("gspo", {"kl_coeff": 0.1})
    with pytest.raises(LossInputError, match=r"kl_coeff'\] must be >= 0, got -0.5"):
        resolve_loss_config("stable_reinforce", {"kl_coeff": -0.5})
    with pytest.raises(LossInputError, match=r"kl_coeff'\] must be a finite number, got the text '0.1'"):
        resolve_loss_config("stable_reinforce", {"kl_coeff": "0.1"})


def test_clip_and_ratio_mask_tensors_are_validated_per_token():
    """The SDK's float32 per-row keys are checked like the others: shape [N], finite."""
    for key in ("clip_low_threshold", "clip_high_threshold", "sequence_ratio_mask"):
        with pytest.raises(LossInputError, match=rf"datum 7: loss_fn_inputs\['{key}'\] has shape \[2\]"):
            check([1, 2, 3], {**rl_inputs(3), key: np.ones(2, np.float32)}, "gspo")
        with pytest.raises(LossInputError, match=rf"datum 7: loss_fn_inputs\['{key}'\] has a non-finite value at position 1"):
            check([1, 2, 3], {**rl_inputs(3), key: np.array([1, np.nan, 1], np.float32)}, "ppo")


def prepared(loss_fn, inputs, cfg=None, num_datums=1, **kw):
    cfg = resolve_loss_config(loss_fn, cfg or {})
    arrays = prepare_inputs(IDX, loss_fn, cfg, {k: np.asarray(v) for k, v in inputs.items()}, num_datums, **kw)
    return cfg, {k: torch.tensor(np.asarray(v), dtype=torch.float64) for k, v in arrays.items() if k != "target_tokens"}


@pytest.mark.parametrize("loss_fn", ["ppo", "cispo", "gspo"])
def test_per_row_clip_tensors_override_the_config_for_their_row(loss_fn):
    """Rows with a per-row bound use it; prepare_inputs fills the others from the config."""
    base = {"target_tokens": np.zeros(5, np.int64), "logprobs": np.array(SLP, np.float32),
            "advantages": np.array(ADV, np.float32)}
    cfg, given = prepared(loss_fn, {**base, "clip_high_threshold": np.array([1.1, 9, 9, 9, 9], np.float32)})
    np.testing.assert_allclose(given["clip_low_threshold"].numpy(), resolve_loss_config(loss_fn, {})["clip_low_threshold"])
    np.testing.assert_allclose(given["clip_high_threshold"].numpy(), np.float32([1.1, 9, 9, 9, 9]))
    with pytest.raises(LossInputError, match="datum 7: clip_low_threshold 0.8 is above clip_high_threshold 0.5 at position 2"):
        prepared(loss_fn, {**base, "clip_high_threshold": np.float32([2, 2, 0.5, 2, 2]),
                           "clip_low_threshold": np.full(5, 0.8, np.float32)})
    if loss_fn == "ppo":  # row 0: r=1.221 clipped at the row's own 1.1, not the config's 1.2
        tok = per_token_loss("ppo", cfg, t(LP), given)
        assert tok[0].item() == pytest.approx(-1.1 * ADV[0], rel=1e-6)


def gspo_reference(lp, q, adv, m, lo, hi):
    """GSPO-token written out in float64: one ratio per datum over M, value s, gradient s*dlp."""
    lp, q, adv, m = (np.asarray(x, np.float64) for x in (lp, q, adv, m))
    s = math.exp(((lp - q) * m).sum() / m.sum()) if m.sum() else 1.0
    clipped = np.clip(s, lo, hi)
    loss = -np.minimum(s * adv, clipped * adv)
    active = (s * adv <= clipped * adv) | ((s >= lo) & (s <= hi))  # the unclipped branch is taken
    return loss, np.where(active, -adv * s, 0.0), s


def test_gspo_values_gradient_and_clipping():
    """One sequence ratio s per datum from the rows in M; every row's value is s, its gradient
    s*dlp; clipped rows (s past a bound in A's favour) get no gradient."""
    adv = [0.0, 0.0, 1.0, -2.0, 0.5]
    m = [0.0, 0.0, 1.0, 1.0, 1.0]
    q = [0.0, 0.0, -0.9, -1.6, -2.6]  # placeholders on prompt rows (outside M), as rl_loop sends
    for lo, hi in ((0.8, 1.2), (0.99, 1.01), (0.1, 0.5)):
        cfg, inputs = prepared("gspo", {"target_tokens": np.zeros(5, np.int64), "logprobs": np.float32(q),
                                        "advantages": np.float32(adv), "sequence_ratio_mask": np.float32(m)},
                               {"clip_low_threshold": lo, "clip_high_threshold": hi})
        inputs["logprobs"] = t(q)  # float64 throughout for exact hand values
        tok, g = loss_and_grad("gspo", cfg, inputs)
        # the bounds travel as float32 per-row tensors
        want_loss, want_grad, s = gspo_reference(LP, q, adv, m, float(np.float32(lo)), float(np.float32(hi)))
        assert tok == pytest.approx(want_loss.tolist(), rel=1e-12, abs=1e-15)
        assert g == pytest.approx(want_grad.tolist(), rel=1e-12, abs=1e-15)
    assert s > 0.5  # the last bounds clip every row with A > 0


def test_gspo_ratio_rows_default_and_empty():
    """Without sequence_ratio_mask: the sampled provenance rows, else the rows with A != 0. An
    empty M is an error when some A != 0, and a zero (not NaN) contribution otherwise."""
    base = {"target_tokens": np.zeros(4, np.int64), "logprobs": np.float32([0, -1, -2, -3]),
            "advantages": np.float32([0, 1, 0, 1])}
    _, inputs = prepared("gspo", base)
    assert inputs["sequence_ratio_mask"].tolist() == [0, 1, 0, 1]
    _, inputs = prepared("gspo", base, sampled_rows=np.array([False, True, True, True]))
    assert inputs["sequence_ratio_mask"].tolist() == [0, 1, 1, 1]
    with pytest.raises(LossInputError, match=r"datum 7: gspo's sequence ratio has no rows .* advantages\[1\] is 1.0"):
        prepared("gspo", {**base, "sequence_ratio_mask": np.zeros(4, np.float32)})
    cfg, inputs = prepared("gspo", {**base, "advantages": np.zeros(4, np.float32)})
    lp = t([-1.0, -2.0, -0.5, -0.3], grad=True)
    tok = per_token_loss("gspo", cfg, lp, inputs)
    (g,) = torch.autograd.grad(tok.sum(), lp)
    assert tok.tolist() == [0.0] * 4 and g.tolist() == [0.0] * 4


def test_gspo_batch_is_the_sum_of_its_datums():
    """In a padded [rows, T] block each row keeps its own ratio: the block's per-token loss, gradient
    and metrics equal each datum's computed alone (to float64 rounding: a row mixed with another
    would be off by orders of magnitude more)."""
    gen = np.random.default_rng(3)
    lengths = (5, 8, 3)
    width = 8
    lp = np.zeros((3, width))
    block = {k: np.zeros((3, width)) for k in ("logprobs", "advantages", "sequence_ratio_mask",
                                                  "clip_low_threshold", "clip_high_threshold", "request_datums")}
    singles = []
    for r, n in enumerate(lengths):
        raw = {"target_tokens": np.zeros(n, np.int64), "logprobs": gen.normal(-1, 0.3, n).astype(np.float32),
               "advantages": gen.normal(0, 1, n).astype(np.float32),
               "sequence_ratio_mask": (gen.random(n) > 0.3).astype(np.float32)}
        raw["sequence_ratio_mask"][0] = 1
        cfg, one = prepared("gspo", raw, {"clip_low_threshold": 0.95, "clip_high_threshold": 1.05}, num_datums=3)
        lp[r, :n] = gen.normal(-1, 0.3, n)
        for k, v in one.items():
            block[k][r, :n] = v.numpy()
        singles.append((n, one))
    mask = torch.tensor((np.arange(width) < np.array(lengths)[:, None]).astype(np.float64))
    block_lp = torch.tensor(lp, requires_grad=True)
    tok, metrics = run_losses([("gspo", cfg, 0, 3)], block_lp, {k: torch.tensor(v) for k, v in block.items()}, mask)
    (g_block,) = torch.autograd.grad(tok.sum(), block_lp)
    ratios = []
    for r, (n, one) in enumerate(singles):
        row_lp = torch.tensor(lp[r, :n], requires_grad=True)
        out = per_token_loss("gspo", cfg, row_lp, one)
        (g,) = torch.autograd.grad(out.sum(), row_lp)
        # Not bit for bit: exp() over a [3, 8] block and over one row of n values runs through other
        # vector/scalar paths of ATen's loops, which differ in the last bit on some CPUs. The runtime
        # never needs it: a tenant's loss block has the same shape alone or co-batched.
        torch.testing.assert_close(tok[r, :n].detach(), out.detach(), rtol=1e-12, atol=1e-15)
        torch.testing.assert_close(g_block[r, :n], g, rtol=1e-12, atol=1e-15)
        m = one["sequence_ratio_mask"].numpy() != 0
        ratios.append(math.exp(np.mean(lp[r, :n][m] - one["logprobs"].numpy()[m])))
    assert metrics[0]["seq_ratio:mean"] == pytest.approx(np.mean(ratios), rel=1e-12)
    assert 0 <= metrics[0]["seq_clipped_frac:mean"] <= 1 + 1e-12


def sr_inputs(n_prompt: int, adv: list[float], q: list[float], datum_lp: list[float] | None = None):
    n = n_prompt + len(adv)
    inputs = {"target_tokens": np.zeros(n, np.int64), "advantages": np.float32([0.0] * n_prompt + adv)}
    if datum_lp is not None:
        inputs["logprobs"] = np.float32([0.0] * n_prompt + datum_lp)
    sampled = np.arange(n) >= n_prompt
    recorded = np.float32([0.0] * n_prompt + q)
    return inputs, sampled, recorded


def test_stable_reinforce_values_gradient_and_metrics():
    """Version 0: on sampled rows, -A*l + kl_coeff/2*(l - q)^2 with q the RECORDED logprob (the
    datum's own logprobs only feed the mismatch metric); prompt rows contribute nothing."""
    beta = 0.3
    lp_vals = [-0.7, -1.0, -2.0, -0.5, -0.3]
    adv, q = [1.0, -2.0, 0.5], [-0.375, -0.875, -0.25]  # exact in float32, as records are
    inputs, sampled, recorded = sr_inputs(2, adv, q, datum_lp=[-0.5, -0.875, -0.25])
    cfg, arrays = prepared("stable_reinforce", inputs, {"kl_coeff": beta}, num_datums=2,
                           sampled_rows=sampled, recorded_logprobs=recorded)
    assert "logprobs" not in arrays  # never the client's copy
    lp = t(lp_vals, grad=True)
    out = run_losses([("stable_reinforce", cfg, 0, 1)], lp[None], {k: v[None] for k, v in arrays.items()},
                     torch.ones(1, 5, dtype=torch.float64))
    tok, metrics = out[0][0], out[1][0]
    (g,) = torch.autograd.grad(tok.sum(), lp)
    l_s = lp_vals[2:]
    want = [0.0, 0.0] + [-a * l + 0.5 * beta * (l - qq) ** 2 for a, l, qq in zip(adv, l_s, q)]
    assert tok.tolist() == pytest.approx(want, rel=1e-12)
    assert g.tolist() == pytest.approx([0.0, 0.0] + [-a + beta * (l - qq) for a, l, qq in zip(adv, l_s, q)], rel=1e-12)
    assert metrics["pg_loss:sum"] == pytest.approx(sum(-a * l for a, l in zip(adv, l_s)), rel=1e-12)
    assert metrics["kl_penalty:sum"] == pytest.approx(sum(0.5 * beta * (l - qq) ** 2 for l, qq in zip(l_s, q)), rel=1e-12)
    assert metrics["sampled_tokens:sum"] == 3
    # a mean over datums: this datum is one of the request's two
    assert metrics["sampler_trainer_logprob_diff:mean"] == pytest.approx(np.mean(np.subtract(q, l_s)) / 2, rel=1e-12)
    assert metrics["datum_logprobs_mismatch:max"] == 0.125


def test_metrics_merge_across_micro_batches():
    """A request split over micro-batches gets sums added, maxima maxed and means (pre-divided by
    the request's datum count) added up to the mean."""
    total: dict[str, float] = {}
    merge_metrics(total, {"loss:sum": 1.0, "x:mean": 0.25, "m:max": 3.0})
    merge_metrics(total, {"loss:sum": 2.0, "x:mean": 0.5, "m:max": 1.0})
    assert total == {"loss:sum": 3.0, "x:mean": 0.75, "m:max": 3.0}


# ---------------------------------------------------------------------------------------------
# One registration per loss
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("loss_fn", sorted(LOSSES))
def test_each_entry_hands_the_trainer_its_required_and_derived_inputs(loss_fn):
    """What prepare_inputs returns is exactly what the entry names: the trainer pads those keys."""
    inputs, sampled, recorded = sr_inputs(1, [1.0, 0.5], [-0.5, -0.25], datum_lp=[-0.5, -0.25])
    inputs["weights"] = np.ones(3, np.float32)
    cfg = resolve_loss_config(loss_fn, {"beta": 0.1} if loss_fn == "dro" else {})
    arrays = prepare_inputs(IDX, loss_fn, cfg, inputs, 2, sampled_rows=sampled, recorded_logprobs=recorded)
    loss = LOSSES[loss_fn]
    assert set(arrays) == {*loss.required_inputs, *loss.inputs}


def test_a_plain_loss_is_one_entry(monkeypatch):
    """Registering a Loss entry is all a plain loss needs: its config is resolved and checked, its
    inputs validated, and run_losses computes it."""
    def check_scale(config):
        if config["scale"] <= 0:
            raise LossInputError("scale must be > 0")

    scaled = Loss("scaled_ce", lambda lp, inputs, config: LossOut(-config["scale"] * lp * inputs["weights"]),
                  ("target_tokens", "weights"), {"scale": 2.0}, check_scale)
    monkeypatch.setitem(LOSSES, "scaled_ce", scaled)
    with pytest.raises(LossInputError, match="scale must be > 0"):
        resolve_loss_config("scaled_ce", {"scale": -1.0})
    with pytest.raises(LossInputError, match=r"datum 7: loss 'scaled_ce' needs loss_fn_inputs\['weights'\]"):
        check([1, 2], {"target_tokens": np.zeros(2, np.int64)}, "scaled_ce")
    cfg, arrays = prepared("scaled_ce", {"target_tokens": np.zeros(2, np.int64), "weights": np.float32([1, 0.5])})
    tok, _ = run_losses([("scaled_ce", cfg, 0, 1)], t([-1.0, -2.0])[None], {k: v[None] for k, v in arrays.items()},
                        torch.ones(1, 2, dtype=torch.float64))
    assert tok[0].tolist() == [2.0, 2.0]


def valid_inputs(loss: Loss, n: int) -> dict[str, np.ndarray]:
    """A datum of `n` tokens with every input `loss` declares, each a valid value."""
    return {key: np.arange(n, dtype=np.int64) % V if key == "target_tokens" else np.full(n, 0.5, np.float32)
            for key in loss.user_inputs}


@pytest.mark.parametrize("loss_fn, key", [(name, key) for name, loss in sorted(LOSSES.items())
                                          for key in loss.user_inputs if key != "target_tokens"])
def test_every_float_input_a_loss_declares_is_checked_for_shape_and_finiteness(loss_fn, key):
    """Validation reads a loss's inputs from its entry (`required_inputs`, `optional_inputs`): no
    separate list to keep in step, so no input of any loss reaches the trainer unchecked (a wrong
    shape would be broadcast over the row)."""
    inputs = valid_inputs(LOSSES[loss_fn], 3)
    check([1, 2, 3], inputs, loss_fn)
    with pytest.raises(LossInputError, match=rf"datum 7: loss_fn_inputs\['{key}'\] has shape \[1\], expected \[3\]"):
        check([1, 2, 3], {**inputs, key: np.ones(1, np.float32)}, loss_fn)
    with pytest.raises(LossInputError, match=rf"datum 7: loss_fn_inputs\['{key}'\] has a non-finite value at position 2"):
        check([1, 2, 3], {**inputs, key: np.float32([0.5, 0.5, np.nan])}, loss_fn)


def test_a_new_loss_input_is_validated_by_its_declaration_alone(monkeypatch):
    """A loss with a float input of a new name (required or optional) needs no other list: the
    entry's declaration makes validation check its shape and finiteness."""
    def baseline_ce(lp, inputs, config):
        return LossOut(-(lp - inputs["baseline"]) * inputs["weights"] * inputs.get("scale", 1.0))

    entry = Loss("baseline_ce", baseline_ce, ("target_tokens", "weights", "baseline"), optional_inputs=("scale",))
    monkeypatch.setitem(LOSSES, "baseline_ce", entry)
    good = valid_inputs(entry, 3)
    check([1, 2, 3], good, "baseline_ce")
    for key in ("baseline", "scale"):
        with pytest.raises(LossInputError, match=rf"loss_fn_inputs\['{key}'\] has shape \[\], expected \[3\]"):
            check([1, 2, 3], {**good, key: np.float32(1.0)}, "baseline_ce")
        with pytest.raises(LossInputError, match=rf"loss_fn_inputs\['{key}'\] has a non-finite value at position 0"):
            check([1, 2, 3], {**good, key: np.float32([np.inf, 0, 0])}, "baseline_ce")
