"""kill -9 while checkpoints are being written leaves the old state or the new one, never a corrupt
listing; and every other crash point of a save, an overwrite or a delete is repaired at restart.
A TTL that runs out while the server is down still removes the checkpoint once it is back."""

from __future__ import annotations

import json
import random
import shutil
import sqlite3
import time
from pathlib import Path

import httpx
import pytest
import tinker
from tinker import types

from helpers import BASE_MODEL, checkpoint_dir, logprobs_of, sft_batch
from hosted_tinker.runtime.checkpoints import read_checkpoint
from server_process import ServerProcess

pytestmark = pytest.mark.e2e
KEY = "tml-crash"
ADAM = {"learning_rate": 1e-3, "beta1": 0.9, "beta2": 0.95, "eps": 1e-12, "weight_decay": 0.0, "grad_clip_norm": 0.0}


def _db(srv) -> sqlite3.Connection:
    return sqlite3.connect(srv.data_dir / "hosted_tinker.sqlite3")


def _hammer(srv, model_id: str, saves: int) -> None:
    """Queue `saves` overwrites of weights/c, each after an optim_step (so each version has its own
    step in its manifest), without waiting: the server writes checkpoints back to back."""
    with httpx.Client(base_url=srv.base_url, headers={"X-API-Key": KEY}, timeout=30) as http:
        for i in range(saves):
            r = http.post("/api/v1/optim_step", json={"model_id": model_id, "seq_id": 2 * i + 1, "adam_params": ADAM})
            assert r.status_code == 200, r.text
            r = http.post("/api/v1/save_weights", json={"model_id": model_id, "seq_id": 2 * i + 2, "path": "c",
                                                        "overwrite": True, "type": "save_weights"})
            assert r.status_code == 200, r.text


def _mid_write(kind_dir: Path) -> bool:
    return any(p.name.startswith((".tmp-c-", ".old-c-")) for p in kind_dir.iterdir())


def test_kill9_mid_save_and_every_crash_point(tmp_path):
    srv = ServerProcess(tmp_path / "srv").start()
    try:
        sc = tinker.ServiceClient(base_url=srv.base_url, api_key=KEY)
        tc = sc.create_lora_training_client(base_model=BASE_MODEL, rank=8, seed=1).result()
        tc.forward_backward(sft_batch(4, seed=1), "cross_entropy").result()
        tc.optim_step(types.AdamParams(learning_rate=1e-2)).result()
        paths = {n: tc.save_state(n).result().path for n in ("a", "b", "d", "e")}
        expiring = tc.save_state("t", ttl_seconds=4).result().path
        run = tc.model_id
        weights = checkpoint_dir(srv, paths["a"]).parent
        original_a = {f.name: f.read_bytes() for f in checkpoint_dir(srv, paths["a"]).iterdir()}

        # -- a real kill -9 in the middle of back-to-back saves (a big adapter makes each write long)
        for attempt in range(3):
            hammer = sc.create_lora_training_client(base_model=BASE_MODEL, rank=128, seed=2).result()
            hammer_weights = srv.data_dir / "checkpoints" / hammer.model_id / "weights"
            _hammer(srv, hammer.model_id, saves=60)
            deadline = time.monotonic() + 30
            while not (hammer_weights / "c").is_dir() and time.monotonic() < deadline:
                time.sleep(0.01)
            time.sleep(random.uniform(0.05, 0.4))
            srv.kill9()
            if _mid_write(hammer_weights):
                break
            srv.start()  # the kill fell between two saves: try again
            sc = tinker.ServiceClient(base_url=srv.base_url, api_key=KEY)
        assert _mid_write(hammer_weights), "three kills never landed inside a checkpoint write"

        # -- every other crash point, laid out on disk while the server is down
        a, b, d, e = (checkpoint_dir(srv, paths[n]) for n in "abde")
        a.rename(weights / ".old-a-12345678")  # overwrite of a: killed between its two renames
        (weights / ".tmp-a-87654321").mkdir()  # ... with the new version half written
        (weights / ".tmp-a-87654321" / "adapter_model.safetensors").write_bytes(b"\0" * 100)
        shutil.copytree(b, weights / "n")  # a new save renamed into place, killed before its record
        shutil.rmtree(b)                   # overwrite of b renamed into place, record not updated:
        shutil.copytree(d, b)              # (d's files were written after b's record)
        with _db(srv) as db:               # delete of d: killed after its record went
            db.execute("DELETE FROM checkpoints WHERE model_id=? AND checkpoint_id='weights/d'", (run,))
        (weights / ".trash-d-0badf00d").mkdir()
        shutil.rmtree(e)                   # e's directory lost: its record must not stay listed
        stranger = srv.data_dir / "checkpoints" / "run-the-database-never-knew" / "weights" / "x"
        shutil.copytree(d, stranger)       # unknown runs are never touched (a lost database != delete all)
        b_written = json.loads((b / "manifest.json").read_text())["created_at"]

        srv.start()
        rest = tinker.RestClient(base_url=srv.base_url, api_key=KEY)
        listed = {c.checkpoint_id: c for c in rest.list_checkpoints(run).result().checkpoints}
        assert set(listed) == {"weights/a", "weights/b"}  # "t" expired while the server was down
        deadline = time.monotonic() + 15  # ... and the sweeper removes its files once it is back
        while checkpoint_dir(srv, expiring).exists() and time.monotonic() < deadline:
            time.sleep(0.25)
        assert not checkpoint_dir(srv, expiring).exists()
        with _db(srv) as db:
            assert db.execute("SELECT COUNT(*) FROM checkpoints WHERE model_id=? AND checkpoint_id='weights/t'",
                              (run,)).fetchone()[0] == 0
        assert {f.name: f.read_bytes() for f in a.iterdir()} == original_a  # the old state of a
        assert abs(listed["weights/b"].time.timestamp() - b_written) < 1e-3  # the new state of b
        for gone in ("n", "d", "e"):
            assert not (weights / gone).exists()
        assert stranger.is_dir()

        # the hammered checkpoint: the last acknowledged version or the one being written, intact
        listed_c = {c.checkpoint_id: c for c in rest.list_checkpoints(hammer.model_id).result().checkpoints}
        assert set(listed_c) == {"weights/c"}
        c = hammer_weights / "c"
        with _db(srv) as db:
            done = db.execute("SELECT COUNT(*) FROM futures WHERE model_id=? AND kind='save_weights' AND "
                              "status='done'", (hammer.model_id,)).fetchone()[0]
        step = json.loads((c / "manifest.json").read_text())["step"]
        assert step in (done, done + 1), (step, done)
        assert listed_c["weights/c"].size_bytes == sum(f.stat().st_size for f in c.iterdir())

        # nothing half-written anywhere, every listed checkpoint verifies and loads
        for kind_dir in (weights, hammer_weights):
            assert not [p.name for p in kind_dir.iterdir() if p.name.startswith(".")]
        for cp in list(listed.values()) + list(listed_c.values()):
            folder = checkpoint_dir(srv, cp.tinker_path)
            read_checkpoint(folder, with_optimizer=True)  # checksums
            assert cp.size_bytes == sum(f.stat().st_size for f in folder.iterdir())
        sc = tinker.ServiceClient(base_url=srv.base_url, api_key=KEY)
        resumed = sc.create_training_client_from_state_with_optimizer(listed_c["weights/c"].tinker_path).result()
        assert resumed.get_info().lora_rank == 128
        restored = sc.create_training_client_from_state(listed["weights/a"].tinker_path).result()
        assert len(logprobs_of(restored.forward(sft_batch(2, seed=3), "cross_entropy").result())) == 2
    finally:
        srv.stop()
