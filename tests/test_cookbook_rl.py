"""The cookbook's RL recipes, unchanged, with their default loss (stable_reinforce) against the
server: math_rl on the arithmetic environment (where the reward must rise), rl_loop on GSM8K, and
rubric with its LLM grader. Before SDK 0.38 support they failed at their first sample
("record_stability_info is not supported").

The model is the tiny embedded one, served under a cookbook name from a fake Hugging Face cache
(see test_cookbook_recipes.py), with one change: a random model of a ~1k vocabulary ends its
turn about once in 1000 tokens, so no sample of a few tokens would ever earn the arithmetic
environment's format reward and the reward could not move. `prime_stop_token` gives every
position the same bias towards `<|im_end|>` (measured: P(stop) 15-35% per position), so that
some one-token answers stop and RL has a signal to learn from. Measured in runs of the test
below, the mean reward of the first two steps was about -0.065 and of the last two about -0.025
(the reward is in [-0.1, 0] here: 0 for an answer that stops, -0.1 for one that does not).
"""

from __future__ import annotations

import json
import os
import random
import subprocess
import sys
from pathlib import Path

import pytest
from safetensors.torch import load_file, save_file

from offline_hub import install_fake_dataset, install_fake_hub_model, offline_env
from server_process import ServerProcess

pytestmark = pytest.mark.e2e
cookbook = pytest.importorskip("tinker_cookbook")

MODEL = "Qwen/Qwen3-8B"
STOP = "<|im_end|>"


def prime_stop_token(snapshot: Path, bias_dim: int = 0, read: float = 0.97) -> None:
    """Bias every position towards STOP: every token embedding gets +0.3 along one hidden dimension,
    which the residual stream carries to the final norm (about 6.2 there, the other dimensions
    about 0.6), and only STOP's unembedding row reads it (0.97 * 6.2: a logit about 6 above the others')."""
    vocab = json.loads((snapshot / "tokenizer.json").read_text())["added_tokens"]
    stop = next(t["id"] for t in vocab if t["content"] == STOP)
    weights = load_file(str(snapshot / "model.safetensors"))
    weights["model.embed_tokens.weight"][:, bias_dim] += 0.3
    weights["lm_head.weight"][:, bias_dim] = 0.0
    weights["lm_head.weight"][stop, bias_dim] = read
    save_file(weights, str(snapshot / "model.safetensors"), metadata={"format": "pt"})


def gsm8k_rows(n: int, seed: int) -> list[dict]:
    rng = random.Random(seed)
    rows = []
    for _ in range(n):
        x, y = rng.randint(1, 50), rng.randint(1, 50)
        rows.append({"question": f"Tom has {x} apples and buys {y} more. How many apples does he have?",
                     "answer": f"He has {x} + {y} = {x + y} apples.\n#### {x + y}"})
    return rows


@pytest.fixture(scope="module")
def rl_server(tmp_path_factory):
    root = tmp_path_factory.mktemp("cookbook-rl")
    hf_home = root / "hf"
    prime_stop_token(install_fake_hub_model(hf_home, MODEL))
    install_fake_dataset(hf_home, "openai/gsm8k", gsm8k_rows(32, 0), "train", config_name="main")
    install_fake_dataset(hf_home, "openai/gsm8k", gsm8k_rows(8, 1), "test", config_name="main")
    env = {**os.environ, **offline_env(hf_home), "TINKER_API_KEY": "tml-cookbook-rl"}
    srv = ServerProcess(root / "srv", base_model=MODEL, env=env).start()
    yield srv, {**env, "TINKER_BASE_URL": srv.base_url}
    srv.stop()


def run_recipe(module: str, args: list[str], env: dict, srv, cwd: Path) -> None:
    proc = subprocess.run([sys.executable, "-m", module, f"base_url={srv.base_url}", f"model_name={MODEL}", *args],
                          env=env, cwd=cwd, capture_output=True, text=True, timeout=900, stdin=subprocess.DEVNULL)
    assert proc.returncode == 0, f"{proc.stdout[-3000:]}\n{proc.stderr[-6000:]}\nserver:\n{srv.log()}"


def metrics(log_path: Path) -> list[dict]:
    return [json.loads(line) for line in (log_path / "metrics.jsonl").read_text().splitlines()]


def trained_with_stable_reinforce(srv) -> int:
    """forward_backward requests the server accepted (the recipes send only stable_reinforce)."""
    return srv.log_path.read_text().count("route=/api/v1/forward_backward status=200")


def test_math_rl_arithmetic_default_loss_raises_the_reward(rl_server, tmp_path):
    srv, env = rl_server
    log_path = tmp_path / "math_rl"
    trained_before = trained_with_stable_reinforce(srv)
    run_recipe("tinker_cookbook.recipes.math_rl.train", [
        "env=arithmetic", "group_size=8", "groups_per_batch=8", "max_tokens=1", "max_steps=6", "lora_rank=8",
        "learning_rate=5e-3", "eval_every=0", "save_every=0", f"log_path={log_path}",
        "behavior_if_log_dir_exists=delete"], env, srv, tmp_path)
    steps = [r for r in metrics(log_path) if "env/all/reward/total" in r]
    rewards = [r["env/all/reward/total"] for r in steps]
    assert len(rewards) == 6 and trained_with_stable_reinforce(srv) > trained_before
    # the format reward (-0.1 unless the answer ends with <|im_end|>) climbs as stopping is learned
    assert sum(rewards[-2:]) / 2 > sum(rewards[:2]) / 2 + 0.02, rewards


def test_rl_loop_default_loss_completes(rl_server, tmp_path):
    """rl_loop samples with record_stability_info=True and, when a group's rewards differ, trains
    with its own provenance (its datums are covered by test_stable_reinforce_e2e.py: a random
    model never writes a \\boxed{} answer, so GSM8K's reward is 0 here)."""
    srv, env = rl_server
    log_path = tmp_path / "rl_loop"
    run_recipe("tinker_cookbook.recipes.rl_loop", [
        "batch_size=2", "group_size=2", "max_tokens=8", "max_steps=2", "lora_rank=8", "save_every=0",
        f"log_path={log_path}"], env, srv, tmp_path)
    steps = [r for r in metrics(log_path) if "reward/total" in r]
    assert len(steps) == 2


def test_rubric_default_loss_trains(rl_server, tmp_path):
    """rubric with its default data paths (generated by the cookbook's own generate_data), its
    default loss and a grader LLM served by the same server."""
    from tinker_cookbook.recipes.rubric.generate_data import generate_dataset

    srv, env = rl_server
    (tmp_path / "tinker_cookbook" / "example_data").mkdir(parents=True)
    generate_dataset(num_train=8, num_test=2, seed=0, write_dir=str(tmp_path / "tinker_cookbook" / "example_data"))
    log_path = tmp_path / "rubric"
    trained_before = trained_with_stable_reinforce(srv)
    run_recipe("tinker_cookbook.recipes.rubric.train", [
        "renderer_name=qwen3_disable_thinking", f"grader_llm_name={MODEL}",
        "grader_renderer_name=qwen3_disable_thinking", "groups_per_batch=2", "max_steps=2", "lora_rank=8",
        "max_tokens=8", "eval_every=0", "save_every=0", f"log_path={log_path}",
        "behavior_if_log_dir_exists=delete"], env, srv, tmp_path)
    steps = [r for r in metrics(log_path) if "env/all/reward/total" in r]
    assert len(steps) == 2 and trained_with_stable_reinforce(srv) > trained_before


def test_cookbook_datum_builders_train_with_stable_reinforce(rl_server):
    """The cookbook's own datum builders against recorded samples: rl_loop's with_sampled_provenance
    (the path its GSM8K run cannot reach with a random model) and rl/data_processing's
    trajectory_to_data on a two-turn trajectory, where turn 2's observation extends turn 1's."""
    from tinker import types
    from tinker_cookbook.completers import TokensWithLogprobs
    from tinker_cookbook.recipes.rl_loop import with_sampled_provenance
    from tinker_cookbook.rl.data_processing import trajectory_to_data
    from tinker_cookbook.rl.types import Trajectory, Transition

    srv, _ = rl_server
    with srv.client("tml-cookbook-rl") as sc:
        tc = sc.create_lora_training_client(base_model=MODEL, rank=8).result()
        sampler = tc.save_weights_and_get_sampling_client(record_stability_info=True).result()
        params = types.SamplingParams(max_tokens=4, stop=[])
        ob1 = types.ModelInput.from_ints(list(range(200, 212)))
        first = sampler.sample(ob1, 2, params).result().sequences
        data = []
        for seq, adv in zip(first, (0.5, -0.5)):  # exactly as recipes/rl_loop.py builds them
            ob_len = ob1.length - 1
            datum = types.Datum(
                model_input=ob1.append(types.EncodedTextChunk(tokens=seq.tokens[:-1])),
                loss_fn_inputs={"target_tokens": [0] * ob_len + seq.tokens, "logprobs": [0.0] * ob_len + seq.logprobs,
                                "advantages": [0.0] * ob_len + [adv] * len(seq.tokens)})
            data.append(with_sampled_provenance(datum, ob1.length, len(seq.tokens), seq.sequence_id))
        ob2 = types.ModelInput.from_ints(ob1.to_ints() + list(first[0].tokens) + [300, 301])
        second = sampler.sample(ob2, 1, params).result().sequences[0]
        trajectory = Trajectory(transitions=[
            Transition(ob=ob, ac=TokensWithLogprobs(tokens=list(s.tokens), maybe_logprobs=list(s.logprobs),
                                                    sequence_id=s.sequence_id), reward=0.0, episode_done=i == 1)
            for i, (ob, s) in enumerate(((ob1, first[0]), (ob2, second)))], final_ob=ob2)
        (multi_turn,) = trajectory_to_data(trajectory, traj_advantage=1.0)
        assert sum(isinstance(s, types.SampledProvenanceSpan) for s in multi_turn.loss_fn_input_spans) == 2
        multi_turn = types.Datum(model_input=multi_turn.model_input,  # rl/train.py strips the mask
                                 loss_fn_inputs={k: v for k, v in multi_turn.loss_fn_inputs.items() if k != "mask"},
                                 model_input_spans=multi_turn.model_input_spans,
                                 loss_fn_input_spans=multi_turn.loss_fn_input_spans)
        out = tc.forward_backward(data + [multi_turn], "stable_reinforce").result()
        assert out.metrics["sampled_tokens:sum"] == 2 * 4 + 4 + 4
        assert out.metrics["datum_logprobs_mismatch:max"] == 0.0
        tc.optim_step(types.AdamParams(learning_rate=1e-3)).result()
