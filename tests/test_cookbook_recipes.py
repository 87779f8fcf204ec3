"""Cookbook recipes with sampling run unchanged against the server (issue 4, test 5).

math_rl (arithmetic, importance_sampling) samples with the server's engine and trains on the
rewards; chat_sl trains on a local JSONL of conversations; sdft distils the model into itself
through its teacher's top-K prompt logprobs, with (N, K) cross_entropy targets (forward KL) or a
custom loss on (N, K) logprobs (reverse KL), from a local ToolAlpaca-format data set (issue 27).
The model is a tiny one served under a cookbook-known name from a fake Hugging Face cache (see
test_cookbook_sl_loop.py).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from offline_hub import install_fake_hub_model, offline_env
from server_process import ServerProcess

pytestmark = pytest.mark.e2e
cookbook = pytest.importorskip("tinker_cookbook")

MODEL = "Qwen/Qwen3-8B"


@pytest.fixture(scope="module")
def cookbook_server(tmp_path_factory):
    root = tmp_path_factory.mktemp("cookbook")
    hf_home = root / "hf"
    install_fake_hub_model(hf_home, MODEL)
    env = {**os.environ, **offline_env(hf_home), "TINKER_API_KEY": "tml-cookbook"}
    srv = ServerProcess(root / "srv", base_model=MODEL, env=env).start()
    yield srv, {**env, "TINKER_BASE_URL": srv.base_url}
    srv.stop()


def run_recipe(module: str, args: list[str], env: dict, srv) -> None:
    proc = subprocess.run([sys.executable, "-m", module, *args], env=env, capture_output=True, text=True,
                          timeout=600, stdin=subprocess.DEVNULL)
    assert proc.returncode == 0, f"{proc.stdout[-3000:]}\n{proc.stderr[-6000:]}\nserver:\n{srv.log()}"


def metrics(log_path: Path) -> list[dict]:
    return [json.loads(line) for line in (log_path / "metrics.jsonl").read_text().splitlines()]


def test_math_rl_arithmetic_importance_sampling(cookbook_server, tmp_path):
    srv, env = cookbook_server
    log_path = tmp_path / "math_rl"
    run_recipe("tinker_cookbook.recipes.math_rl.train", [
        f"base_url={srv.base_url}", f"model_name={MODEL}", "env=arithmetic", "loss_fn=importance_sampling",
        "group_size=4", "groups_per_batch=4", "max_tokens=5", "max_steps=3", "lora_rank=8",
        "learning_rate=1e-3", "eval_every=0", "save_every=0", f"log_path={log_path}",
        "behavior_if_log_dir_exists=delete"], env, srv)
    rows = metrics(log_path)
    steps = [r for r in rows if any(k.startswith("env/all/reward") for k in r)]
    assert len(steps) == 3, rows[-1].keys()
    # it really sampled: token counts come from the server's samples
    assert all(r.get("env/all/ac_tokens_per_turn", 0) > 0 for r in steps)


def test_chat_sl_on_a_local_jsonl(cookbook_server, tmp_path):
    srv, env = cookbook_server
    data = Path(cookbook.__file__).parent / "example_data" / "conversations.jsonl"
    assert data.is_file()
    log_path = tmp_path / "chat_sl"
    run_recipe("tinker_cookbook.recipes.chat_sl.train", [
        f"base_url={srv.base_url}", f"model_name={MODEL}", f"dataset={data}", "batch_size=8", "max_steps=4",
        "lora_rank=8", "learning_rate=3e-3", "eval_every=0", "save_every=0", "infrequent_eval_every=0",
        f"log_path={log_path}", "behavior_if_log_dir_exists=delete", "max_length=512"], env, srv)
    rows = [r for r in metrics(log_path) if "train_mean_nll" in r]
    assert len(rows) == 4
    assert rows[-1]["train_mean_nll"] < rows[0]["train_mean_nll"]


@pytest.fixture(scope="module")
def toolalpaca(tmp_path_factory) -> Path:
    """A local stand-in for the SDFT paper's ToolAlpaca Arrow data (`toolalpaca_data_path`)."""
    from datasets import Dataset

    path = tmp_path_factory.mktemp("toolalpaca") / "train_data"
    rows = [(f"What is {a} plus {b}?", f"{a} plus {b} is {a + b}.") for a, b in [(2, 3), (7, 1), (4, 4), (9, 6)]]
    Dataset.from_dict({"prompt": [q for q, _ in rows], "golden_response": [g for _, g in rows]}).save_to_disk(path)
    return path


@pytest.mark.parametrize("reverse", [False, True], ids=["topk_cross_entropy", "reverse_kl_custom_loss"])
def test_sdft_distils_through_topk_targets(cookbook_server, toolalpaca, tmp_path, reverse):
    srv, env = cookbook_server
    log_path = tmp_path / "sdft"
    run_recipe("tinker_cookbook.recipes.sdft.train", [
        f"base_url={srv.base_url}", f"model_name={MODEL}", "dataset=toolalpaca",
        f"toolalpaca_data_path={toolalpaca}", "groups_per_batch=2", "max_tokens=6", "max_steps=2", "topk=5",
        f"reverse={reverse}", "lora_rank=8", "learning_rate=1e-3", "eval_every=0", "save_every=0",
        "max_context_length=512", f"log_path={log_path}", "behavior_if_log_dir_exists=delete"], env, srv)
    rows = [r for r in metrics(log_path) if "sdft/topk" in r]
    assert len(rows) == 2 and all(r["sdft/topk"] == 5 for r in rows)
    # the teacher's top-K reached the student: completion positions with (N, 5) targets were trained
    key = "sdft/reverse_kl_positions" if reverse else "sdft/total_completion_tokens"
    assert all(r.get(key, 0) > 0 for r in rows), rows
