"""What one tenant sends cannot reach into another's (issue 26, items 3, 4, 7-10), against a real
server with two keys, Alice (the victim) and Mallory:

- a chat template sent with a request is refused (it is code run on the server), and
  `chat_template_kwargs` reach the model's template only where it reads them, bounded in bytes;
- stop strings are bounded in number and bytes on both APIs, each refusal naming its setting;
- importing a checkpoint never creates a run under an id the caller chose, so it can neither take
  Alice's next model id nor tell her runs from absent ones;
- a project filter never matches on another owner's (private) session project;
- every stored free-form field is bounded, NaN is never stored, and malformed prompts and roles are 4xx.
"""

from __future__ import annotations

import json

import httpx
import openai
import pytest
import tinker

from helpers import BASE_MODEL

pytestmark = pytest.mark.e2e
ALICE, MALLORY = "tml-bounds-alice", "tml-bounds-mallory"
SECRET_PROJECT = "alice-secret-acquisition"


def post(server, path: str, key: str = MALLORY, **kw) -> httpx.Response:
    return httpx.post(server.base_url + path, headers={"X-API-Key": key, **kw.pop("headers", {})}, timeout=60, **kw)


@pytest.fixture(scope="module")
def alice(server):
    """Alice's model in a session of her private project, with one published checkpoint (so its run is
    listed to everyone while this module runs) and an archive of it to import."""
    with server.client(ALICE, project_id=SECRET_PROJECT) as sc:
        tc = sc.create_lora_training_client(base_model=BASE_MODEL, rank=4).result()
        path = tc.save_state("published").result().path
        rest = tinker.RestClient(base_url=server.base_url, api_key=ALICE)
        rest.publish_checkpoint_from_tinker_path(path).result()
        run, kind, name = path[len("tinker://"):].split("/")
        archive = httpx.get(f"{server.base_url}/api/v1/training_runs/{run}/checkpoints/{kind}/{name}/archive",
                            headers={"X-API-Key": ALICE}, timeout=60)
        assert archive.status_code == 200, archive.text
        yield dict(sc=sc, model_id=tc.model_id, session_id=tc.model_id.split(":train:")[0],
                   archive=archive.content)
        rest.unpublish_checkpoint_from_tinker_path(path).result()  # others on the shared server list no runs of ours


@pytest.fixture(scope="module")
def oai(server):
    with openai.OpenAI(base_url=server.base_url + "/v1", api_key=MALLORY, max_retries=0) as client:
        yield client


def chat(oai, **extra) -> openai.types.chat.ChatCompletion:
    return oai.chat.completions.create(model=BASE_MODEL, messages=[{"role": "user", "content": "Hi"}],
                                       max_tokens=1, extra_body=extra)


# -- 3: chat templates ---------------------------------------------------------------------------------

def test_a_request_cannot_send_its_own_chat_template(oai):
    injected = "{% for i in range(10) %}{% for j in range(10) %}x{% endfor %}{% endfor %}"
    for extra in ({"chat_template_kwargs": {"chat_template": injected}}, {"chat_template": injected}):
        with pytest.raises(openai.BadRequestError, match="trust-request-chat-template"):
            chat(oai, **extra)
    # what the server sets itself (the tools refusal, the conversation, special tokens) is not a kwarg
    for key in ("tools", "messages", "add_generation_prompt", "eos_token"):
        with pytest.raises(openai.BadRequestError, match=f"chat_template_kwargs.{key} is set by the server"):
            chat(oai, chat_template_kwargs={key: []})
    with pytest.raises(openai.BadRequestError, match="does not read 'persona'.*enable_thinking"):
        chat(oai, chat_template_kwargs={"persona": "pirate"})
    with pytest.raises(openai.BadRequestError, match="max_chat_template_kwargs_bytes"):
        chat(oai, chat_template_kwargs={"enable_thinking": "x" * (17 << 10)})
    # a variable the model's template reads still works: Qwen3's empty thinking block adds tokens
    thinking, plain = (chat(oai, chat_template_kwargs={"enable_thinking": flag}) for flag in (True, False))
    assert plain.usage.prompt_tokens > thinking.usage.prompt_tokens


def test_an_operator_can_trust_request_templates(tmp_path):
    """The opt-in, in process: a trusted request's template is rendered, and its own variables may be set."""
    from types import SimpleNamespace

    from transformers import AutoTokenizer

    from hosted_tinker.api.openai_compat.schemas import ChatBody
    from hosted_tinker.api.openai_compat.template import render_chat
    from hosted_tinker.config.settings import ServerConfig
    from hosted_tinker.models.embedded import ensure_embedded_model

    served = SimpleNamespace(name=BASE_MODEL, tokenizer=AutoTokenizer.from_pretrained(
        str(ensure_embedded_model(tmp_path))))
    body = ChatBody(model=BASE_MODEL, messages=[], chat_template_kwargs={
        "chat_template": "{{ greeting }}:{% for m in messages %}{{ m.content }}{% endfor %}", "greeting": "hey"})
    messages = [{"role": "user", "content": "Hi"}]
    assert render_chat(ServerConfig(trust_request_chat_template=True), served, body, messages) == "hey:Hi"
    with pytest.raises(Exception, match="trust-request-chat-template"):
        render_chat(ServerConfig(), served, body, messages)


# -- 4: stop strings -----------------------------------------------------------------------------------

def test_stop_strings_are_bounded_on_both_apis(server, oai):
    session = post(server, "/api/v1/create_session", json={"tags": []}).json()["session_id"]
    sampler = post(server, "/api/v1/create_sampling_session", json={
        "session_id": session, "sampling_session_seq_id": 0, "base_model": BASE_MODEL}).json()["sampling_session_id"]

    def asample(seq_id: int, stop: list[str]) -> httpx.Response:
        return post(server, "/api/v1/asample", json={
            "sampling_session_id": sampler, "seq_id": seq_id, "prompt": {"chunks": [{"tokens": [1, 2, 3]}]},
            "sampling_params": {"max_tokens": 1, "stop": stop}})

    many, long = [f"stop{i}" for i in range(65)], ["s" * 2100, "t" * 2100]
    for i, (stop, setting) in enumerate([(many, "max_stop_strings"), (long, "max_stop_strings_bytes")]):
        r = asample(i, stop)
        assert r.status_code == 400 and setting in r.json()["detail"], r.text
        with pytest.raises(openai.BadRequestError, match=setting):
            oai.completions.create(model=BASE_MODEL, prompt="Hi", max_tokens=1, stop=stop)
    assert asample(2, many[:64]).status_code == 200  # at the limit: served


# -- 7: import ids ---------------------------------------------------------------------------------------

def test_import_cannot_take_or_probe_another_tenants_run_ids(server, alice):
    def import_into(run_id: str | None, key: str = MALLORY) -> httpx.Response:
        params = {"name": "squat"} | ({"training_run_id": run_id} if run_id else {})
        return post(server, "/api/v1/checkpoints/import", key, params=params, content=alice["archive"])

    next_id = f"{alice['session_id']}:train:1"  # printed in every path Alice publishes: guessable
    answers = [import_into(run) for run in (alice["model_id"], next_id, "sess-absent:train:0")]
    assert [r.status_code for r in answers] == [404] * 3, [r.text for r in answers]
    details = {r.json()["detail"].replace(run, "RUN") for r, run in
               zip(answers, (alice["model_id"], next_id, "sess-absent:train:0"))}
    assert len(details) == 1, details  # one answer for "not yours" and "absent"
    own = import_into(None)
    assert own.status_code == 200 and own.json()["training_run_id"].startswith("import-"), own.text
    assert import_into(own.json()["training_run_id"]).status_code == 400  # its own run: found (name taken)
    # Alice's next model gets the id Mallory tried to take
    tc = alice["sc"].create_lora_training_client(base_model=BASE_MODEL, rank=4).result()
    assert tc.model_id == next_id


# -- 9: listing runs -------------------------------------------------------------------------------------

def test_a_project_filter_never_matches_another_owners_private_project(server, alice):
    rest = tinker.RestClient(base_url=server.base_url, api_key=MALLORY)
    listed = {r.training_run_id for r in rest.list_training_runs(access_scope="accessible").result().training_runs}
    assert alice["model_id"] in listed  # her run is public through its checkpoint ...
    runs = httpx.get(server.base_url + "/api/v1/training_runs", headers={"X-API-Key": MALLORY}, timeout=60,
                     params={"access_scope": "accessible", "project_id": SECRET_PROJECT}).json()
    assert runs["training_runs"] == [] and runs["cursor"]["total_count"] == 0, runs  # ... her project is not
    mine = httpx.get(server.base_url + "/api/v1/training_runs", headers={"X-API-Key": ALICE}, timeout=60,
                     params={"project_id": SECRET_PROJECT}).json()
    assert alice["model_id"] in {r["training_run_id"] for r in mine["training_runs"]}


# -- 8, 10: stored fields, malformed input ---------------------------------------------------------------

def test_stored_fields_are_bounded_and_valid_json(server):
    session = post(server, "/api/v1/create_session", json={"tags": []}).json()["session_id"]
    big = {"type": "adamw", "notes": "n" * (65 << 10)}
    refusals = [
        (post(server, "/api/v1/create_model", json={"session_id": session, "model_seq_id": 0, "base_model": BASE_MODEL,
                                                    "optimizer_config": big}), "optimizer_config is"),
        (post(server, "/api/v1/load_weights", json={"path": "tinker://x/weights/y", "session_id": session,
                                                    "model_seq_id": 0, "optimizer_config": big}), "optimizer_config is"),
        (httpx.put(f"{server.base_url}/api/v1/sessions/{session}/project", headers={"X-API-Key": MALLORY},
                   json={"project_id": "p" * 1025}, timeout=60), "project_id"),
        (post(server, f"/api/v1/sessions/{session}/finish", json={"reason": {"type": "r" * 1025}}), "reason.type"),
        # the literal NaN: Python reads it, JSON (and every reader of the stored config) does not
        (post(server, "/api/v1/create_model", headers={"Content-Type": "application/json"},
              content=b'{"session_id": "%s", "model_seq_id": 0, "base_model": "%s", '
                      b'"optimizer_config": {"type": "adamw", "lr": NaN}}' % (session.encode(), BASE_MODEL.encode())),
         "optimizer_config holds NaN"),
    ]
    for r, needle in refusals:
        assert r.status_code == 422 and needle in r.json()["detail"], (needle, r.status_code, r.text)
    assert "65536" in refusals[0][0].json()["detail"] and "1024" in refusals[2][0].json()["detail"]


@pytest.mark.parametrize("chunks", ["x", 5, [1], [None], {"a": 1}, [[]]])
def test_malformed_prompt_chunks_are_a_400(server, chunks):
    session = post(server, "/api/v1/create_session", json={"tags": []}).json()["session_id"]
    sampler = post(server, "/api/v1/create_sampling_session", json={
        "session_id": session, "sampling_session_seq_id": 0, "base_model": BASE_MODEL}).json()["sampling_session_id"]
    r = post(server, "/api/v1/asample", json={"sampling_session_id": sampler, "seq_id": 0,
                                              "prompt": {"chunks": chunks}, "sampling_params": {"max_tokens": 1}})
    assert r.status_code == 400 and "prompt.chunks must be a list of chunk objects" in r.json()["detail"], r.text


@pytest.mark.parametrize("role", [["user"], {"a": "user"}])
def test_a_role_that_is_not_a_string_is_a_400(oai, role):
    with pytest.raises(openai.BadRequestError, match="role must be one of"):
        oai.chat.completions.create(model=BASE_MODEL, messages=[{"role": role, "content": "Hi"}], max_tokens=1)


def test_the_server_still_serves_alice(server, alice):
    """After everything above, Alice's sampling and runs are as they were."""
    with server.client(ALICE) as sc:
        sampler = sc.create_sampling_client(base_model=BASE_MODEL).result()
        out = sampler.sample(tinker.ModelInput.from_ints([1, 2, 3]), 1,
                             tinker.SamplingParams(max_tokens=2, stop=["never"])).result()
        assert len(out.sequences[0].tokens) == 2
    info = json.loads(httpx.get(f"{server.base_url}/api/v1/training_runs/{alice['model_id']}",
                                headers={"X-API-Key": ALICE}, timeout=60).text)
    assert info["training_run_id"] == alice["model_id"]
