"""Two base models served by one server process, routed by `base_model` (issue 16, test 2).

The models are two tiny ones built into a local Hugging Face cache under two real names (see
offline_hub.py): a student `Qwen/Qwen3-8B-Base` and a teacher `Qwen/Qwen3-8B`, with the same
tokenizer (so the teacher can score the student's samples, as on_policy_distillation asks) and
different weights (another seed). Every answer is compared with a forward pass of the named
model's own files in this process, so a request routed to the other model cannot pass: the two
models' logprobs of the same tokens differ by far more than the tolerance.

- Both are trained and sampled through the SDK at once, through one base_url; each checkpoint
  loads and samples only on its own base model (a 400 naming both otherwise); an unserved base
  model is a 400 naming the served ones; the OpenAI API, the tokenizer hub routes,
  get_server_capabilities and /metrics see both.
- The cookbook's `on_policy_distillation` recipe runs unchanged with the teacher differing from
  the student, on a synthetic copy of DeepMath in the datasets cache.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import threading

import httpx
import numpy as np
import pytest
import tinker
import torch

from helpers import checkpoint_dir, logprobs_of, sft_datum, tar_bytes
from hosted_tinker.models.embedded import TinyModelSpec
from offline_hub import install_fake_dataset, install_fake_hub_model, offline_env
from server_process import ServerProcess

pytestmark = pytest.mark.e2e

STUDENT, TEACHER = "Qwen/Qwen3-8B-Base", "Qwen/Qwen3-8B"
KEY = "tml-two-models"
TOKENS = [5, 17, 230, 41, 999, 8, 77, 300, 12, 640]  # below the tiny tokenizer's size
TOL = 1e-4  # the server's fused kernels vs a plain forward pass, fp32


@pytest.fixture(scope="module")
def hub(tmp_path_factory):
    hf_home = tmp_path_factory.mktemp("two-models") / "hf"
    snapshots = {STUDENT: install_fake_hub_model(hf_home, STUDENT),
                 TEACHER: install_fake_hub_model(hf_home, TEACHER, TinyModelSpec(flavor="qwen3", seed=1))}
    install_fake_dataset(hf_home, "zwhe99/DeepMath-103K", [
        {"question": f"What is {a} + {b}?", "final_answer": str(a + b), "difficulty": 1.0, "topic": "arithmetic"}
        for a, b in [(1, 2), (3, 4), (5, 6), (7, 8)]], "train")
    return hf_home, snapshots


@pytest.fixture(scope="module")
def srv(hub, tmp_path_factory):
    hf_home, _ = hub
    env = {**offline_env(hf_home), "TINKER_API_KEY": KEY}
    proc = ServerProcess(tmp_path_factory.mktemp("srv"), env=env,
                         args=("--base-model", STUDENT, "--base-model", TEACHER)).start()
    yield proc
    proc.stop()


@pytest.fixture(scope="module")
def reference(hub):
    """Each model's logprobs at every position of TOKENS, from its own files (float32)."""
    from transformers import AutoModelForCausalLM

    out = {}
    for name, snapshot in hub[1].items():
        model = AutoModelForCausalLM.from_pretrained(snapshot, dtype=torch.float32)
        with torch.no_grad():
            out[name] = torch.log_softmax(model(torch.tensor([TOKENS])).logits[0].float(), -1).numpy()
    return out


def targets_logprobs(full: np.ndarray) -> np.ndarray:
    """Logprob of each next token of TOKENS, from a model's full distributions."""
    return full[np.arange(len(TOKENS) - 1), TOKENS[1:]]


def test_the_two_reference_models_differ(reference):
    """The premise of every routing check below."""
    assert np.abs(targets_logprobs(reference[STUDENT]) - targets_logprobs(reference[TEACHER])).max() > 100 * TOL


def test_both_models_train_and_sample_at_once_through_one_base_url(srv, reference):
    from tinker import types

    with srv.client(KEY) as sc:
        rest = tinker.RestClient(base_url=srv.base_url, api_key=KEY)
        served = {m.model_name: m for m in rest.get_server_capabilities().result().supported_models}
        assert set(served) == {STUDENT, TEACHER} and all(m.trainable and m.sampleable for m in served.values())

        start = threading.Barrier(4)
        results, errors = {}, []

        def train(name: str) -> None:
            try:
                tc = sc.create_lora_training_client(base_model=name, rank=4, seed=1).result()
                start.wait()
                losses, first = [], None
                for _ in range(3):
                    fb = tc.forward_backward([sft_datum(TOKENS)], "cross_entropy").result()
                    first = first if first is not None else logprobs_of(fb)[0]
                    losses.append(fb.metrics["loss:sum"])
                    tc.optim_step(types.AdamParams(learning_rate=2e-2)).result()
                state = tc.save_state("trained").result().path
                sampler = tc.save_weights_and_get_sampling_client().result()
                sample = sampler.sample(types.ModelInput.from_ints(TOKENS[:4]), 2,
                                        types.SamplingParams(max_tokens=5, seed=3)).result()
                results[name] = dict(tc=tc, losses=losses, first=first, state=state, sample=sample)
            except BaseException as e:  # reported by the main thread
                errors.append(e)
                start.abort()

        def sample_base(name: str) -> None:
            try:
                client = sc.create_sampling_client(base_model=name).result()
                start.wait()
                results["base:" + name] = client.compute_logprobs(types.ModelInput.from_ints(TOKENS)).result()
            except BaseException as e:
                errors.append(e)
                start.abort()

        threads = [threading.Thread(target=f, args=(n,)) for f in (train, sample_base) for n in (STUDENT, TEACHER)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        assert not errors, errors

        for name in (STUDENT, TEACHER):
            want = targets_logprobs(reference[name])
            run = results[name]
            # a new adapter adds nothing yet: its first pass is the named base model's own
            np.testing.assert_allclose(run["first"], want, atol=TOL)
            np.testing.assert_allclose(np.asarray(results["base:" + name][1:], dtype=np.float32), want, atol=TOL)
            assert run["losses"][-1] < run["losses"][0], run["losses"]
            assert all(len(s.tokens) == 5 for s in run["sample"].sequences)

        # A checkpoint belongs to its base model: loading or sampling it on the other is refused up front.
        student, teacher = results[STUDENT], results[TEACHER]
        with pytest.raises(tinker.BadRequestError, match=rf"trained on base model '{re.escape(STUDENT)}'.*"
                                                         r"loads only into its own base model"):
            teacher["tc"].load_state(student["state"]).result()
        teacher["tc"].forward_backward([sft_datum(TOKENS)], "cross_entropy").result()  # its queue goes on
        with pytest.raises(tinker.BadRequestError, match=rf"trained on base model '{re.escape(STUDENT)}', not "
                                                         rf"'{re.escape(TEACHER)}'"):
            sc.create_training_client_from_state(student["state"], base_model=TEACHER).result()
        with pytest.raises(tinker.BadRequestError, match=rf"trained on base model '{re.escape(TEACHER)}', not "
                                                         rf"'{re.escape(STUDENT)}'"):
            sc.create_sampling_client(model_path=teacher["state"], base_model=STUDENT).result()
        # Without a base model named, a checkpoint goes to its own.
        resumed = sc.create_training_client_from_state(teacher["state"]).result()
        assert resumed.get_info().model_data.model_name == TEACHER
        with pytest.raises(tinker.BadRequestError, match=r"base model 'Qwen/Qwen3-4B' is not served here; this "
                                                         rf"server serves '{re.escape(STUDENT)}', "
                                                         rf"'{re.escape(TEACHER)}'"):
            sc.create_lora_training_client(base_model="Qwen/Qwen3-4B", rank=4).result()

    # Each model ran its own cycles and sampling, on its own device loop.
    text = httpx.get(f"{srv.base_url}/metrics", timeout=30).text
    for name in (STUDENT, TEACHER):
        for series in ("hosted_tinker_cycles_total", "hosted_tinker_sample_requests_total"):
            m = re.search(rf'^{series}{{base_model="{re.escape(name)}"}} (\S+)$', text, re.M)
            assert m and float(m.group(1)) >= 1, (series, name)


def test_openai_names_each_served_model_and_checkpoints_by_their_base(srv, reference):
    headers = {"Authorization": f"Bearer {KEY}"}
    with srv.client(KEY) as sc:
        tc = sc.create_lora_training_client(base_model=TEACHER, rank=4).result()
        sampler_path = tc.save_weights_for_sampler("openai").result().path
    cards = httpx.get(f"{srv.base_url}/v1/models", headers=headers, timeout=30).json()["data"]
    ids = [c["id"] for c in cards]
    assert ids[:2] == [STUDENT, TEACHER] and sampler_path in ids
    assert next(c for c in cards if c["id"] == sampler_path)["root"] == TEACHER

    def greedy(model: str) -> tuple[int, float]:
        answer = httpx.post(f"{srv.base_url}/v1/completions", headers=headers, timeout=60, json={
            "model": model, "prompt": TOKENS, "max_tokens": 1, "temperature": 0, "logprobs": 1,
            "return_tokens_as_token_ids": True})
        assert answer.status_code == 200, answer.text
        lps = answer.json()["choices"][0]["logprobs"]
        return int(lps["tokens"][0].removeprefix("token_id:")), lps["token_logprobs"][0]

    for model, base in ((STUDENT, STUDENT), (TEACHER, TEACHER), (sampler_path, TEACHER)):
        last = reference[base][-1]
        token, logprob = greedy(model)  # a fresh adapter adds nothing: the base model's greedy token
        assert token == int(last.argmax()) and abs(logprob - last[token]) < TOL, model
    missing = httpx.post(f"{srv.base_url}/v1/completions", headers=headers, timeout=30,
                         json={"model": "Qwen/Qwen3-4B", "prompt": "hi", "max_tokens": 1})
    assert missing.status_code == 404 and STUDENT in missing.json()["detail"] and TEACHER in missing.json()["detail"]


def test_the_hub_routes_serve_every_served_models_tokenizer(srv, hub):
    for name, snapshot in hub[1].items():
        got = httpx.get(f"{srv.base_url}/{name}/resolve/main/tokenizer_config.json", timeout=30)
        assert got.status_code == 200 and got.content == (snapshot / "tokenizer_config.json").read_bytes(), name
    other = httpx.get(f"{srv.base_url}/api/models/Qwen/Qwen3-4B", timeout=30)
    assert other.status_code == 404 and other.headers["X-Error-Code"] == "RepositoryNotFound"
    assert STUDENT in other.json()["detail"] and TEACHER in other.json()["detail"]


def test_the_start_up_summary_lists_every_model(srv):
    log = srv.log_path.read_text()  # all of it: srv.log() is its tail
    for name in (STUDENT, TEACHER):
        assert re.search(rf"  model +{re.escape(name)} on cpu \(float32, ", log), name


def test_an_import_goes_to_the_base_model_its_adapter_names(srv):
    with srv.client(KEY) as sc:
        tc = sc.create_lora_training_client(base_model=TEACHER, rank=4).result()
        saved = checkpoint_dir(srv, tc.save_state("to-import").result().path)
    ours = {p.name: p.read_bytes() for p in saved.iterdir()}  # with its manifest: trained on TEACHER
    peft_config = json.loads(ours["adapter_config.json"])

    def peft(base: str) -> bytes:  # a plain PEFT adapter naming `base`
        return tar_bytes({"adapter_config.json": json.dumps({**peft_config, "base_model_name_or_path": base}).encode(),
                     "adapter_model.safetensors": ours["adapter_model.safetensors"]})

    url = f"{srv.base_url}/api/v1/checkpoints/import"
    with httpx.Client(timeout=60, headers={"X-API-Key": KEY}) as http:
        def base_of(answer: httpx.Response) -> str:
            assert answer.status_code == 200, answer.text
            return http.get(f"{srv.base_url}/api/v1/training_runs/{answer.json()['training_run_id']}").json()[
                "base_model"]

        assert base_of(http.post(url, params={"name": "ours"}, content=tar_bytes(ours))) == TEACHER
        student_run = http.post(url, params={"name": "peft"}, content=peft(STUDENT))
        assert base_of(student_run) == STUDENT  # same shapes: the name it gives decides
        elsewhere = http.post(url, params={"name": "elsewhere"}, content=peft("org/elsewhere"))
        assert elsewhere.status_code == 400 and elsewhere.json()["detail"] == (
            f"cannot import this adapter: it is for base model 'org/elsewhere', which this server does not serve "
            f"(it serves '{STUDENT}', '{TEACHER}'); set base_model_name_or_path in its adapter_config.json to the "
            "served model it fits")
        into_other = http.post(url, params={"name": "mixed", "training_run_id": student_run.json()["training_run_id"]},
                               content=tar_bytes(ours))
        assert into_other.status_code == 400 and "import it into a run of its own base model" in into_other.text


def sample_requests(srv) -> dict[str, float]:
    """Sample requests (asample: sampling and compute_logprobs) each served model has answered."""
    text = httpx.get(f"{srv.base_url}/metrics", timeout=30).text
    return {name: float(value) for name, value in
            re.findall(r'^hosted_tinker_sample_requests_total\{base_model="([^"]+)"\} (\S+)$', text, re.M)}


def test_on_policy_distillation_runs_unchanged_with_a_different_teacher(srv, hub, tmp_path):
    pytest.importorskip("tinker_cookbook")
    hf_home, _ = hub
    log_path = tmp_path / "distill"
    env = {**os.environ, **offline_env(hf_home), "TINKER_API_KEY": KEY, "TINKER_BASE_URL": srv.base_url}
    before = sample_requests(srv)
    proc = subprocess.run([sys.executable, "-m", "tinker_cookbook.recipes.distillation.on_policy_distillation",
                           f"model_name={STUDENT}", f"teacher_model={TEACHER}", "dataset=deepmath",
                           "group_size=2", "groups_per_batch=2", "max_tokens=8", "max_steps=2", "lora_rank=8",
                           "learning_rate=1e-3", "eval_every=0", "save_every=0", f"base_url={srv.base_url}",
                           f"log_path={log_path}", "behavior_if_log_dir_exists=delete"],
                          env=env, capture_output=True, text=True, timeout=900, stdin=subprocess.DEVNULL)
    assert proc.returncode == 0, f"{proc.stdout[-3000:]}\n{proc.stderr[-6000:]}\nserver:\n{srv.log()}"
    steps = [row for row in map(json.loads, (log_path / "metrics.jsonl").read_text().splitlines())
             if "teacher_kl" in row]
    assert len(steps) == 2
    # Each of the 2 steps x 2 groups x 2 samples was sampled by the student and scored by the teacher
    # (compute_logprobs), each on its own model.
    after = sample_requests(srv)
    assert after[STUDENT] - before[STUDENT] >= 8 and after[TEACHER] - before[TEACHER] >= 8, (before, after)
    # A teacher with the student's own weights would score the samples with the sampler's own
    # logprobs: a KL of 0 (to ~1e-7, as the recipe's kl_sample_train). Measured here: 0.06, -0.01.
    assert any(abs(row["teacher_kl"]) > 1e-5 for row in steps), steps
