"""A sample request's failure is its own (issue 33, item 2), against a real server serving a tiny
Qwen3-VL, with two API keys sampling image prompts through the real SDK.

The built-in engine prefills the jobs it admits together as one group and decodes them as one
batch. A prompt that breaks the forward (on main at eecf5db, an image prompt whose placeholder
tokens disagree with its pixels) made the group's prefill raise, and another key's well-formed
image sample failed with it, in 3 of 3 rounds. The server's image validation now refuses that
prompt before it is queued, so the test arms the sampler's own fault points (hosted_tinker/faults.py)
instead: a prompt holding the point's poison token raises inside the prefill (a `UserError`) or
inside a decode step (a server fault), wherever it is batched. The victim then gets the samples it
gets alone, and the culprit fails with its own category.

Both keys' jobs are held until they are admitted together, by construction: a third key's
requests fill the whole KV-cache budget (each needs all of it, so the victim and the culprit wait
behind them); once both are queued, the hogs' clients leave, and the next admission takes the two.
"""

from __future__ import annotations

import openai
import pytest
import tinker
from tinker import types
from tinker.types.request_error_category import RequestErrorCategory

from helpers import open_completion, sampling_metrics, wait_until
from hosted_tinker import faults
from server_process import ServerProcess
from tiny_vl_model import build_tiny_vl_model, png

pytestmark = pytest.mark.e2e
VICTIM, CULPRIT, HOG = "tml-isolation-victim", "tml-isolation-culprit", "tml-isolation-hog"
HOG_PROMPT, HOG_TOKENS, HOGS = [1, 2, 3], 500, 6  # each needs 503 KV tokens; ~3,000 decode steps in all
BEFORE, AFTER, IMAGE_TOKENS = [5, 17, 230], [41, 99, 7], 4  # a 64x64 image: 4 tokens
SAMPLES, MAX_TOKENS = 2, 8
JOB_KV = SAMPLES * (len(BEFORE) + IMAGE_TOKENS + len(AFTER) + MAX_TOKENS)
BUDGET = len(HOG_PROMPT) + HOG_TOKENS + JOB_KV - 1  # a hog and nothing beside it; the two jobs together
PARAMS = types.SamplingParams(max_tokens=MAX_TOKENS, temperature=1.0, seed=7, stop=[])


@pytest.fixture(scope="module")
def vl_dir(tmp_path_factory):
    return build_tiny_vl_model(tmp_path_factory.mktemp("vl") / "tiny-qwen3-vl")


@pytest.fixture(scope="module")
def srv(vl_dir, tmp_path_factory):
    # every time a forward holds a prompt poisoned for the point
    armed = ",".join(point for point in faults.POISONED if point.startswith("sampling."))
    proc = ServerProcess(tmp_path_factory.mktemp("srv"), env={faults.ENV_VAR: armed},
                         args=("--base-model", str(vl_dir), "--max-sampling-kv-tokens", str(BUDGET),
                               "--max-sampling-kv-share-per-key", "1.0")).start()
    yield proc
    proc.stop()


@pytest.fixture(scope="module")
def samplers(srv, vl_dir):
    with srv.client(VICTIM) as victim, srv.client(CULPRIT) as culprit:
        yield tuple(sc.create_sampling_client(base_model=str(vl_dir)).result() for sc in (victim, culprit))


def image_prompt(text_after: list[int]) -> types.ModelInput:
    return types.ModelInput(chunks=[types.EncodedTextChunk(tokens=BEFORE),
                                    types.ImageChunk(data=png(64, 64, seed=3), format="png",
                                                     expected_tokens=IMAGE_TOKENS),
                                    types.EncodedTextChunk(tokens=text_after)])


def admitted_together(srv, vl_dir, submit_both):
    """Queue the two jobs behind hogs that fill the budget, then let the hogs go: one admission
    takes both. Returns what `submit_both()` returned (the two futures)."""
    body = {"model": str(vl_dir), "prompt": HOG_PROMPT, "n": 1, "max_tokens": HOG_TOKENS, "ignore_eos": True}
    waiting = sampling_metrics(srv)["hosted_tinker_sampling_waiting_jobs"]
    hogs = [open_completion(srv, HOG, body) for _ in range(HOGS)]
    try:
        wait_until(lambda: sampling_metrics(srv)["hosted_tinker_sampling_waiting_jobs"] == waiting + HOGS - 1,
                   "one hog runs, the others wait")
        futures = submit_both()
        wait_until(lambda: sampling_metrics(srv)["hosted_tinker_sampling_waiting_jobs"] == waiting + HOGS + 1,
                   "the victim's and the culprit's jobs wait behind the hogs")
    finally:
        for sock in hogs:
            sock.close()  # the hogs' clients leave: their jobs are cancelled
    return futures


def alone(sampler) -> types.SampleResponse:
    return sampler.sample(image_prompt(AFTER), num_samples=SAMPLES, sampling_params=PARAMS).result()


def assert_same_samples(got: types.SampleResponse, want: types.SampleResponse) -> None:
    """The same tokens, and logprobs within the rounding of another batch (a seeded job's samples
    do not depend on the batch: tests/test_batched_pick.py)."""
    assert [s.tokens for s in got.sequences] == [s.tokens for s in want.sequences]
    for g, w in zip(got.sequences, want.sequences):
        assert g.logprobs == pytest.approx(w.logprobs, abs=1e-5)


@pytest.mark.parametrize("point, category", [("sampling.prefill_poisoned", RequestErrorCategory.User),
                                             ("sampling.decode_poisoned", RequestErrorCategory.Server)])
def test_a_poisoned_prompt_fails_only_its_own_request(srv, vl_dir, samplers, point, category):
    victim, culprit = samplers
    poisoned = image_prompt([*faults.POISONED[point], *AFTER[1:]])  # as long as the victim's: no padding

    def submit_both():
        return (victim.sample(image_prompt(AFTER), num_samples=SAMPLES, sampling_params=PARAMS),
                culprit.sample(poisoned, num_samples=SAMPLES, sampling_params=PARAMS))

    victims, culprits = admitted_together(srv, vl_dir, submit_both)
    with pytest.raises(tinker.RequestFailedError) as failed:
        culprits.result()
    assert failed.value.category is category and point in failed.value.message
    assert_same_samples(victims.result(), alone(victim))
    wait_until(lambda: sampling_metrics(srv)["hosted_tinker_sampling_kv_reserved_tokens"] == 0,
               "every job's reservation given back")


def test_a_request_that_raises_a_user_error_is_a_400_on_the_openai_routes(srv, vl_dir):
    """The OpenAI routes answer a job that failed with a `UserError` with a 400, streaming or not."""
    poisoned = [*HOG_PROMPT, *faults.POISONED["sampling.prefill_poisoned"]]
    with openai.OpenAI(base_url=srv.base_url + "/v1", api_key=VICTIM, max_retries=0) as oai:
        for stream in (False, True):
            with pytest.raises(openai.BadRequestError, match="sampling.prefill_poisoned"):
                oai.completions.create(model=str(vl_dir), prompt=poisoned, max_tokens=4, stream=stream)
        assert oai.completions.create(model=str(vl_dir), prompt=HOG_PROMPT, max_tokens=4).choices[0].text is not None
