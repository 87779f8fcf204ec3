"""The OpenAI-compatible endpoints through the unchanged `openai` SDK: base model and a trained adapter."""

from __future__ import annotations

import math

import httpx
import numpy as np
import openai
import pytest
from tinker import types
from transformers import AutoTokenizer

from helpers import API_KEY, BASE_MODEL, model_dir, sft_datum

pytestmark = pytest.mark.e2e

CHAT = [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "Tell me about the river."}]
CHAT_TARGET = "The quick brown fox jumps over the lazy dog."
COMPLETION_PROMPT = "Once upon a time"
COMPLETION_TARGET = " there was a small green garden near the sea."


@pytest.fixture(scope="module")
def oai(server):
    with openai.OpenAI(base_url=server.base_url + "/v1", api_key=API_KEY, max_retries=0) as client:
        yield client


@pytest.fixture(scope="module")
def tok(server):
    return AutoTokenizer.from_pretrained(model_dir(server))


def chat_prompt(tok, messages=CHAT) -> list[int]:
    return tok.encode(tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=False),
                      add_special_tokens=False)


@pytest.fixture(scope="module")
def adapter(server, tok):
    """An adapter trained hard on one chat answer and one continuation, saved for sampling."""
    with server.client(API_KEY) as sc:
        tc = sc.create_lora_training_client(base_model=BASE_MODEL, rank=16, seed=0).result()
        data = []
        for prompt, target in ((chat_prompt(tok), tok.encode(CHAT_TARGET) + [tok.eos_token_id]),
                               (tok.encode(COMPLETION_PROMPT), tok.encode(COMPLETION_TARGET))):
            data.append(sft_datum(prompt + target, [0.0] * (len(prompt) - 1) + [1.0] * len(target)))
        for _ in range(45):  # greedy answers are the targets from about step 30 on
            tc.forward_backward(data, "cross_entropy")
            tc.optim_step(types.AdamParams(learning_rate=5e-3)).result()
        path = tc.save_weights_for_sampler("openai-adapter").result().path
        yield {"path": path, "model_id": tc.model_id, "sampler": sc.create_sampling_client(model_path=path).result()}


def chat(oai, model, **kw):
    kw.setdefault("messages", CHAT)
    kw.setdefault("max_tokens", 16)
    return oai.chat.completions.create(model=model, **kw)


def complete(oai, model, **kw):
    kw.setdefault("prompt", COMPLETION_PROMPT)
    kw.setdefault("max_tokens", 16)
    return oai.completions.create(model=model, **kw)


def streamed(stream) -> tuple[dict[int, str], dict[int, str], list]:
    """-> (text per choice, finish_reason per choice, logprob entries per choice) of a stream."""
    texts: dict[int, str] = {}
    reasons: dict[int, str] = {}
    lps: dict[int, list] = {}
    for chunk in stream:
        for c in chunk.choices:
            piece = c.delta.content if hasattr(c, "delta") else c.text
            texts[c.index] = texts.get(c.index, "") + (piece or "")
            if c.finish_reason:
                reasons[c.index] = c.finish_reason
            if c.logprobs is not None:
                entries = c.logprobs.content if hasattr(c, "delta") else c.logprobs.tokens
                lps.setdefault(c.index, []).extend(entries or [])
    return texts, reasons, lps


def test_base_model_chat_and_completion(oai):
    r = chat(oai, BASE_MODEL, temperature=0)
    assert r.object == "chat.completion" and r.model == BASE_MODEL and len(r.choices) == 1
    text = r.choices[0].message.content
    assert r.choices[0].message.role == "assistant" and text and r.choices[0].finish_reason in ("stop", "length")
    assert r.usage.prompt_tokens > 0 and 0 < r.usage.completion_tokens <= 16
    texts, reasons, _ = streamed(chat(oai, BASE_MODEL, temperature=0, stream=True))
    assert texts == {0: text} and reasons == {0: r.choices[0].finish_reason}
    assert chat(oai, BASE_MODEL, temperature=1e-30).choices[0].message.content == text  # no inf/NaN: greedy

    c = complete(oai, BASE_MODEL, temperature=0)
    assert c.object == "text_completion" and c.choices[0].text
    texts, _, _ = streamed(complete(oai, BASE_MODEL, temperature=0, stream=True))
    assert texts == {0: c.choices[0].text}

    # a stop string ends the answer before it, streamed or not
    stop = text[len(text) // 2:len(text) // 2 + 3]
    cut = chat(oai, BASE_MODEL, temperature=0, stop=[stop, "never-appears"])
    assert cut.choices[0].message.content == text[:text.index(stop)]
    assert cut.choices[0].finish_reason == "stop"
    texts, reasons, _ = streamed(chat(oai, BASE_MODEL, temperature=0, stop=[stop, "never-appears"], stream=True))
    assert texts == {0: text[:text.index(stop)]} and reasons == {0: "stop"}

    # n choices, reproducible with a seed; usage in the last chunk when asked
    r3 = chat(oai, BASE_MODEL, n=3, temperature=1.0, seed=7)
    assert [c.index for c in r3.choices] == [0, 1, 2] and len({c.message.content for c in r3.choices}) > 1
    again = chat(oai, BASE_MODEL, n=3, temperature=1.0, seed=7)
    assert [c.message.content for c in again.choices] == [c.message.content for c in r3.choices]
    chunks = list(complete(oai, BASE_MODEL, n=2, temperature=1.0, top_p=0.9, seed=3, stream=True,
                           stream_options={"include_usage": True}))
    texts, _, _ = streamed(chunks)
    plain = complete(oai, BASE_MODEL, n=2, temperature=1.0, top_p=0.9, seed=3)
    assert texts == {c.index: c.text for c in plain.choices}
    assert chunks[-1].choices == [] and chunks[-1].usage == plain.usage

    # a client that leaves mid-stream: its job is cancelled (test_edge_limits.py), others are answered as before
    with chat(oai, BASE_MODEL, max_tokens=48, stream=True) as stream:
        next(iter(stream))
    assert chat(oai, BASE_MODEL, temperature=0).choices[0].message.content == text


def test_choice_text_matches_decode(tok):
    """Token by token, held back and cut at stop strings, the pieces join into the decoded text."""
    from hosted_tinker.api.openai_compat.text import ChoiceText

    rng = np.random.default_rng(0)
    multibyte = tok.encode("héllo wörld — 你好 🙂 naïve")
    for trial in range(40):
        ids = rng.integers(0, len(tok), int(rng.integers(1, 30))).tolist()
        if trial % 2:
            ids = multibyte[:int(rng.integers(1, len(multibyte) + 1))] + ids[:5]
        full = tok.decode(ids, skip_special_tokens=True)
        stop = full[int(rng.integers(0, max(1, len(full) - 2))):][:int(rng.integers(1, 4))] if trial % 3 else ""
        stops = (stop, "never") if stop else ()
        c = ChoiceText(tok, tok.encode("Hi"), stops, frozenset())
        pieces, released = [], 0
        for k, t in enumerate(ids):
            text, a, b = c.feed(t, -1.0, None, None, "length" if k == len(ids) - 1 else None)
            assert a == released and b >= a
            pieces.append(text)
            released = b
        want = full[:full.find(stop)] if stop and stop in full else full
        assert "".join(pieces) == want, (ids, stop)
        assert c.finish_reason == ("stop" if stop and stop in full else "length")
        assert released == (len(ids) if c.finish_reason == "length" else
                            sum(1 for o in c.offsets if o < len(want)))


def test_logprobs_equal_compute_logprobs(oai, service_client, tok, adapter):
    base_sampler = service_client.create_sampling_client(base_model=BASE_MODEL).result()
    prompt = chat_prompt(tok)
    for model, sampler in ((BASE_MODEL, base_sampler), (adapter["path"], adapter["sampler"])):
        r = chat(oai, model, temperature=0.8, seed=1, logprobs=True, top_logprobs=3,
                 extra_body={"return_tokens_as_token_ids": True})
        content = r.choices[0].logprobs.content
        ids = [int(e.token.removeprefix("token_id:")) for e in content]
        got = np.array([e.logprob for e in content])
        assert len(ids) > 0 and np.isfinite(got).all()
        for e in content:
            assert len(e.top_logprobs) == 3 and e.logprob <= e.top_logprobs[0].logprob + 1e-6
        want = sampler.compute_logprobs(types.ModelInput.from_ints(prompt + ids)).result()[len(prompt):]
        np.testing.assert_allclose(got, want, atol=1e-5, rtol=0)

        c = complete(oai, model, prompt=tok.encode(COMPLETION_PROMPT), temperature=0.8, seed=2, logprobs=2,
                     extra_body={"return_tokens_as_token_ids": True})
        lp = c.choices[0].logprobs
        ids = [int(t.removeprefix("token_id:")) for t in lp.tokens]
        assert all(len(top) in (2, 3) for top in lp.top_logprobs)
        ptoks = tok.encode(COMPLETION_PROMPT)
        want = sampler.compute_logprobs(types.ModelInput.from_ints(ptoks + ids)).result()[len(ptoks):]
        np.testing.assert_allclose(lp.token_logprobs, want, atol=1e-5, rtol=0)
        # streamed logprobs are the same entries
        _, _, lps = streamed(chat(oai, model, temperature=0.8, seed=1, logprobs=True, top_logprobs=3, stream=True,
                                  extra_body={"return_tokens_as_token_ids": True}))
        assert [(e.token, e.logprob) for e in lps[0]] == [(e.token, e.logprob) for e in content]


def test_trained_adapter_answers_differently(oai, adapter):
    path, model_id = adapter["path"], adapter["model_id"]
    base_chat = chat(oai, BASE_MODEL, temperature=0, max_tokens=24).choices[0].message.content
    ad = chat(oai, path, temperature=0, max_tokens=24)
    assert ad.model == path
    ad_chat = ad.choices[0].message.content
    assert ad_chat != base_chat
    assert ad_chat == CHAT_TARGET and ad.choices[0].finish_reason == "stop"  # it learned the answer, then EOS
    by_id = chat(oai, model_id, temperature=0, max_tokens=24)  # the training model id: its latest sampler save
    assert by_id.choices[0].message.content == ad_chat
    texts, reasons, _ = streamed(chat(oai, path, temperature=0, max_tokens=24, stream=True))
    assert texts == {0: ad_chat} and reasons == {0: "stop"}

    base_c = complete(oai, BASE_MODEL, temperature=0).choices[0].text
    ad_c = complete(oai, path, temperature=0).choices[0].text
    assert ad_c != base_c and ad_c.startswith(COMPLETION_TARGET)
    texts, _, _ = streamed(complete(oai, model_id, temperature=0, stream=True))
    assert texts == {0: ad_c}

    ids = [m.id for m in oai.models.list().data]
    assert ids[0] == BASE_MODEL and path in ids


def test_auth_unknown_models_and_bad_params(server, oai, tok):
    url = server.base_url + "/v1"
    assert httpx.get(f"{url}/models").status_code == 401
    assert httpx.get(f"{url}/models", headers={"X-API-Key": API_KEY}).status_code == 200
    with openai.OpenAI(base_url=url, api_key="sk-not-tinker", max_retries=0) as wrong, \
            pytest.raises(openai.AuthenticationError, match="tml-"):
        wrong.models.list()
    with pytest.raises(openai.NotFoundError, match="no-such-model"):  # the reason reaches the SDK's message
        chat(oai, "no-such-model")
    with pytest.raises(openai.NotFoundError):
        complete(oai, "tinker://nobody:train:0/sampler_weights/missing")
    # another user's adapter is not found either
    with openai.OpenAI(base_url=url, api_key="tml-someone-else", max_retries=0) as other:
        paths = [m.id for m in oai.models.list().data[1:]]
        for p in paths[:1]:
            with pytest.raises(openai.NotFoundError):
                chat(other, p)
        assert [m.id for m in other.models.list().data] == [BASE_MODEL]

    too_long = [5] * 4097
    bad = [
        lambda: chat(oai, BASE_MODEL, n=0),
        lambda: chat(oai, BASE_MODEL, temperature=5),
        lambda: chat(oai, BASE_MODEL, top_p=0),
        lambda: chat(oai, BASE_MODEL, messages=[]),
        lambda: chat(oai, BASE_MODEL, messages=[{"role": "wizard", "content": "hi"}]),
        lambda: chat(oai, BASE_MODEL, top_logprobs=3),  # needs logprobs=True
        lambda: chat(oai, BASE_MODEL, stop=[""]),
        lambda: chat(oai, BASE_MODEL, max_tokens=10**6),
        lambda: complete(oai, BASE_MODEL, prompt=too_long),
        lambda: complete(oai, BASE_MODEL, prompt=[10**7]),
        lambda: complete(oai, BASE_MODEL, prompt=""),
        lambda: complete(oai, BASE_MODEL, logprobs=99),
        lambda: complete(oai, BASE_MODEL, prompt={"not": "a prompt"}),
        lambda: complete(oai, "tinker://bad-path"),
        lambda: complete(oai, BASE_MODEL, extra_body={"n": "many"}),
    ]
    for i, call in enumerate(bad):
        with pytest.raises(openai.BadRequestError):
            call()
            pytest.fail(f"bad request {i} was accepted")
    assert httpx.post(f"{url}/completions", content=b"{not json", headers={"X-API-Key": API_KEY}).status_code == 400
    assert math.isfinite(chat(oai, BASE_MODEL, max_tokens=1).usage.total_tokens)  # the server is still fine


def test_a_run_id_samples_the_runs_current_weights(server, tok):
    """`model=<training run id>` samples the run's weights as of its last optim_step, with no
    sampler save needed: before its first step the base model's answer (a fresh LoRA adds
    nothing), after some steps the answer a sampler saved at that moment gives, and after one
    more step a different one."""
    key = "tml-current-weights"
    prompt = tok.encode(COMPLETION_PROMPT)
    with server.client(key) as sc, \
            openai.OpenAI(base_url=server.base_url + "/v1", api_key=key, max_retries=0) as oai:
        def greedy_v1(model: str) -> tuple[list[int], list[float]]:
            c = complete(oai, model, prompt=prompt, max_tokens=8, temperature=0, logprobs=1,
                         extra_body={"return_tokens_as_token_ids": True, "ignore_eos": True})
            lp = c.choices[0].logprobs
            return [int(t.removeprefix("token_id:")) for t in lp.tokens], lp.token_logprobs

        tc = sc.create_lora_training_client(base_model=BASE_MODEL, rank=8, seed=7).result()
        fresh, base = greedy_v1(tc.model_id), greedy_v1(BASE_MODEL)
        assert fresh[0] == base[0]
        np.testing.assert_allclose(fresh[1], base[1], atol=2e-5, rtol=0)

        target = prompt + tok.encode(COMPLETION_TARGET)
        datum = sft_datum(target, [0.0] * (len(prompt) - 1) + [1.0] * (len(target) - len(prompt)))
        for _ in range(3):
            tc.forward_backward([datum], "cross_entropy")
            tc.optim_step(types.AdamParams(learning_rate=1e-2)).result()
        trained = greedy_v1(tc.model_id)  # no sampler save exists yet
        sampler = sc.create_sampling_client(model_path=tc.save_weights_for_sampler("now").result().path).result()
        saved = sampler.sample(types.ModelInput.from_ints(prompt), 1,
                               types.SamplingParams(max_tokens=8, temperature=0.0, stop=[])).result().sequences[0]
        assert trained[0] == saved.tokens
        np.testing.assert_allclose(trained[1], saved.logprobs, atol=2e-5, rtol=0)
        assert np.abs(np.asarray(trained[1]) - np.asarray(base[1])).max() > 1e-3  # training moved it

        tc.forward_backward([datum], "cross_entropy")
        tc.optim_step(types.AdamParams(learning_rate=1e-2)).result()
        stepped = greedy_v1(tc.model_id)
        assert np.abs(np.asarray(stepped[1]) - np.asarray(trained[1])).max() > 1e-3
