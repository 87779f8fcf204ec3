"""The `tinker` command-line tool against the server (TINKER_BASE_URL): `checkpoint list` shows
the checkpoints, and `checkpoint download` of a training state yields a PEFT adapter that
`peft.PeftModel.from_pretrained` loads on the base model and that reproduces the server's logprobs."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import tinker
import torch
from tinker import types

from helpers import BASE_MODEL, logprobs_of, model_dir, sft_batch
from tinker_cli import cli

pytestmark = pytest.mark.e2e
KEY = "tml-cli-user"


def run_cli(server, tmp_path: Path, *args: str):
    return cli(server.base_url, tmp_path, *args, key=KEY)  # HOME is tmp_path: no ~/.tinker credentials


@pytest.fixture(scope="module")
def trained(server):
    with server.client(KEY) as sc:
        tc = sc.create_lora_training_client(base_model=BASE_MODEL, rank=8, seed=2).result()
        for i in range(3):
            tc.forward_backward(sft_batch(4, seed=20 + i), "cross_entropy").result()
            tc.optim_step(types.AdamParams(learning_rate=2e-2)).result()
        state = tc.save_state("cli-state").result().path
        sampler = tc.save_weights_for_sampler("cli-sampler").result().path
        yield sc, tc, state, sampler


def test_checkpoint_list(server, trained, tmp_path):
    _, tc, state, sampler = trained
    listed = json.loads(run_cli(server, tmp_path, "--format", "json", "checkpoint", "list",
                                "--run-id", tc.model_id).stdout)
    assert listed["run_id"] == tc.model_id
    rows = {c["tinker_path"]: c for c in listed["checkpoints"]}
    assert set(rows) == {state, sampler}
    assert rows[state]["checkpoint_type"] == "training" and rows[sampler]["checkpoint_type"] == "sampler"
    assert rows[state]["size_bytes"] > rows[sampler]["size_bytes"] > 0
    # all of the user's checkpoints, as the default table
    table = run_cli(server, tmp_path, "checkpoint", "list").stdout
    assert "2 checkpoints" in table and "weights/cli-state" in table and "sampler_weights/cli-sampler" in table


def test_checkpoint_download_loads_in_peft_and_matches_server(server, trained, tmp_path):
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    sc, tc, state, _ = trained
    out = run_cli(server, tmp_path, "--format", "json", "checkpoint", "download", state, "--output", str(tmp_path / "dl"))
    dest = Path(json.loads(out.stdout)["destination"])
    assert dest == tmp_path / "dl" / state.replace("tinker://", "").replace("/", "_")
    files = {p.name for p in dest.iterdir()}
    assert {"adapter_config.json", "adapter_model.safetensors"} <= files and "optimizer.safetensors" not in files
    config = json.loads((dest / "adapter_config.json").read_text())
    assert config["r"] == 8 and config["peft_type"] == "LORA"
    # the temporary external export the CLI made for the download is gone again
    rest = tinker.RestClient(base_url=server.base_url, api_key=KEY)
    assert {c.checkpoint_type for c in rest.list_user_checkpoints().result().checkpoints} == {"training", "sampler"}

    batch = sft_batch(4, seed=99)
    want = logprobs_of(tc.forward(batch, "cross_entropy").result())
    base = AutoModelForCausalLM.from_pretrained(str(model_dir(server)), dtype=torch.float32)
    peft_model = PeftModel.from_pretrained(base, str(dest)).eval()
    with torch.no_grad():
        for datum, lp in zip(batch, want):
            ids = torch.tensor(datum.model_input.to_ints())[None]
            targets = torch.tensor(datum.loss_fn_inputs["target_tokens"].to_numpy()).long()
            logits = peft_model(input_ids=ids, use_cache=False).logits[0].float()
            got = torch.log_softmax(logits, -1).gather(-1, targets[:, None])[:, 0].numpy()
            np.testing.assert_allclose(got, lp, atol=2e-5, rtol=0)
    # and the adapter is not a no-op: the base model alone gives other logprobs
    with torch.no_grad(), peft_model.disable_adapter():
        ids = torch.tensor(batch[0].model_input.to_ints())[None]
        plain = torch.log_softmax(peft_model(input_ids=ids).logits[0].float(), -1)
    targets = torch.tensor(batch[0].loss_fn_inputs["target_tokens"].to_numpy()).long()
    assert not np.allclose(plain.gather(-1, targets[:, None])[:, 0].numpy(), want[0], atol=1e-3)
