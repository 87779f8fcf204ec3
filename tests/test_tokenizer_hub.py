"""`tc.get_tokenizer()` with no hub: the server answers the hub's file routes (HF_ENDPOINT=<server>).

The SDK resolves a tokenizer with `AutoTokenizer.from_pretrained(<base model name>)`. The client
runs in a fresh process (huggingface_hub reads HF_ENDPOINT at import) with an empty HF_HOME and
HF_ENDPOINT pointed at the server: everything it loads came from the server, nothing from a hub
(this machine has no route to one anyway). Covered: the embedded default (a name no hub has) and
a hub-named model the server loaded from its own offline cache.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import httpx
import pytest

from helpers import BASE_MODEL, model_dir
from offline_hub import install_fake_hub_model, offline_env
from server_process import ServerProcess

pytestmark = pytest.mark.e2e

CLIENT = """
import json, sys, tinker
base_url, base_model = sys.argv[1], sys.argv[2]
with tinker.ServiceClient(base_url=base_url, api_key="tml-tokenizer") as sc:
    tc = sc.create_lora_training_client(base_model=base_model, rank=4).result()
    from_training = tc.get_tokenizer()
    from_sampling = sc.create_sampling_client(base_model=base_model).result().get_tokenizer()
    text = "Hello tokenizer, <think>hmm</think>"
    print(json.dumps({"training": from_training.encode(text), "sampling": from_sampling.encode(text),
                      "chat": from_training.apply_chat_template([{"role": "user", "content": "hi"}], tokenize=False)}))
"""


def tokenize_through_server(server: ServerProcess, base_model: str, hf_home: Path) -> dict:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("HF_", "TRANSFORMERS_"))}
    env.update(HF_HOME=str(hf_home), HF_ENDPOINT=server.base_url, TINKER_TELEMETRY="0",
               HF_HUB_DISABLE_TELEMETRY="1")
    out = subprocess.run([sys.executable, "-c", CLIENT, server.base_url, base_model], env=env, capture_output=True,
                         text=True, timeout=180)
    assert out.returncode == 0, out.stderr[-3000:]
    return json.loads(out.stdout.strip().splitlines()[-1])


def expected(model_directory: Path) -> tuple[list[int], str]:
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(model_directory)
    return (tok.encode("Hello tokenizer, <think>hmm</think>"),
            tok.apply_chat_template([{"role": "user", "content": "hi"}], tokenize=False))


def test_get_tokenizer_of_the_embedded_default_comes_from_the_server(server, tmp_path):
    got = tokenize_through_server(server, BASE_MODEL, tmp_path / "hf")
    tokens, chat = expected(model_dir(server))
    assert got["training"] == got["sampling"] == tokens
    assert got["chat"] == chat
    cached = tmp_path / "hf" / "hub" / ("models--" + BASE_MODEL.replace("/", "--"))
    assert (next(cached.glob("snapshots/*")) / "tokenizer.json").is_file()  # cached like a hub download


def test_get_tokenizer_of_a_hub_model_served_from_the_servers_cache(tmp_path):
    server_hf = tmp_path / "server-hf"
    snapshot = install_fake_hub_model(server_hf, "Qwen/Qwen3-8B")
    srv = ServerProcess(tmp_path / "srv", base_model="Qwen/Qwen3-8B", env=offline_env(server_hf)).start()
    try:
        got = tokenize_through_server(srv, "Qwen/Qwen3-8B", tmp_path / "client-hf")
        tokens, chat = expected(snapshot)
        assert got["training"] == got["sampling"] == tokens and got["chat"] == chat
        # Tokenizer and config files only: no weights, and only the served model.
        weights = httpx.get(f"{srv.base_url}/Qwen/Qwen3-8B/resolve/main/model.safetensors", timeout=60)
        assert weights.status_code == 404 and weights.headers["x-error-code"] == "EntryNotFound"
        other = httpx.head(f"{srv.base_url}/Qwen/Qwen3-4B/resolve/main/tokenizer.json", timeout=60)
        assert other.status_code == 404 and other.headers["x-error-code"] == "RepositoryNotFound"
    finally:
        srv.stop()
