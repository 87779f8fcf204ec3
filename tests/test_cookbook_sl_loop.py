"""A cookbook recipe runs unchanged against the server (issue 2, test 6).

`tinker_cookbook.recipes.sl_loop` only accepts model names from the cookbook's table, so the
server serves a tiny model placed in a Hugging Face cache under the name `Qwen/Qwen3-8B`, and
the recipe's data set (no_robots) is a small synthetic copy in the datasets cache. Both load
offline through their normal code paths.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from offline_hub import install_fake_hub_model, install_fake_no_robots, offline_env
from server_process import ServerProcess

pytestmark = pytest.mark.e2e
pytest.importorskip("tinker_cookbook")

MODEL = "Qwen/Qwen3-8B"


def test_sl_loop_recipe_runs_to_completion(tmp_path):
    hf_home = tmp_path / "hf"
    install_fake_hub_model(hf_home, MODEL)
    install_fake_no_robots(hf_home, n_train=96, n_test=8)
    env = {**os.environ, **offline_env(hf_home), "TINKER_API_KEY": "tml-cookbook"}
    srv = ServerProcess(tmp_path / "srv", base_model=MODEL, env=env).start()
    log_path = tmp_path / "run"
    try:
        cmd = [sys.executable, "-m", "tinker_cookbook.recipes.sl_loop", f"base_url={srv.base_url}",
               f"model_name={MODEL}", f"log_path={log_path}", "batch_size=8", "lora_rank=8",
               "learning_rate=3e-3", "save_every=5", "max_length=256"]
        proc = subprocess.run(cmd, env={**env, "TINKER_BASE_URL": srv.base_url}, capture_output=True,
                              text=True, timeout=600, stdin=subprocess.DEVNULL)
        assert proc.returncode == 0, f"{proc.stdout[-3000:]}\n{proc.stderr[-5000:]}\nserver:\n{srv.log()}"
    finally:
        srv.stop()
    metrics = [json.loads(line) for line in (log_path / "metrics.jsonl").read_text().splitlines()]
    nll = [m["train_mean_nll"] for m in metrics if "train_mean_nll" in m]
    assert len(nll) == 12, nll  # 96 rows / batch 8: every batch ran
    assert sum(nll[-3:]) / 3 < sum(nll[:3]) / 3 - 0.5, nll  # loss falling
    checkpoints = [json.loads(line) for line in (log_path / "checkpoints.jsonl").read_text().splitlines()]
    final = [c for c in checkpoints if c.get("name") == "final"]
    assert final and final[0]["state_path"].startswith("tinker://") and final[0]["sampler_path"].startswith("tinker://")
