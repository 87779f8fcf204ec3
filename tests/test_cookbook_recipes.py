"""Cookbook recipes with sampling run unchanged against the server (issue 4, test 5).

math_rl (arithmetic, importance_sampling) samples with the server's engine and trains on the
rewards; chat_sl trains on a local JSONL of conversations; sdft distils the model into itself
through its teacher's top-K prompt logprobs, with (N, K) cross_entropy targets (forward KL) or a
custom loss on (N, K) logprobs (reverse KL), from a local ToolAlpaca-format data set; the decisions
recipes score their choices with target_prompt_logprobs and train a Brier loss on (N, K) logprobs,
on a small stand-in for the Prophet Arena CSV (issue 27); vlm_classifier trains a tiny Qwen3.5 (the
recipe's default family: linear-attention layers, a vision tower) on images from a stand-in for its
caltech101 data set and evaluates it by sampling with images and by compute_logprobs (issue 23). The models are tiny ones served under cookbook-known names from a fake
Hugging Face cache (see test_cookbook_sl_loop.py).
"""

from __future__ import annotations

import csv
import json
import math
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from offline_hub import install_fake_dataset, install_fake_hub_model, install_hub_snapshot, offline_env
from server_process import ServerProcess
from tiny_vl_model import build_tiny_vl_model

pytestmark = pytest.mark.e2e
cookbook = pytest.importorskip("tinker_cookbook")

MODEL = "Qwen/Qwen3-8B"
VL_MODEL = "Qwen/Qwen3.5-4B"  # dense, like the tiny one; the recipe's default renderer is Qwen3.5's


@pytest.fixture(scope="module")
def cookbook_server(tmp_path_factory):
    root = tmp_path_factory.mktemp("cookbook")
    hf_home = root / "hf"
    install_fake_hub_model(hf_home, MODEL)
    install_hub_snapshot(hf_home, VL_MODEL, build_tiny_vl_model(root / "tiny-qwen3_5", family="qwen3_5"))
    install_caltech101_stand_in(hf_home)
    env = {**os.environ, **offline_env(hf_home), "TINKER_API_KEY": "tml-cookbook"}
    srv = ServerProcess(root / "srv", base_model=MODEL, env=env, args=("--base-model", VL_MODEL)).start()
    yield srv, {**env, "TINKER_BASE_URL": srv.base_url}
    srv.stop()


def run_recipe(module: str, args: list[str], env: dict, srv, stdin: str = "") -> subprocess.CompletedProcess:
    proc = subprocess.run([sys.executable, "-m", module, *args], env=env, capture_output=True, text=True,
                          timeout=600, input=stdin)
    assert proc.returncode == 0, f"{proc.stdout[-3000:]}\n{proc.stderr[-6000:]}\nserver:\n{srv.log()}"
    return proc


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


def test_decisions_demo_routes_questions(cookbook_server):
    srv, env = cookbook_server
    proc = run_recipe("tinker_cookbook.recipes.decisions.demo", [f"model_name={MODEL}"], env, srv,
                      stdin="How do I pick a learning rate for LoRA?\nWhere do I find my invoices?\n")
    answers = [json.loads(a) for a in re.findall(r"\{[^{}]*\}", proc.stdout)]
    assert len(answers) == 2, proc.stdout
    for probabilities in answers:
        assert list(probabilities) == ["billing", "sdk", "console", "cookbook"]
        assert sum(probabilities.values()) == pytest.approx(1.0, abs=1e-3)


def prophet_arena_stand_in(path: Path) -> Path:
    """A few markets in the Prophet Arena CSV's columns: training events close before the recipe's
    default split date (2025-10-20), validation events open after it."""
    def row(i: int, snapshot: str, close: str) -> dict:
        markets = [f"Team {i} wins", f"Team {i} scores first"]
        return {"submission_id": f"s{i}", "event_ticker": f"EV{i}", "title": f"Match {i}", "category": "Sports",
                "snapshot_time": snapshot, "close_time": close, "markets": json.dumps(markets),
                "market_outcome": json.dumps({m: (i + j) % 2 for j, m in enumerate(markets)}),
                "sources": json.dumps([{"title": f"Preview {i}", "summary": "Both teams are in form."}])}
    rows = [row(i, "2025-08-01T00:00:00Z", "2025-09-01T00:00:00Z") for i in range(4)]
    rows += [row(i, "2025-11-01T00:00:00Z", "2025-12-01T00:00:00Z") for i in range(4, 6)]
    with path.open("w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=list(rows[0]))
        writer.writeheader()
        writer.writerows(rows)
    return path


def run_decisions_forecasting(cookbook_server, tmp_path, max_steps: int) -> list[dict]:
    srv, env = cookbook_server
    log_path = tmp_path / "decisions_forecasting"
    run_recipe("tinker_cookbook.recipes.decisions.forecasting", [
        f"model_name={MODEL}", f"data_path={prophet_arena_stand_in(tmp_path / 'prophet.csv')}", "lora_rank=8",
        "batch_size=4", f"max_steps={max_steps}", "learning_rate=1e-3", "eval_every=0",
        f"log_path={log_path}", "behavior_if_log_dir_exists=delete"], env, srv)
    return metrics(log_path)


def test_decisions_forecasting_scores_the_validation_markets(cookbook_server, tmp_path):
    """Its evaluation: one target_prompt_logprobs request per validation market (no training step)."""
    rows = run_decisions_forecasting(cookbook_server, tmp_path, max_steps=0)
    scored = [r for r in rows if "test/brier_reward" in r]
    assert len(scored) == 1 and 0.0 <= scored[0]["test/accuracy"] <= 1.0


def test_decisions_forecasting_trains_with_a_brier_loss(cookbook_server, tmp_path):
    rows = run_decisions_forecasting(cookbook_server, tmp_path, max_steps=2)
    assert len([r for r in rows if "train/loss" in r]) == 2
    assert len([r for r in rows if "test/brier_reward" in r]) == 2  # before and after training


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


def install_caltech101_stand_in(hf_home: Path) -> None:
    """`dpdl-benchmark/caltech101` as vlm_classifier loads it: an Image column and a ClassLabel
    column (the recipe names classes with int2str), train and test splits of 64x64 noise images
    (4 tokens each for the tiny model's processor)."""
    import datasets
    import numpy as np
    from PIL import Image

    features = datasets.Features({"image": datasets.Image(),
                                  "label": datasets.ClassLabel(names=["Faces_easy", "airplanes", "Motorbikes"])})
    for split, n, seed in [("train", 8, 0), ("test", 2, 1)]:
        rng = np.random.default_rng(seed)
        rows = [{"image": Image.fromarray(rng.integers(0, 256, (64, 64, 3), dtype=np.uint8)), "label": i % 3}
                for i in range(n)]
        install_fake_dataset(hf_home, "dpdl-benchmark/caltech101", rows, split, features=features)


def test_vlm_classifier_trains_on_images_and_evaluates(cookbook_server, tmp_path):
    """Two steps of 4 image examples; before the first, the recipe's classifier evaluator samples a
    class name for each test image and the NLL evaluator scores the test examples (compute_logprobs)."""
    srv, env = cookbook_server
    run_recipe("tinker_cookbook.recipes.vlm_classifier.train", [
        f"base_url={srv.base_url}", f"model_name={VL_MODEL}",
        "dataset=caltech101", "batch_size=4", "num_epochs=1", "lora_rank=8", "learning_rate=1e-3",
        "eval_every=2", "save_every=0", "n_eval=2", "max_tokens=8", f"experiment_dir={tmp_path}",
        "behavior_if_log_dir_exists=delete"], env, srv)
    (log_path,) = [p.parent for p in tmp_path.glob("*/metrics.jsonl")]  # the recipe names its run
    rows = [r for r in metrics(log_path) if "train_mean_nll" in r]
    assert len(rows) == 2 and all(math.isfinite(r["train_mean_nll"]) for r in rows), rows
    assert all(r["num_sequences"] == 4 for r in rows)
    assert 0.0 <= rows[0]["accuracy"] <= 1.0 and math.isfinite(rows[0]["test/nll"]), rows[0]
