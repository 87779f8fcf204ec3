"""Sampling through the real SDK (issue 4: parity, snapshots, every SamplingParams field, RL)."""

from __future__ import annotations

import math

import numpy as np
import pytest
import tinker
from tinker import types

from helpers import BASE_MODEL, logprobs_of, sft_batch, sft_datum

pytestmark = pytest.mark.e2e
PROMPT = [11, 12, 13, 14, 15, 16]
IM_END = 1017  # the embedded tokenizer's <|im_end|> (its EOS)


def prompt(tokens=PROMPT) -> types.ModelInput:
    return types.ModelInput.from_ints(tokens)


def greedy(n: int = 8, **kw) -> types.SamplingParams:
    return types.SamplingParams(max_tokens=n, temperature=0.0, **kw)


def sample(client, params, num_samples=1, tokens=PROMPT, **kw):
    return client.sample(prompt(tokens), num_samples=num_samples, sampling_params=params, **kw).result()


@pytest.fixture(scope="module")
def trained(server):
    """A model trained away from the base, plus a sampling client on its current weights."""
    with server.client("tml-sampling") as sc:
        tc = sc.create_lora_training_client(base_model=BASE_MODEL, rank=8, seed=2).result()
        for _ in range(4):
            tc.forward_backward(sft_batch(4, seed=9), "cross_entropy").result()
            tc.optim_step(types.AdamParams(learning_rate=2e-2)).result()
        yield sc, tc


def test_sampled_and_computed_logprobs_equal_training_logprobs(trained):
    sc, tc = trained
    sampler = tc.save_weights_and_get_sampling_client().result()
    out = sample(sampler, types.SamplingParams(max_tokens=10, temperature=1.0, seed=4), num_samples=3)
    assert len(out.sequences) == 3
    for seq in out.sequences:
        full = PROMPT + list(seq.tokens)
        train_lp = logprobs_of(tc.forward([sft_datum(full)], "cross_entropy").result())[0]
        np.testing.assert_allclose(seq.logprobs, train_lp[len(PROMPT) - 1:], atol=2e-5, rtol=0)
        computed = sampler.compute_logprobs(prompt(full)).result()
        assert computed[0] is None
        np.testing.assert_allclose(computed[1:], train_lp, atol=2e-5, rtol=0)


def test_untrained_adapter_samples_exactly_like_the_base_model(server):
    with server.client("tml-sampling") as sc:
        tc = sc.create_lora_training_client(base_model=BASE_MODEL, rank=8).result()
        fresh = tc.save_weights_and_get_sampling_client().result()
        base = sc.create_sampling_client(base_model=BASE_MODEL).result()
        a = sample(fresh, types.SamplingParams(max_tokens=12, seed=1), include_prompt_logprobs=True)
        b = sample(base, types.SamplingParams(max_tokens=12, seed=1), include_prompt_logprobs=True)
        assert a.sequences[0].tokens == b.sequences[0].tokens
        assert a.sequences[0].logprobs == b.sequences[0].logprobs
        assert a.prompt_logprobs == b.prompt_logprobs


def test_sampling_client_is_a_snapshot(trained):
    sc, tc = trained
    at_k = tc.save_weights_and_get_sampling_client().result()
    named_path = tc.save_weights_for_sampler("snapshot-k").result().path
    by_path = sc.create_sampling_client(model_path=named_path).result()
    before = sample(at_k, greedy(12)).sequences[0]
    for _ in range(3):  # train on, hard, towards something else
        tc.forward_backward([sft_datum(PROMPT + [900] * 12)], "cross_entropy").result()
        tc.optim_step(types.AdamParams(learning_rate=5e-2)).result()
    now = tc.save_weights_and_get_sampling_client().result()
    assert sample(now, greedy(12)).sequences[0].tokens != before.tokens  # the model did move
    for client in (at_k, by_path):
        again = sample(client, greedy(12)).sequences[0]
        assert again.tokens == before.tokens and again.logprobs == before.logprobs


# -- every SamplingParams field ------------------------------------------------------------------------

@pytest.fixture(scope="module")
def base(server):
    with server.client("tml-sampling") as sc:
        yield sc.create_sampling_client(base_model=BASE_MODEL).result()


def test_max_tokens_and_length_stop_reason(base):
    for n in (1, 5):
        seq = sample(base, types.SamplingParams(max_tokens=n, stop=[])).sequences[0]
        assert len(seq.tokens) == n and seq.stop_reason == "length" and len(seq.logprobs) == n


def test_temperature_zero_is_greedy_and_temperature_matters(base):
    a, b = sample(base, greedy(10)), sample(base, greedy(10))
    assert a.sequences[0].tokens == b.sequences[0].tokens
    lp = a.sequences[0].logprobs
    # each greedy token is the argmax: its logprob is the top-1 alternative's
    top = sample(base, greedy(10), topk_sample_logprobs=3)
    assert [row[0][0] for row in top.sequences[0].topk_logprobs] == a.sequences[0].tokens
    assert lp == [row[0][1] for row in top.sequences[0].topk_logprobs]
    hot = sample(base, types.SamplingParams(max_tokens=10, temperature=1.5, seed=1), num_samples=4)
    assert any(s.tokens != a.sequences[0].tokens for s in hot.sequences)


def test_top_k_and_top_p(base):
    g = sample(base, greedy(10)).sequences[0].tokens
    assert sample(base, types.SamplingParams(max_tokens=10, top_k=1, seed=5)).sequences[0].tokens == g
    assert sample(base, types.SamplingParams(max_tokens=10, top_p=1e-6, seed=5)).sequences[0].tokens == g
    # top_k=3: every sampled token is among the 3 most likely
    out = sample(base, types.SamplingParams(max_tokens=10, top_k=3, temperature=2.0, seed=7), num_samples=3,
                 topk_sample_logprobs=3)
    for s in out.sequences:
        for tok, alts in zip(s.tokens, s.topk_logprobs):
            assert tok in [t for t, _ in alts]
    free = sample(base, types.SamplingParams(max_tokens=10, temperature=2.0, seed=7), num_samples=3,
                  topk_sample_logprobs=3)
    assert any(tok not in [t for t, _ in alts] for s in free.sequences for tok, alts in zip(s.tokens, s.topk_logprobs))


def test_seed(base):
    p = types.SamplingParams(max_tokens=12, temperature=1.0, seed=1234)
    a, b = sample(base, p, num_samples=2), sample(base, p, num_samples=2)
    assert [s.tokens for s in a.sequences] == [s.tokens for s in b.sequences]
    assert a.sequences[0].tokens != a.sequences[1].tokens  # each sample its own stream
    c = sample(base, types.SamplingParams(max_tokens=12, temperature=1.0, seed=4321), num_samples=2)
    assert [s.tokens for s in c.sequences] != [s.tokens for s in a.sequences]


def test_a_seeded_request_samples_the_same_alone_and_among_32_others(base):
    """Each row draws from its own seeded stream (sampling/pick.py), not a generator the batch
    shares: 32 concurrent requests with other prompts and settings do not change its tokens."""
    p = types.SamplingParams(max_tokens=12, temperature=1.0, seed=99)
    alone = sample(base, p).sequences[0].tokens
    settings = [types.SamplingParams(max_tokens=12, temperature=0.5 + i / 32, top_k=i % 4 or -1, seed=i)
                for i in range(32)]
    others = [base.sample(prompt([11 + i, 12, 13][: 1 + i % 3]), num_samples=1 + i % 2, sampling_params=s)
              for i, s in enumerate(settings)]
    crowded = base.sample(prompt(), num_samples=1, sampling_params=p)
    assert crowded.result().sequences[0].tokens == alone
    assert all(len(f.result().sequences[0].tokens) == 12 for f in others)


def test_stop_token_ids_and_strings(server, base):
    g = sample(base, greedy(10, stop=[])).sequences[0].tokens
    cut = sample(base, greedy(10, stop=[g[3]])).sequences[0]
    assert cut.tokens == g[: g.index(g[3]) + 1] and cut.stop_reason == "stop"
    from transformers import AutoTokenizer

    from helpers import model_dir

    tok = AutoTokenizer.from_pretrained(str(model_dir(server)))
    text = tok.decode(g)
    needle = tok.decode(g[4:6])
    assert needle and needle in text
    s = sample(base, greedy(10, stop=[needle])).sequences[0]
    assert s.stop_reason == "stop" and needle in tok.decode(s.tokens) and len(s.tokens) <= 6
    assert needle not in tok.decode(s.tokens[:-1])
    single = sample(base, greedy(10, stop=needle)).sequences[0]  # a bare string works too
    assert single.tokens == s.tokens


def test_eos_stops_by_default_and_empty_stop_disables_it(server):
    with server.client("tml-sampling") as sc:
        tc = sc.create_lora_training_client(base_model=BASE_MODEL, rank=8).result()
        for _ in range(15):  # teach it to end right after the prompt
            tc.forward_backward([sft_datum(PROMPT + [IM_END])], "cross_entropy").result()
            tc.optim_step(types.AdamParams(learning_rate=5e-2)).result()
        client = tc.save_weights_and_get_sampling_client().result()
        eos = sample(client, greedy(8)).sequences[0]
        assert eos.tokens == [IM_END] and eos.stop_reason == "stop"
        no_stop = sample(client, greedy(8, stop=[])).sequences[0]
        assert len(no_stop.tokens) == 8 and no_stop.stop_reason == "length" and no_stop.tokens[0] == IM_END


def test_prompt_logprobs_topk_last_n_and_sequence_ids(base):
    out = sample(base, greedy(2), num_samples=3, include_prompt_logprobs=True, topk_prompt_logprobs=4)
    assert len(out.sequences) == 3
    assert len({s.sequence_id for s in out.sequences}) == 3 and all(s.sequence_id for s in out.sequences)
    lp = out.prompt_logprobs
    assert len(lp) == len(PROMPT) and lp[0] is None and all(math.isfinite(x) for x in lp[1:])
    topk = out.topk_prompt_logprobs
    assert topk[0] is None or topk[0] == [] or all(v <= -9999 for _, v in topk[0])
    for i in range(1, len(PROMPT)):
        values = [v for _, v in topk[i]]
        assert values == sorted(values, reverse=True) and values[0] >= lp[i] - 1e-6
        if PROMPT[i] in [t for t, _ in topk[i]]:
            assert dict(topk[i])[PROMPT[i]] == pytest.approx(lp[i], abs=1e-6)
    last = sample(base, greedy(1), include_prompt_logprobs=True, prompt_logprobs_last_n=2)
    assert last.prompt_logprobs[:-2] == [None] * (len(PROMPT) - 2)
    assert last.prompt_logprobs[-2:] == pytest.approx(lp[-2:], abs=1e-6)


def test_bad_sampling_requests_are_clear_400s(server, base):
    with pytest.raises(tinker.BadRequestError, match="outside the vocabulary"):
        sample(base, greedy(2), tokens=[5, 10 ** 7])
    with pytest.raises(tinker.BadRequestError, match="context"):
        sample(base, types.SamplingParams(max_tokens=10 ** 6))
    # (record_stability_info is served now: see test_stable_reinforce_e2e.py)
    assert sample(base, greedy(3)).sequences[0].stop_reason in ("stop", "length")  # still serving


# -- RL end to end ---------------------------------------------------------------------------------------

def test_rl_loop_raises_reward(server):
    """sample -> reward -> importance_sampling -> optim: learn to emit chosen tokens (ids < 128)."""
    with server.client("tml-rl") as sc:
        tc = sc.create_lora_training_client(base_model=BASE_MODEL, rank=16, seed=0).result()
        rewards = []
        for _ in range(30):
            client = tc.save_weights_and_get_sampling_client().result()
            out = sample(client, types.SamplingParams(max_tokens=4, temperature=1.0, stop=[]), num_samples=16)
            r = np.array([sum(t < 128 for t in s.tokens) / 4 for s in out.sequences])
            rewards.append(float(r.mean()))
            adv = r - r.mean()
            data = []
            for s, a in zip(out.sequences, adv):
                full = PROMPT + list(s.tokens)
                n_prompt = len(PROMPT) - 1
                data.append(types.Datum(
                    model_input=types.ModelInput.from_ints(full[:-1]),
                    loss_fn_inputs={"target_tokens": full[1:],
                                    "logprobs": [0.0] * n_prompt + list(s.logprobs),
                                    "advantages": [0.0] * n_prompt + [float(a)] * len(s.tokens)}))
            if np.any(adv != 0):
                tc.forward_backward(data, "importance_sampling").result()
                tc.optim_step(types.AdamParams(learning_rate=3e-2)).result()
        first, last = np.mean(rewards[:5]), np.mean(rewards[-5:])
        assert last > first + 0.25, rewards  # from ~0.125 (chance) to well above
