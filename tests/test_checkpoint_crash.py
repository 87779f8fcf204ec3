"""kill -9 at every crash point of a checkpoint write, injected deterministically: the server is
started with HOSTED_TINKER_FAULTS=<point> and SIGKILLs itself when a save, an overwrite or a
delete reaches that point. After each kill it restarts and repairs: no acknowledged checkpoint
is lost, nothing half-written is listed or left on disk, and the state is the one
docs/checkpoints.md promises for that point. A TTL that ran out while the server was down still
removes the checkpoint once it is back."""

from __future__ import annotations

import json
import shutil
import signal
import sqlite3
import time

import httpx
import pytest
import tinker
from tinker import types

from helpers import BASE_MODEL, checkpoint_dir, database, logprobs_of, sft_batch, wait_until
from hosted_tinker import faults
from hosted_tinker.checkpoints.format import read_checkpoint
from hosted_tinker.checkpoints.paths import TinkerPath
from server_process import ServerProcess

pytestmark = pytest.mark.e2e
KEY = "tml-crash"
ADAM = {"learning_rate": 1e-3, "beta1": 0.9, "beta2": 0.95, "eps": 1e-12, "weight_decay": 0.0, "grad_clip_norm": 0.0}
# point -> (times a first save of a new name reaches it, where an overwrite killed there lands at
# restart: the acknowledged old version, or the new one whole, renamed in before the kill).
OVERWRITES = {
    "checkpoint.after_tensors": (1, "old"),
    "checkpoint.before_rename": (1, "old"),
    "checkpoint.between_renames": (0, "old"),
    "checkpoint.before_old_removed": (0, "new"),
    "checkpoint.before_record": (1, "new"),
}
DELETES = ("checkpoint.after_record_deleted", "checkpoint.in_trash")


class Armed:
    """A server started with HOSTED_TINKER_FAULTS=`spec`, and a raw HTTP client for it (no
    SDK client: nothing with a heartbeat thread must outlive the server it talks to)."""

    def __init__(self, srv: ServerProcess, spec: str):
        self.srv, self.spec = srv, spec

    def __enter__(self) -> "Armed":
        self.srv.env[faults.ENV_VAR] = self.spec
        self.srv.start()
        self.http = httpx.Client(base_url=self.srv.base_url, headers={"X-API-Key": KEY}, timeout=60)
        return self

    def __exit__(self, *exc) -> None:
        self.http.close()
        del self.srv.env[faults.ENV_VAR]
        if exc[0] is None:  # the request sent last made the server reach its crash point
            assert self.srv.proc.wait(120) == -signal.SIGKILL, f"{self.spec} was not reached:\n{self.srv.log()}"
        else:
            self.srv.stop()

    def call(self, route: str, body: dict) -> dict:
        """POST a request and wait for its result."""
        r = self.http.post(route, json=body)
        assert r.status_code == 200, r.text
        while True:
            answer = self.http.post("/api/v1/retrieve_future", json={"request_id": r.json()["request_id"]})
            assert answer.status_code == 200, answer.text
            if answer.json().get("type") != "try_again":
                return answer.json()

    def model_from(self, source: str) -> str:
        """A new model (in a new run) from a training state."""
        session = self.http.post("/api/v1/create_session", json={}).json()["session_id"]
        return self.call("/api/v1/load_weights", {"path": source, "optimizer": True, "session_id": session,
                                                  "model_seq_id": 0})["model_id"]

    def save(self, model_id: str, seq_id: int, name: str, *, overwrite: bool = False, wait: bool = True):
        body = {"model_id": model_id, "seq_id": seq_id, "path": name, "overwrite": overwrite, "type": "save_weights"}
        if wait:
            return self.call("/api/v1/save_weights", body)["path"]
        try:  # queued: its write kills the server, which may come before this answer is sent
            assert self.http.post("/api/v1/save_weights", json=body).status_code == 200
        except httpx.TransportError:
            pass


def _files(folder) -> dict[str, bytes]:
    return {f.name: f.read_bytes() for f in folder.iterdir()}


def _step(folder) -> int:
    return json.loads((folder / "manifest.json").read_text())["step"]


def test_every_crash_point_of_a_checkpoint_write(tmp_path):
    assert set(OVERWRITES) | set(DELETES) == {p for p in faults.POINTS if p.startswith("checkpoint.")}
    srv = ServerProcess(tmp_path / "srv").start()
    try:
        with srv.client(KEY) as sc:
            tc = sc.create_lora_training_client(base_model=BASE_MODEL, rank=8, seed=1).result()
            tc.forward_backward(sft_batch(4, seed=1), "cross_entropy").result()
            tc.optim_step(types.AdamParams(learning_rate=1e-2)).result()
            source = tc.save_state("source").result().path
            doomed = {p: tc.save_state(f"del-{i}").result().path for i, p in enumerate(DELETES)}
            expiring = tc.save_state("t", ttl_seconds=3600).result().path
            lost = tc.save_state("e").result().path
            run = tc.model_id
        srv.stop()
        step0 = _step(checkpoint_dir(srv, source))

        # -- a real kill -9 at every point of an overwrite: its first version is acknowledged first
        acked: dict[str, tuple[str, dict[str, bytes]]] = {}
        for point, (first_save_hits, _) in OVERWRITES.items():
            with Armed(srv, f"{point}@{first_save_hits + 1}") as armed:
                model = armed.model_from(source)
                path = armed.save(model, 1, "x")
                acked[point] = path, _files(checkpoint_dir(srv, path))
                armed.call("/api/v1/optim_step", {"model_id": model, "seq_id": 2, "adam_params": ADAM})
                armed.save(model, 3, "x", overwrite=True, wait=False)
        # ... of a first save, before its record: the client was not told, nothing is listed
        new = {}
        for point in ("checkpoint.after_tensors", "checkpoint.before_record"):
            with Armed(srv, point) as armed:
                model = armed.model_from(source)
                new[point] = str(TinkerPath(model, "weights", "y"))
                armed.save(model, 1, "y", wait=False)
        # ... and of a delete
        for point, path in doomed.items():
            with Armed(srv, point) as armed:
                checkpoint = path[len("tinker://"):].split("/", 1)[1]
                with pytest.raises(httpx.HTTPError):  # the server dies inside the request
                    armed.http.delete(f"/api/v1/training_runs/{run}/checkpoints/{checkpoint}")

        # -- laid out while the server is down: a TTL that ran out, a lost folder, an unknown run
        with sqlite3.connect(database(srv.data_dir)) as db:
            db.execute("UPDATE checkpoints SET expires_at=? WHERE model_id=? AND checkpoint_id='weights/t'",
                       (time.time() - 1, run))
        shutil.rmtree(checkpoint_dir(srv, lost))  # e's folder lost: its record must not stay listed
        stranger = srv.data_dir / "checkpoints" / "run-the-database-never-knew" / "weights" / "x"
        shutil.copytree(checkpoint_dir(srv, source), stranger)  # never touched: a lost database != delete all

        srv.start()
        rest = tinker.RestClient(base_url=srv.base_url, api_key=KEY)
        listed = {}
        for r in {run} | {p.split("/")[2] for p in [*new.values(), *(a for a, _ in acked.values())]}:
            listed.update({c.tinker_path: c for c in rest.list_checkpoints(r).result().checkpoints})
        assert set(listed) == {source, *(a for a, _ in acked.values())}
        for point, (path, before) in acked.items():
            folder = checkpoint_dir(srv, path)
            if OVERWRITES[point][1] == "old":
                assert _files(folder) == before, point  # the acknowledged version, byte for byte
            else:
                assert _step(folder) == step0 + 1, point  # the new version, whole, and listed as such
                assert listed[path].time.timestamp() == pytest.approx(
                    json.loads((folder / "manifest.json").read_text())["created_at"], abs=1e-3), point
        for gone in (*new.values(), *doomed.values(), lost):
            assert gone not in listed and not checkpoint_dir(srv, gone).exists(), gone
        assert stranger.is_dir()
        # the expired one is hidden at once, and the sweeper removes its files and record
        assert expiring not in listed
        folder = checkpoint_dir(srv, expiring)

        def swept() -> bool:
            return not folder.exists() and not list(folder.parent.glob(".trash-t-*"))

        wait_until(swept, "the expiry sweeper removes the expired checkpoint")
        with sqlite3.connect(database(srv.data_dir)) as db:
            assert db.execute("SELECT COUNT(*) FROM checkpoints WHERE model_id=? AND checkpoint_id='weights/t'",
                              (run,)).fetchone()[0] == 0

        # nothing half-written anywhere, every listed checkpoint verifies, sizes agree, they load
        for kind_dir in (srv.data_dir / "checkpoints").glob("*/*"):
            assert not [p.name for p in kind_dir.iterdir() if p.name.startswith(".")], kind_dir
        for cp in listed.values():
            folder = checkpoint_dir(srv, cp.tinker_path)
            read_checkpoint(folder, with_optimizer=True)  # checksums
            assert cp.size_bytes == sum(f.stat().st_size for f in folder.iterdir())
        with srv.client(KEY) as sc:
            for point in ("checkpoint.between_renames", "checkpoint.before_record"):
                resumed = sc.create_training_client_from_state_with_optimizer(acked[point][0]).result()
                assert len(logprobs_of(resumed.forward(sft_batch(2, seed=3), "cross_entropy").result())) == 2
    finally:
        srv.stop()
