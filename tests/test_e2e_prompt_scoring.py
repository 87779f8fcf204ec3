"""`target_prompt_logprobs` and `prompt_alt_tokens_k` through the real SDK on the built-in sampler
(issue 27), checked against a plain forward of the same model here (log_softmax at every prompt
position: row i predicts prompt[i + 1]). The vLLM sidecar's are in test_vllm_server.py.
"""

from __future__ import annotations

import numpy as np
import pytest
import tinker
import torch
from tinker import types
from transformers import AutoModelForCausalLM

from helpers import BASE_MODEL, model_dir
from hosted_tinker.sampling.jobs import SampleJob
from hosted_tinker.services.sampling import requested_tokens

pytestmark = pytest.mark.e2e
PROMPT = [11, 12, 13, 14, 15, 16, 300, 41]
ROWS = len(PROMPT) - 1


@pytest.fixture(scope="module")
def base(server):
    with server.client("tml-prompt-scoring") as sc:
        yield sc.create_sampling_client(base_model=BASE_MODEL).result()


@pytest.fixture(scope="module")
def reference(server) -> np.ndarray:
    """log_softmax of a plain forward: [ROWS, vocab], row i predicting PROMPT[i + 1]."""
    model = AutoModelForCausalLM.from_pretrained(str(model_dir(server)), dtype=torch.float32)
    with torch.no_grad():
        logits = model(torch.tensor([PROMPT])).logits[0, :-1]
    return torch.log_softmax(logits, dim=-1).numpy()


def sample(client, temperature=0.0, seed=None, **kw):
    params = types.SamplingParams(max_tokens=1, temperature=temperature, seed=seed)
    return client.sample(types.ModelInput.from_ints(PROMPT), num_samples=1, sampling_params=params, **kw).result()


def expected_scores(reference: np.ndarray, ids: np.ndarray) -> np.ndarray:
    rows = np.arange(ROWS)[:, None]
    return np.where(ids >= 0, reference[rows, np.maximum(ids, 0)], 0.0)


def test_dense_target_prompt_logprobs_equal_the_forward(base, reference):
    ids = np.random.default_rng(0).integers(0, reference.shape[1], (ROWS, 3))
    ids[2, 1:] = -1
    ids[:, 0] = PROMPT[1:]  # the prompt's own tokens: what prompt_logprobs gives too
    out = sample(base, target_prompt_logprobs=types.TensorData.from_numpy(ids), include_prompt_logprobs=True)
    got = out.target_prompt_logprobs
    assert got.dtype == "float32" and got.shape == [ROWS, 3] and got.sparse_crow_indices is None
    np.testing.assert_allclose(got.to_numpy(), expected_scores(reference, ids), atol=2e-5, rtol=0)
    np.testing.assert_allclose(got.to_numpy()[:, 0], out.prompt_logprobs[1:], atol=1e-6)


def test_sparse_target_prompt_logprobs_keep_their_layout(base, reference):
    """As the cookbook's decisions recipe asks: K label tokens at one position, CSR with -1 as the pad."""
    ids = torch.full((ROWS, 4), -1, dtype=torch.int64)
    ids[ROWS - 1] = torch.tensor([65, 66, 67, 68])
    ids[1, 2] = 900
    request = types.TensorData.from_torch_sparse(ids, pad_value=-1)
    assert request.sparse_crow_indices is not None
    got = sample(base, target_prompt_logprobs=request).target_prompt_logprobs
    assert got.shape == [ROWS, 4] and got.dtype == "float32"
    assert list(got.sparse_crow_indices) == request.sparse_crow_indices
    assert list(got.sparse_col_indices) == request.sparse_col_indices
    np.testing.assert_allclose(got.to_numpy(), expected_scores(reference, ids.numpy()), atol=2e-5, rtol=0)


def test_prompt_alt_tokens_at_temperature_zero_are_the_argmax(base, reference):
    alt = sample(base, temperature=0.0, prompt_alt_tokens_k=3).prompt_alt_tokens
    tokens, logprobs = alt.tokens.to_numpy(), alt.logprobs.to_numpy()
    assert tokens.shape == logprobs.shape == (ROWS, 3)
    assert (tokens == reference.argmax(-1)[:, None]).all()
    np.testing.assert_allclose(logprobs, reference.max(-1, keepdims=True).repeat(3, 1), atol=2e-5, rtol=0)


def test_prompt_alt_tokens_at_temperature_one_follow_the_distribution_and_the_seed(base, reference):
    k = 64
    first = sample(base, temperature=1.0, seed=7, prompt_alt_tokens_k=k).prompt_alt_tokens
    again = sample(base, temperature=1.0, seed=7, prompt_alt_tokens_k=k).prompt_alt_tokens
    other = sample(base, temperature=1.0, seed=8, prompt_alt_tokens_k=k).prompt_alt_tokens
    tokens, logprobs = first.tokens.to_numpy(), first.logprobs.to_numpy()
    np.testing.assert_array_equal(again.tokens.to_numpy(), tokens)
    assert not np.array_equal(other.tokens.to_numpy(), tokens)
    assert tokens.shape == (ROWS, k) and ((tokens >= 0) & (tokens < reference.shape[1])).all()
    np.testing.assert_allclose(logprobs, np.take_along_axis(reference, tokens, 1), atol=2e-5, rtol=0)
    # Plausible draws (fixed seeds, so not flaky): the mean logprob of what was drawn is the
    # distribution's negative entropy, within 5 standard errors over the 7 x 64 draws.
    p = np.exp(reference.astype(np.float64))
    neg_entropy = (p * reference).sum(-1)
    spread = np.sqrt(((p * reference ** 2).sum(-1) - neg_entropy ** 2).sum()) / (ROWS * np.sqrt(k))
    assert abs(logprobs.mean() - neg_entropy.mean()) < 5 * spread
    assert (tokens != reference.argmax(-1)[:, None]).any()  # it samples, not only the argmax


def test_bad_prompt_scoring_requests_are_clear_400s(base):
    cases = [
        (dict(target_prompt_logprobs=types.TensorData.from_numpy(np.zeros((ROWS + 1, 2), np.int64))),
         rf"target_prompt_logprobs has shape \[{ROWS + 1}, 2\]; expected \[len\(prompt\) - 1, K\] = \[{ROWS}, K\]"),
        (dict(target_prompt_logprobs=types.TensorData.from_numpy(np.zeros((ROWS, 101), np.int64))),
         r"1 <= K <= 100"),
        (dict(target_prompt_logprobs=types.TensorData.from_numpy(np.full((ROWS, 2), 10 ** 7, np.int64))),
         r"target_prompt_logprobs token 10000000 is outside the vocabulary"),
        (dict(target_prompt_logprobs=types.TensorData(data=[1, 2], dtype="int64", shape=[ROWS, 2],
                                                      sparse_crow_indices=[0, 2], sparse_col_indices=[0, 1])),
         rf"sparse_crow_indices must have {ROWS + 1} entries"),
    ]
    for kw, pattern in cases:
        with pytest.raises(tinker.BadRequestError, match=pattern):
            sample(base, **kw)
    # the schema's bound, as for topk_prompt_logprobs: a 422 naming the field and the limit
    with pytest.raises(tinker.UnprocessableEntityError, match="prompt_alt_tokens_k: .* less than or equal to 100"):
        sample(base, prompt_alt_tokens_k=101)
    assert sample(base).sequences[0].stop_reason in ("stop", "length")  # still serving


def test_prompt_alt_draws_count_as_sampled_tokens():
    """They bound a request (max_sampled_tokens_per_request) and a key's allowance as sampled tokens do."""
    job = SampleJob(prompt=PROMPT, num_samples=2, max_tokens=5, adapter_id=None, prompt_alt_tokens_k=4)
    assert requested_tokens(job) == 2 * 5 + ROWS * 4
