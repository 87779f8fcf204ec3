"""Checkpoints leave and enter the server as plain files.

`hosted-tinker export` (from a running server, or from its data directory) writes a PEFT adapter
directory; imported into a *fresh* server with `hosted-tinker import`, it reproduces the source's
logprobs exactly through `create_training_client_from_state`, optimizer state included. `--merged`
writes a full model that transformers loads alone. A PEFT adapter made outside the server imports
the same way, and adapters the server cannot load exactly are refused up front with a clear 400.
"""

from __future__ import annotations

import io
import json
import os
import subprocess
import sys
import tarfile
from pathlib import Path

import httpx
import numpy as np
import pytest
import tinker
import torch
from safetensors.torch import load_file, save_file
from tinker import types

from helpers import BASE_MODEL, logprobs_of, model_dir, sft_batch
from hosted_tinker.export import ExportError, export_checkpoint, import_adapter
from server_process import ServerProcess

pytestmark = pytest.mark.e2e
KEY_A, KEY_B = "tml-export-source", "tml-export-fresh"
ADAM = types.AdamParams(learning_rate=2e-2)


def hosted_tinker(*args: str, server, key: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "TINKER_BASE_URL": server.base_url, "TINKER_API_KEY": key}
    return subprocess.run([sys.executable, "-m", "hosted_tinker", *args], env=env, capture_output=True, text=True,
                          timeout=300)


def ok(proc: subprocess.CompletedProcess) -> str:
    assert proc.returncode == 0, proc.stdout + proc.stderr
    return proc.stdout.strip()


def token_logprobs(model, batch) -> list[np.ndarray]:
    out = []
    with torch.no_grad():
        for d in batch:
            ids = torch.tensor(d.model_input.to_ints())[None]
            targets = torch.tensor(d.loss_fn_inputs["target_tokens"].to_numpy()).long()
            logits = model(input_ids=ids, use_cache=False).logits[0].float()
            out.append(torch.log_softmax(logits, -1).gather(-1, targets[:, None])[:, 0].numpy())
    return out


@pytest.fixture(scope="module")
def fresh(tmp_path_factory):
    """A second server that has never seen the source's checkpoints."""
    srv = ServerProcess(tmp_path_factory.mktemp("fresh-server")).start()
    yield srv
    srv.stop()


@pytest.fixture(scope="module")
def source(server):
    sc = tinker.ServiceClient(base_url=server.base_url, api_key=KEY_A)
    tc = sc.create_lora_training_client(base_model=BASE_MODEL, rank=8, seed=4).result()
    for i in range(3):
        tc.forward_backward(sft_batch(4, seed=40 + i), "cross_entropy").result()
        tc.optim_step(ADAM).result()
    return sc, tc, tc.save_state("exported").result().path


@pytest.fixture(scope="module")
def peft_dir(fresh, tmp_path_factory):
    """A LoRA adapter made with PEFT itself (q_proj + v_proj, r=4, alpha=8), with its own logprobs."""
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    base = AutoModelForCausalLM.from_pretrained(str(model_dir(fresh)), dtype=torch.float32)
    model = get_peft_model(base, LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"], lora_dropout=0.0))
    gen = torch.Generator().manual_seed(8)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.copy_(torch.randn(p.shape, generator=gen) * 0.3)
    model.eval()
    out = tmp_path_factory.mktemp("peft") / "adapter"
    model.save_pretrained(str(out))
    batch = sft_batch(3, seed=50)
    return out, batch, token_logprobs(model, batch)


def test_export_then_import_on_a_fresh_server_is_exact(server, fresh, source, tmp_path):
    sc, tc, path = source
    out = tmp_path / "adapter"
    assert ok(hosted_tinker("export", path, "--out", str(out), server=server, key=KEY_A)) == str(out)
    assert {p.name for p in out.iterdir()} == {"adapter_config.json", "adapter_model.safetensors", "manifest.json",
                                               "optimizer.safetensors"}
    assert all(k.startswith("base_model.model.") for k in load_file(str(out / "adapter_model.safetensors")))
    # the same files straight from the data directory (`--data-dir`), no server involved
    local = export_checkpoint(path, tmp_path / "local", data_dir=server.data_dir)
    for f in out.iterdir():
        assert (local / f.name).read_bytes() == f.read_bytes()
    # another key cannot export it, and nothing is left behind
    with pytest.raises(ExportError, match="404.*not found"):
        export_checkpoint(path, tmp_path / "theirs", base_url=server.base_url, api_key="tml-someone-else")
    assert not (tmp_path / "theirs").exists()

    imported = ok(hosted_tinker("import", str(out), "--name", "back", server=fresh, key=KEY_B))
    assert imported.startswith("tinker://import-") and imported.endswith("/weights/back")
    sc_b = tinker.ServiceClient(base_url=fresh.base_url, api_key=KEY_B)
    batch = sft_batch(4, seed=31)
    want = logprobs_of(tc.forward(batch, "cross_entropy").result())
    got = logprobs_of(sc_b.create_training_client_from_state(imported).result().forward(batch, "cross_entropy").result())
    for a, b in zip(want, got):
        np.testing.assert_array_equal(a, b)
    # the optimizer state came along: the same next step on both servers lands on the same weights
    a = sc.create_training_client_from_state_with_optimizer(path).result()
    b = sc_b.create_training_client_from_state_with_optimizer(imported).result()
    for client in (a, b):
        client.forward_backward(batch, "cross_entropy").result()
        client.optim_step(ADAM).result()
    for x, y in zip(logprobs_of(a.forward(batch, "cross_entropy").result()),
                    logprobs_of(b.forward(batch, "cross_entropy").result())):
        np.testing.assert_array_equal(x, y)
    # the fresh server lists the imported run and checkpoint like any other
    rest = tinker.RestClient(base_url=fresh.base_url, api_key=KEY_B)
    run_id = imported.split("/")[2]
    run = rest.get_training_run(run_id).result()
    assert run.lora_rank == 8 and run.base_model == BASE_MODEL and run.last_checkpoint.tinker_path == imported
    assert rest.get_weights_info_by_tinker_path(imported).result().lora_rank == 8


def test_merged_export_is_a_standalone_model(server, source, tmp_path):
    from transformers import AutoModelForCausalLM

    _, tc, path = source
    out = export_checkpoint(path, tmp_path / "merged", merged=True, base_url=server.base_url, api_key=KEY_A)
    assert (out / "config.json").is_file() and (out / "tokenizer.json").is_file()
    weights = {}
    for f in out.glob("*.safetensors"):
        weights.update(load_file(str(f)))
    assert weights and not any("lora" in k for k in weights)
    model = AutoModelForCausalLM.from_pretrained(str(out), dtype=torch.float32).eval()
    batch = sft_batch(4, seed=32)
    want = logprobs_of(tc.forward(batch, "cross_entropy").result())
    for a, b in zip(token_logprobs(model, batch), want):
        np.testing.assert_allclose(a, b, atol=1e-4, rtol=0)


def test_peft_made_adapter_imports_and_trains(fresh, peft_dir):
    adapter, batch, want = peft_dir
    answer = import_adapter(adapter, name="peft-made", base_url=fresh.base_url, api_key=KEY_B)
    assert answer["lora_rank"] == 4 and answer["has_optimizer"] is False
    sc = tinker.ServiceClient(base_url=fresh.base_url, api_key=KEY_B)
    tc = sc.create_training_client_from_state(answer["tinker_path"]).result()
    assert tc.get_info().lora_rank == 4
    for a, b in zip(logprobs_of(tc.forward(batch, "cross_entropy").result()), want):
        np.testing.assert_allclose(a, b, atol=2e-5, rtol=0)
    info = tinker.RestClient(base_url=fresh.base_url, api_key=KEY_B).get_weights_info_by_tinker_path(
        answer["tinker_path"]).result()
    assert (info.lora_rank, info.train_attn, info.train_mlp, info.train_unembed) == (4, True, False, False)
    tc.forward_backward(batch, "cross_entropy").result()
    assert tc.optim_step(ADAM).result().metrics["grad_norm"] > 0
    # the trained continuation saves as an ordinary checkpoint that keeps the narrow targets
    saved = tc.save_state("peft-continued").result().path
    cfg = json.loads((fresh.data_dir / "checkpoints" / saved[len("tinker://"):] / "adapter_config.json").read_text())
    assert sorted(cfg["target_modules"]) == ["q_proj", "v_proj"]


def _tar(files: dict[str, bytes], extra: list[tarfile.TarInfo] = ()) -> bytes:
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w") as tar:
        for name, data in files.items():
            info = tarfile.TarInfo(name)
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))
        for info in extra:
            tar.addfile(info)
    return buf.getvalue()


def _bad_cases(adapter: Path) -> list[tuple[str, bytes, str]]:
    cfg = json.loads((adapter / "adapter_config.json").read_text())
    weights = (adapter / "adapter_model.safetensors").read_bytes()
    good = {"adapter_config.json": json.dumps(cfg).encode(), "adapter_model.safetensors": weights}
    link = tarfile.TarInfo("adapter_model.safetensors")
    link.type, link.linkname = tarfile.SYMTYPE, "/etc/passwd"
    tensors = load_file(str(adapter / "adapter_model.safetensors"))
    extra = dict(tensors)
    extra["base_model.model.model.embed_tokens.lora_A.weight"] = torch.zeros(4, 1024)
    some = {k: v for k, v in tensors.items() if ".layers.0." in k}

    def st(t: dict) -> bytes:
        path = adapter.parent / "tmp.safetensors"
        save_file({k: v.contiguous() for k, v in t.items()}, str(path))
        return path.read_bytes()

    return [
        ("not-a-tar", b"this is not a tar archive at all" * 40, "not a tar archive"),
        ("unsafe-path", _tar({"../adapter_config.json": good["adapter_config.json"],
                              "adapter_model.safetensors": weights}), "unsafe path"),
        ("absolute-path", _tar({"/tmp/adapter_config.json": good["adapter_config.json"]}), "unsafe path"),
        ("symlink", _tar({"adapter_config.json": good["adapter_config.json"]}, [link]), "not a regular file"),
        ("no-weights", _tar({"adapter_config.json": good["adapter_config.json"]}), "needs adapter_config.json"),
        ("pickle", _tar({"adapter_config.json": good["adapter_config.json"], "adapter_model.bin": b"\x80\x04"}),
         "pickle"),
        ("wrong-rank", _tar({**good, "adapter_config.json": json.dumps({**cfg, "r": 8}).encode()}), "do not fit"),
        ("foreign-module", _tar({**good, "adapter_model.safetensors": st(extra)}), "does not fit the served base model"),
        ("some-layers", _tar({**good, "adapter_model.safetensors": st(some)}), "leaves out"),
        ("dora", _tar({**good, "adapter_config.json": json.dumps({**cfg, "use_dora": True}).encode()}), "use_dora"),
        ("optimizer-without-manifest", _tar({**good, "optimizer.safetensors": weights}), "without the manifest.json"),
        ("bad-json", _tar({**good, "adapter_config.json": b"{not json"}), "not valid JSON"),
    ]


def test_bad_imports_are_refused_and_leave_nothing(fresh, peft_dir):
    adapter, _, _ = peft_dir
    url = f"{fresh.base_url}/api/v1/checkpoints/import"
    rest = tinker.RestClient(base_url=fresh.base_url, api_key=KEY_B)
    before = rest.list_user_checkpoints().result().cursor.total_count
    with httpx.Client(timeout=60, headers={"X-API-Key": KEY_B}) as http:
        for case, body, needle in _bad_cases(adapter):
            r = http.post(url, params={"name": f"bad-{case}"}, content=body)
            assert r.status_code == 400 and needle in r.json()["detail"], (case, r.status_code, r.text)
        r = http.post(url, params={"name": "empty"}, content=b"")
        assert r.status_code == 400 and "empty upload" in r.json()["detail"]
        good = _tar({n: (adapter / n).read_bytes() for n in ("adapter_config.json", "adapter_model.safetensors")})
        r = http.post(url, params={"name": "../escape"}, content=good)
        assert r.status_code == 400 and "invalid checkpoint name" in r.json()["detail"]
        # names are unique per run unless overwrite is asked for; another key's run is not found
        first = http.post(url, params={"name": "twice"}, content=good).json()
        run_id = first["training_run_id"]
        r = http.post(url, params={"name": "twice", "training_run_id": run_id}, content=good)
        assert r.status_code == 400 and "already exists" in r.json()["detail"]
        r = http.post(url, params={"name": "twice", "training_run_id": run_id, "overwrite": "true"}, content=good)
        assert r.status_code == 200 and r.json()["tinker_path"] == first["tinker_path"]
        r = http.post(url, params={"name": "mine", "training_run_id": run_id}, content=good,
                      headers={"X-API-Key": "tml-intruder"})
        assert r.status_code == 404
    assert rest.list_user_checkpoints().result().cursor.total_count == before + 1
    assert not any((fresh.data_dir / "uploads").iterdir())
