"""Checkpoints leave and enter the server as plain files.

`hosted-tinker export` (from a running server, or from its data directory) writes a PEFT adapter
directory; imported into a *fresh* server with `hosted-tinker import`, it reproduces the source's
logprobs exactly through `create_training_client_from_state`, optimizer state included. `--merged`
writes a full model that transformers loads alone. A PEFT adapter made outside the server imports
the same way, and adapters the server cannot load exactly are refused up front with a clear 400.
"""

from __future__ import annotations

import gzip
import hashlib
import io
import json
import math
import os
import re
import sqlite3
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

from helpers import BASE_MODEL, database, logprobs_of, model_dir, sft_batch, tar_bytes
from hosted_tinker.checkpoints.export import ExportError, export_checkpoint, import_adapter, merge_adapter
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
    with server.client(KEY_A) as sc:
        tc = sc.create_lora_training_client(base_model=BASE_MODEL, rank=8, seed=4).result()
        for i in range(3):
            tc.forward_backward(sft_batch(4, seed=40 + i), "cross_entropy").result()
            tc.optim_step(ADAM).result()
        yield sc, tc, tc.save_state("exported").result().path


def make_peft_adapter(server, out: Path, rank: int = 4):
    """A LoRA adapter made with PEFT itself on the server's base model (q_proj + v_proj,
    alpha = 2 * rank, random B), saved to `out`; returns the PEFT model."""
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    base = AutoModelForCausalLM.from_pretrained(str(model_dir(server)), dtype=torch.float32)
    model = get_peft_model(base, LoraConfig(r=rank, lora_alpha=2 * rank, target_modules=["q_proj", "v_proj"],
                                            lora_dropout=0.0))
    gen = torch.Generator().manual_seed(8)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.copy_(torch.randn(p.shape, generator=gen) * 0.3)
    model.eval()
    model.save_pretrained(str(out))
    return model


@pytest.fixture(scope="module")
def peft_dir(fresh, tmp_path_factory):
    """A LoRA adapter made with PEFT itself (q_proj + v_proj, r=4, alpha=8), with its own logprobs."""
    out = tmp_path_factory.mktemp("peft") / "adapter"
    model = make_peft_adapter(fresh, out)
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
    sc_b = fresh.client(KEY_B)
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
    sc = fresh.client(KEY_B)
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


def test_merged_export_merges_all_or_refuses_by_name(fresh, peft_dir, tmp_path):
    """`--merged` merges every LoRA of an adapter (one made with PEFT here: its merged model gives
    PEFT's logprobs) or none: a LoRA on a module the model does not have (an MoE expert's, on a
    dense model) or an adapter that leaves out layers of its targets is refused by name, never
    merged in part."""
    from transformers import AutoModelForCausalLM

    adapter, batch, want = peft_dir
    base = str(model_dir(fresh))
    merge_adapter(adapter, tmp_path / "merged", base_model=base, model_dir=None)
    model = AutoModelForCausalLM.from_pretrained(str(tmp_path / "merged"), dtype=torch.float32).eval()
    for a, b in zip(token_logprobs(model, batch), want):
        np.testing.assert_allclose(a, b, atol=2e-5, rtol=0)
    tensors = load_file(str(adapter / "adapter_model.safetensors"))
    expert = "base_model.model.model.layers.0.mlp.experts.w1"
    cases = {
        "it adapts 'model.layers.0.mlp.experts.w1', which is not a linear projection of this model": {
            **tensors, f"{expert}.lora_A.weight": torch.zeros(4, 4, 64), f"{expert}.lora_B.weight": torch.zeros(4, 64, 4)},
        "the adapter leaves out 'model.layers.1.self_attn.q_proj'": {
            k: v for k, v in tensors.items() if ".layers.1." not in k},
    }
    for i, (needle, case) in enumerate(cases.items()):
        bad = tmp_path / f"bad-{i}"
        bad.mkdir()
        (bad / "adapter_config.json").write_bytes((adapter / "adapter_config.json").read_bytes())
        save_file({k: v.contiguous() for k, v in case.items()}, str(bad / "adapter_model.safetensors"))
        with pytest.raises(ExportError, match=re.escape(needle)):
            merge_adapter(bad, tmp_path / f"merged-{i}", base_model=base, model_dir=None)


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
    nan = {k: v.clone().fill_(math.nan) if "lora_B" in k else v for k, v in tensors.items()}

    def st(t: dict) -> bytes:
        path = adapter.parent / "tmp.safetensors"
        save_file({k: v.contiguous() for k, v in t.items()}, str(path))
        return path.read_bytes()

    return [
        ("not-a-tar", b"this is not a tar archive at all" * 40, "not a tar archive"),
        ("unsafe-path", tar_bytes({"../adapter_config.json": good["adapter_config.json"],
                              "adapter_model.safetensors": weights}), "unsafe path"),
        ("absolute-path", tar_bytes({"/tmp/adapter_config.json": good["adapter_config.json"]}), "unsafe path"),
        ("symlink", tar_bytes({"adapter_config.json": good["adapter_config.json"]}, [link]), "not a regular file"),
        ("no-weights", tar_bytes({"adapter_config.json": good["adapter_config.json"]}), "needs adapter_config.json"),
        ("pickle", tar_bytes({"adapter_config.json": good["adapter_config.json"], "adapter_model.bin": b"\x80\x04"}),
         "pickle"),
        ("wrong-rank", tar_bytes({**good, "adapter_config.json": json.dumps({**cfg, "r": 8}).encode()}), "do not fit"),
        ("foreign-module", tar_bytes({**good, "adapter_model.safetensors": st(extra)}), "does not fit the served base model"),
        ("some-layers", tar_bytes({**good, "adapter_model.safetensors": st(some)}), "leaves out"),
        ("nan-weights", tar_bytes({**good, "adapter_model.safetensors": st(nan)}), "not finite (NaN or inf)"),
        ("dora", tar_bytes({**good, "adapter_config.json": json.dumps({**cfg, "use_dora": True}).encode()}), "use_dora"),
        ("optimizer-without-manifest", tar_bytes({**good, "optimizer.safetensors": weights}), "without the manifest.json"),
        ("bad-json", tar_bytes({**good, "adapter_config.json": b"{not json"}), "not valid JSON"),
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
        good = tar_bytes({n: (adapter / n).read_bytes() for n in ("adapter_config.json", "adapter_model.safetensors")})
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


def _manifest(data: dict[str, bytes], **changes) -> bytes:
    """A manifest.json for the PEFT adapter of `peft_dir` (r=4, q_proj + v_proj), with `changes`."""
    manifest = {
        "format": "hosted-tinker-lora/1", "base_model": BASE_MODEL, "step": 3, "has_optimizer": False,
        "lora_config": {"rank": 4, "seed": 0, "train_mlp": False, "train_attn": True, "train_unembed": False,
                        "alpha": 8.0, "target_modules": ["q_proj", "v_proj"]},
        "created_at": 1.7e9,
        "files": {n: {"bytes": len(b), "sha256": hashlib.sha256(b).hexdigest()} for n, b in data.items()},
    }
    for key, value in changes.items():
        if isinstance(value, dict) and isinstance(manifest.get(key), dict):
            manifest[key] = {**manifest[key], **value}
        else:
            manifest[key] = value
    return json.dumps(manifest).encode()


def test_hostile_manifests_are_refused_without_reading_other_files(fresh, peft_dir):
    """A manifest may name any file and put any value in any field: the server reads no file but
    the checkpoint's own, never blocks on one, answers the same whether a named server file
    exists or not, never shows its own paths, and stores no field it has not checked."""
    adapter, _, _ = peft_dir
    files = {n: (adapter / n).read_bytes() for n in ("adapter_config.json", "adapter_model.safetensors")}
    fake = {"bytes": 10, "sha256": "0" * 64}
    listed = json.loads(_manifest(files))["files"]
    cases = [
        ("created-at-overflow", _manifest(files, created_at=1e300), "created_at"),
        ("created-at-text", _manifest(files, created_at="yesterday"), "created_at"),
        ("step-fraction", _manifest(files, step=1.5), "step"),
        ("rank-huge", _manifest(files, lora_config={"rank": 10 ** 30}), "rank"),
        ("alpha-negative", _manifest(files, lora_config={"alpha": -1.0}), "alpha"),
        ("base-model-number", _manifest(files, base_model=7), "base_model"),
        ("has-optimizer-lie", _manifest(files, has_optimizer=True), "has_optimizer"),
        ("server-file", _manifest(files, files={**listed, "/etc/passwd": fake}), "not a checkpoint file"),
        ("missing-server-file", _manifest(files, files={**listed, "/etc/no-such-file": fake}), "not a checkpoint file"),
        ("parent", _manifest(files, files={**listed, "../adapter_model.safetensors": fake}), "not a checkpoint file"),
        ("device", _manifest(files, files={**listed, "/dev/zero": fake}), "not a checkpoint file"),
        ("huge", _manifest(files, padding="x" * (2 << 20)), "at most"),
        ("nested", _manifest(files).replace(b'"created_at": 1700000000.0', b'"created_at": ' + b"[" * 5000 + b"]" * 5000),
         "manifest.json"),
    ]
    url = f"{fresh.base_url}/api/v1/checkpoints/import"
    rest = tinker.RestClient(base_url=fresh.base_url, api_key=KEY_B)
    before = rest.list_user_checkpoints().result().cursor.total_count
    details = {}
    with httpx.Client(timeout=60, headers={"X-API-Key": KEY_B}) as http:
        for case, manifest, needle in cases:
            r = http.post(url, params={"name": f"hostile-{case}"}, content=tar_bytes({**files, "manifest.json": manifest}))
            assert r.status_code == 400 and needle in r.json()["detail"], (case, r.status_code, r.text[:300])
            assert str(fresh.data_dir) not in r.text and "/tmp" not in r.text, (case, r.text[:300])
            details[case] = r.json()["detail"]
        assert http.get(f"{fresh.base_url}/api/v1/healthz").status_code == 200
        # no existence oracle: a server file that exists and one that does not get the same answer
        assert details["server-file"].replace("/etc/passwd", "X") == \
            details["missing-server-file"].replace("/etc/no-such-file", "X")
        # the same files with an honest manifest import, keeping its step but not its created_at
        r = http.post(url, params={"name": "honest-manifest"}, content=tar_bytes({**files, "manifest.json": _manifest(files)}))
        assert r.status_code == 200, r.text
        stored = fresh.data_dir / "checkpoints" / r.json()["tinker_path"][len("tinker://"):] / "manifest.json"
        assert json.loads(stored.read_text())["step"] == 3
        assert json.loads(stored.read_text())["created_at"] > 1.7e9
    assert rest.list_user_checkpoints().result().cursor.total_count == before + 1
    assert not any((fresh.data_dir / "uploads").iterdir())


def _gzip_bomb(name: str, size: int) -> bytes:
    """A gzip'd tar holding `size` zero bytes as `name`: a few KB that expand to `size`."""
    buf = io.BytesIO()
    with gzip.GzipFile(fileobj=buf, mode="wb", compresslevel=9) as gz, tarfile.open(fileobj=gz, mode="w") as tar:
        info = tarfile.TarInfo(name)
        info.size = size

        class Zeros(io.RawIOBase):
            def readable(self):
                return True

            def readinto(self, b):
                b[:] = bytes(len(b))
                return len(b)

        tar.addfile(info, io.BufferedReader(Zeros()))
    return buf.getvalue()


def _sparse_bomb(name: str, size: int) -> bytes:
    """A plain tar of 1.5 KB whose one GNU sparse member expands to `size` zero bytes."""
    info = tarfile.TarInfo(name)
    info.type = tarfile.GNUTYPE_SPARSE
    block = bytearray(info.tobuf(format=tarfile.GNU_FORMAT))
    block[483:495] = b"%011o\0" % size  # the expanded ("real") size
    block[148:156] = b" " * 8
    block[148:156] = b"%06o\0 " % sum(block[:512])  # the header checksum
    return bytes(block) + b"\0" * 1024


def _member(name: str, kind: bytes, **fields) -> tarfile.TarInfo:
    info = tarfile.TarInfo(name)
    info.type = kind
    for k, v in fields.items():
        setattr(info, k, v)
    return info


def test_import_limits_and_hostile_state_left_on_disk(tmp_path):
    """Uploads are bounded after decompression (and in entries, and by member type) with nothing
    left behind; --max-lora-rank holds on import and on every later load; a manifest made hostile
    on disk while the server was down is left out at start-up and never breaks a listing."""
    limit = 4 << 20
    srv = ServerProcess(tmp_path / "srv", args=("--max-request-bytes", str(limit), "--max-lora-rank", "64")).start()
    try:
        adapters = {}
        for name, rank in (("wide", 32), ("narrow", 4)):
            make_peft_adapter(srv, tmp_path / name, rank=rank)
            adapters[name] = tar_bytes({n: (tmp_path / name / n).read_bytes()
                                   for n in ("adapter_config.json", "adapter_model.safetensors")})
        config = (tmp_path / "narrow" / "adapter_config.json").read_bytes()
        hostile = [
            ("gzip-bomb", _gzip_bomb("adapter_model.safetensors", 64 << 20), 413, "once decompressed"),
            ("sparse-bomb", _sparse_bomb("adapter_model.safetensors", 1 << 30), 400, "not a regular file"),
            ("many-entries", tar_bytes({f"f{i}.txt": b"" for i in range(100)}), 400, "more than 64 entries"),
            ("hard-link", tar_bytes({"adapter_config.json": config},
                               [_member("adapter_model.safetensors", tarfile.LNKTYPE, linkname="adapter_config.json")]),
             400, "not a regular file"),
            ("device", tar_bytes({"adapter_config.json": config},
                            [_member("adapter_model.safetensors", tarfile.CHRTYPE, devmajor=1, devminor=5)]),
             400, "not a regular file"),
            ("fifo", tar_bytes({"adapter_config.json": config}, [_member("adapter_model.safetensors", tarfile.FIFOTYPE)]),
             400, "not a regular file"),
            ("huge-json", tar_bytes({"adapter_config.json": config[:-1] + b', "x": "' + b"y" * (2 << 20) + b'"}',
                                "adapter_model.safetensors": b"{}"}), 400, "at most"),
        ]
        url = f"{srv.base_url}/api/v1/checkpoints/import"
        with httpx.Client(timeout=60, headers={"X-API-Key": KEY_B}) as http:
            for case, body, status, needle in hostile:
                assert len(body) < limit, case  # each one fits the upload limit as sent
                r = http.post(url, params={"name": case}, content=body)
                assert r.status_code == status and needle in r.json()["detail"], (case, r.status_code, r.text[:300])
            assert not list((srv.data_dir / "uploads").iterdir())  # nothing of them left behind
            assert not (srv.data_dir / "checkpoints").exists()
            wide = http.post(url, params={"name": "wide"}, content=adapters["wide"]).json()["tinker_path"]
            victim = http.post(url, params={"name": "victim"}, content=adapters["narrow"]).json()["tinker_path"]
            run, checkpoint = victim[len("tinker://"):].split("/", 1)
            r = http.post(f"{srv.base_url}/api/v1/training_runs/{run}/checkpoints/{checkpoint}/publish")
            assert r.status_code == 200, r.text  # so every tenant's accessible listing shows its run
        srv.stop()

        # while the server is down, the victim's manifest gets a time no listing can print, and so
        # does the record of "wide" (as an older version, which copied manifest times, left it)
        manifest = srv.data_dir / "checkpoints" / victim[len("tinker://"):] / "manifest.json"
        manifest.write_text(json.dumps({**json.loads(manifest.read_text()), "created_at": 1e300}))
        with sqlite3.connect(database(srv.data_dir)) as db:
            db.execute("UPDATE checkpoints SET created_at=1e300, expires_at=1e300 WHERE model_id=?",
                       (wide.split("/")[2],))
        srv.args = ("--max-request-bytes", str(limit), "--max-lora-rank", "16")
        srv.start()
        assert "its manifest is not used" in srv.log(tail=None)
        for key in (KEY_B, "tml-another-tenant"):
            with httpx.Client(timeout=60, headers={"X-API-Key": key}) as http:
                r = http.get(f"{srv.base_url}/api/v1/training_runs", params={"access_scope": "accessible"})
                assert r.status_code == 200, r.text
                assert victim.split("/")[2] in {run["training_run_id"] for run in r.json()["training_runs"]}
                r = http.get(f"{srv.base_url}/api/v1/checkpoints")
                assert r.status_code == 200, r.text
        with httpx.Client(timeout=60, headers={"X-API-Key": KEY_B}) as http:
            r = http.post(url, params={"name": "wide-again"}, content=adapters["wide"])
            assert r.status_code == 400 and "above this server's limit of 16" in r.json()["detail"], r.text
        with srv.client(KEY_B) as sc:
            with pytest.raises(tinker.BadRequestError, match="above this server's limit of 16"):
                sc.create_training_client_from_state(wide).result()
            with pytest.raises(tinker.BadRequestError, match="above this server's limit of 16"):
                sc.create_sampling_client(model_path=wide).result()
            with pytest.raises(tinker.BadRequestError, match="manifest.json is not valid"):
                sc.create_training_client_from_state(victim).result()
    finally:
        srv.stop()


def test_import_refuses_optimizer_state_that_does_not_fit(server, fresh, source, tmp_path):
    """AdamW steps are fused across tenants, so moments of the wrong shape would fail the step
    of every tenant in that cycle: they are refused at import, whatever the manifest says."""
    _, _, path = source
    out = export_checkpoint(path, tmp_path / "state", data_dir=server.data_dir)
    optim = load_file(str(out / "optimizer.safetensors"))
    name = next(k for k in optim if k.endswith(".exp_avg"))
    optim[name] = optim[name].t().contiguous()
    save_file(optim, str(out / "optimizer.safetensors"))
    manifest = json.loads((out / "manifest.json").read_text())
    data = (out / "optimizer.safetensors").read_bytes()
    manifest["files"]["optimizer.safetensors"] = {"bytes": len(data), "sha256": hashlib.sha256(data).hexdigest()}
    (out / "manifest.json").write_text(json.dumps(manifest))  # checksums that match: only the shape is wrong
    with pytest.raises(ExportError, match="does not fit its weights"):
        import_adapter(out, name="bad-moments", base_url=fresh.base_url, api_key=KEY_B)
