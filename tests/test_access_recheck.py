"""Access is checked on every use (issue 10), through the real SDKs against a real server process.

Bob opens a sampling session on Alice's published sampler checkpoint. It must stop working the
moment Alice unpublishes it, and again after she saves privately over the same name and the
server restarts: before, the session kept sampling (the weights it had, then Alice's new
private ones). The same holds for Bob's `/v1` requests naming that checkpoint.
"""

from __future__ import annotations

import sqlite3

import httpx
import openai
import pytest
import tinker
from tinker import types

from helpers import BASE_MODEL, database, sft_batch
from hosted_tinker.accounts.auth import anonymous_owner
from server_process import ServerProcess

pytestmark = pytest.mark.e2e
ALICE, BOB = "tml-recheck-alice", "tml-recheck-bob"
PROMPT = types.ModelInput.from_ints([1, 2, 3])
PARAMS = types.SamplingParams(max_tokens=2)


@pytest.fixture(scope="module")
def srv(tmp_path_factory):
    proc = ServerProcess(tmp_path_factory.mktemp("recheck")).start()
    yield proc
    proc.stop()


def sample(sampler) -> list[int]:
    return sampler.sample(PROMPT, num_samples=1, sampling_params=PARAMS).result().sequences[0].tokens


def v1_status(srv, key: str, model: str) -> int:
    return httpx.post(f"{srv.base_url}/v1/completions", json={"model": model, "prompt": [1, 2], "max_tokens": 1},
                      headers={"Authorization": f"Bearer {key}"}, timeout=60).status_code


def sampler_status(srv, key: str, sampler_id: str) -> int:
    return httpx.get(f"{srv.base_url}/api/v1/samplers/{sampler_id}", headers={"X-API-Key": key}, timeout=30).status_code


def bobs_sampler_id(srv) -> str:
    with sqlite3.connect(database(srv.data_dir)) as db:
        (sid,) = db.execute("SELECT sampling_session_id FROM sampling_sessions WHERE owner=?",
                            (anonymous_owner(BOB),)).fetchone()
    return sid


def test_unpublish_and_private_resave_end_another_tenants_session(srv):
    with srv.client(ALICE) as alice, \
            srv.client(BOB) as bob:
        tc = alice.create_lora_training_client(base_model=BASE_MODEL, rank=4).result()
        tc.forward_backward(sft_batch(2), "cross_entropy").result()
        tc.optim_step(types.AdamParams(learning_rate=1e-2)).result()
        path = tc.save_weights_for_sampler("shared").result().path
        rest = tinker.RestClient(base_url=srv.base_url, api_key=ALICE)
        rest.publish_checkpoint_from_tinker_path(path).result()

        bobs = bob.create_sampling_client(model_path=path).result()
        assert sample(bobs)
        sampler_id = bobs_sampler_id(srv)
        assert v1_status(srv, BOB, path) == 200 and sampler_status(srv, BOB, sampler_id) == 200

        rest.unpublish_checkpoint_from_tinker_path(path).result()
        with pytest.raises(tinker.NotFoundError, match="can no longer read"):
            sample(bobs)
        with pytest.raises(tinker.NotFoundError):  # compute_logprobs is a use too
            bobs.compute_logprobs(PROMPT).result()
        assert v1_status(srv, BOB, path) == 404 and sampler_status(srv, BOB, sampler_id) == 404

        rest.publish_checkpoint_from_tinker_path(path).result()  # decided on each use, not remembered
        assert sample(bobs) and v1_status(srv, BOB, path) == 200

        # Alice saves over the name: the new weights are private, whatever the old ones were.
        tc.forward_backward(sft_batch(2, seed=1), "cross_entropy").result()
        tc.optim_step(types.AdamParams(learning_rate=1e-2)).result()
        assert tc.save_weights_for_sampler("shared").result().path == path
        alices = alice.create_sampling_client(model_path=path).result()
        assert sample(alices)
        srv.restart()
        with pytest.raises(tinker.NotFoundError, match="can no longer read"):
            sample(bobs)
        assert v1_status(srv, BOB, path) == 404 and sampler_status(srv, BOB, sampler_id) == 404
        with openai.OpenAI(base_url=srv.base_url + "/v1", api_key=BOB, max_retries=0) as oai, \
                pytest.raises(openai.NotFoundError):
            oai.completions.create(model=path, prompt="hi", max_tokens=1)
        assert sample(alices) and v1_status(srv, ALICE, path) == 200  # still Alice's to use


def test_a_deleted_checkpoint_ends_its_owners_session_too(srv):
    with srv.client(ALICE) as alice:
        tc = alice.create_lora_training_client(base_model=BASE_MODEL, rank=4).result()
        path = tc.save_weights_for_sampler("short-lived").result().path
        sampler = alice.create_sampling_client(model_path=path).result()
        assert sample(sampler)
        tinker.RestClient(base_url=srv.base_url, api_key=ALICE).delete_checkpoint_from_tinker_path(path).result()
        with pytest.raises(tinker.NotFoundError):
            sample(sampler)
