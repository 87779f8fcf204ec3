"""Unit tests of `TrainingWorker` on the real runtime (the embedded model, in process), real
SQLite and real futures: how each request of a cycle is answered, user errors told apart from
server faults by what raised them, and what the sampling backend hears.

The sampling backend is a recorder (what it is told is the subject here); one test makes a
store write raise, as a server bug would, since a real one cannot be made to fail on demand.
"""

from __future__ import annotations

import json
import sqlite3
import threading

import numpy as np
import pytest
import torch
from transformers import AutoModelForCausalLM

from hosted_tinker.checkpoints.catalog import CheckpointCatalog
from hosted_tinker.checkpoints.paths import TinkerPath
from hosted_tinker.models.embedded import ensure_embedded_model
from hosted_tinker.requests.futures import FutureStore
from hosted_tinker.requests.kinds import DatumWork, FBWork, LoadSpec, RequestKind, SaveSpec
from hosted_tinker.runtime.adapters import AdamParams, LoRAConfig
from hosted_tinker.runtime.losses import resolve_loss_config
from hosted_tinker.runtime.step_audit import SyncAudit
from hosted_tinker.runtime.trainer import TrainingRuntime
from hosted_tinker.sampling.backend import SamplingBackend
from hosted_tinker.training.cycle_plan import CyclePlan, Request
from hosted_tinker.store.tables import Store
from hosted_tinker.models.vision import ImageError, Pixels
from hosted_tinker.training.worker import TrainingWorker


class NewWeightsRecorder(SamplingBackend):
    def __init__(self):
        self.updates: list[tuple] = []

    def submit(self, job) -> None:
        raise AssertionError("not used")

    def cancel(self, job) -> None:
        raise AssertionError("not used")

    def adapter_updated(self, model_id, saved_to=None) -> None:
        self.updates.append((model_id, saved_to))

    def adapter_removed(self, model_id) -> None:
        self.updates.append((model_id, "removed"))

    def shutdown(self) -> None:
        pass


@pytest.fixture(scope="module")
def runtime(tmp_path_factory):
    path = ensure_embedded_model(tmp_path_factory.mktemp("models"))
    model = AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32)
    return TrainingRuntime(model, "embedded", device=torch.device("cpu"), max_tokens_per_micro_batch=1024)


@pytest.fixture
def worker(runtime, tmp_path):
    for mid in list(runtime.adapters):
        runtime.remove_adapter(mid)
    store = Store(tmp_path / "db.sqlite3")
    store.sessions.create("s", "alice", [], {}, None, None)
    w = TrainingWorker(runtime, FutureStore(store), store, CheckpointCatalog(store, tmp_path / "checkpoints"),
                       NewWeightsRecorder())
    yield w
    store.close()


class Cycle:
    """Builds one cycle's plan, each request with a real future."""

    def __init__(self, worker: TrainingWorker):
        self.worker = worker
        self.plan = CyclePlan()
        self.seq = 0

    def add(self, part: str, model_id: str, kind: RequestKind, payload=None) -> str:
        rid, _ = self.worker.futures.create("alice", kind, model_id, None)
        self.seq += 1
        getattr(self.plan, part).append(Request(rid, kind, model_id, self.seq, payload))
        return rid

    def run(self) -> list[set[str]]:
        answered: list[set[str]] = []
        self.worker.run_cycle(self.plan, on_compute_answered=answered.append)
        return answered


def answer(worker: TrainingWorker, rid: str) -> dict:
    result = worker.futures.lookup(rid)
    assert result is not None, f"{rid} left pending"
    return {"failed": result.failed, **(json.loads(result.payload) if not result.is_proto else {})}


def create(worker: TrainingWorker, model_id: str, **flags) -> dict:
    worker.tail.store.runs.create(model_id, "s", "alice", "embedded", {}, {}, {})
    c = Cycle(worker)
    rid = c.add("tail", model_id, RequestKind.CREATE_MODEL, LoRAConfig(rank=4, **flags))
    c.run()
    return answer(worker, rid)


def fb(model_id: str, seed: int = 0) -> FBWork:
    rng = np.random.default_rng(seed)
    tokens = rng.integers(0, 1000, 12)
    data = [DatumWork(tokens=tokens, inputs={"target_tokens": rng.integers(0, 1000, 12),
                                             "weights": np.ones(12, dtype=np.float32)})]
    return FBWork(model_id, data, "cross_entropy", resolve_loss_config("cross_entropy", {}), forward_only=False)


def test_a_server_bug_is_a_server_error_whatever_its_exception_class(worker, monkeypatch):
    """A KeyError raised by the server's own code (here: the checkpoint record write) is the
    server's fault, category "server"; it used to be reported as the user's."""
    assert not create(worker, "m")["failed"]

    def broken_write(*args, **kwargs):
        raise KeyError("checkpoints")

    monkeypatch.setattr(worker.tail.store.checkpoints, "upsert", broken_write)
    c = Cycle(worker)
    rid = c.add("tail", "m", RequestKind.SAVE_WEIGHTS, SaveSpec(kind="weights", name="s1", owner="alice"))
    c.run()
    got = answer(worker, rid)
    assert got["failed"] and got["category"] == "server"
    assert "save_weights failed on the server: KeyError" in got["error"]


def test_what_the_user_asked_for_wrongly_is_a_user_error(worker):
    """Validation code's refusals are category "user": a config that adapts nothing, a save of a
    model that is not loaded, a name already taken, a request of an unloaded model."""
    got = create(worker, "nothing", train_mlp=False, train_attn=False, train_unembed=False)
    assert got["failed"] and got["category"] == "user" and "adapts no projection" in got["error"]

    assert not create(worker, "m")["failed"]
    c = Cycle(worker)
    missing = c.add("tail", "ghost", RequestKind.SAVE_WEIGHTS, SaveSpec(kind="weights", name="x", owner="alice"))
    first = c.add("tail", "m", RequestKind.SAVE_WEIGHTS, SaveSpec(kind="weights", name="taken", owner="alice"))
    again = c.add("tail", "m", RequestKind.SAVE_WEIGHTS, SaveSpec(kind="weights", name="taken", owner="alice"))
    orphan = c.add("orphaned", "gone", RequestKind.FORWARD_BACKWARD, fb("gone"))
    c.run()
    assert answer(worker, missing) == {"failed": True, "category": "user",
                                       "error": "save_weights: model 'ghost' is not loaded"}
    assert not answer(worker, first)["failed"]
    got = answer(worker, again)
    assert got["failed"] and got["category"] == "user" and "already exists" in got["error"]
    assert answer(worker, orphan) == {"failed": True, "category": "user",
                                      "error": "forward_backward: model 'gone' is not loaded (it was unloaded)"}


def test_the_sampling_backend_hears_of_every_new_version_of_the_weights(worker, tmp_path):
    """After a create, an optim_step, a save (with the directory now holding the weights) and a
    load, the backend is told, once each, and of an unload; compute answers are announced before
    the optimizer steps."""
    assert not create(worker, "m")["failed"]
    assert worker.tail.sampling.updates == [("m", None)]  # a new adapter is a version of its weights too
    c = Cycle(worker)
    fb_id = c.add("compute", "m", RequestKind.FORWARD_BACKWARD, fb("m"))
    opt_id = c.add("optim", "m", RequestKind.OPTIM_STEP, AdamParams(learning_rate=1e-3))
    save_id = c.add("tail", "m", RequestKind.SAVE_WEIGHTS_FOR_SAMPLER,
                    SaveSpec(kind="sampler_weights", name="v1", owner="alice", overwrite=True))
    answered = c.run()
    assert answered == [{"m"}]
    assert not any(answer(worker, r)["failed"] for r in (fb_id, opt_id, save_id))
    saved = tmp_path / "checkpoints" / "m" / "sampler_weights" / "v1"
    assert worker.tail.sampling.updates == [("m", None), ("m", None), ("m", saved)]

    c = Cycle(worker)
    load_id = c.add("tail", "m", RequestKind.LOAD_WEIGHTS, LoadSpec(
        checkpoint_dir=saved, with_optimizer=False, path=str(TinkerPath("m", "sampler_weights", "v1")), max_rank=8))
    c.run()
    assert not answer(worker, load_id)["failed"]
    assert worker.tail.sampling.updates[-1] == ("m", None)

    c = Cycle(worker)
    unload_id = c.add("tail", "m", RequestKind.UNLOAD_MODEL)
    c.run()
    assert not answer(worker, unload_id)["failed"]
    assert worker.tail.sampling.updates[-1] == ("m", "removed")


def test_the_scheduler_hears_of_compute_answers_before_any_is_visible(worker):
    """The scheduler is told a model's compute is answered before the first answer can be read:
    a client that waits for its result and then posts optim_step is never taken for a
    pipelining one (it used to be told after, so such an optim_step could find the fb still
    "in flight", and the client's next fb was then held for an optim_step that comes only later)."""
    assert not create(worker, "m")["failed"]
    c = Cycle(worker)
    fb_id = c.add("compute", "m", RequestKind.FORWARD_BACKWARD, fb("m"))
    seen_when_told = []
    worker.run_cycle(c.plan, on_compute_answered=lambda models: seen_when_told.append(worker.futures.lookup(fb_id)))
    assert seen_when_told == [None]  # told once, with the answer not yet there
    assert not answer(worker, fb_id)["failed"]


def test_a_cycle_waits_for_the_device_once(worker):
    """Two models' forward_backward and optim_step in one cycle: the passes and the optimizer
    steps are launched, then read after one wait for the device (issue 34: the cycle reads its
    metrics to the host once; the worker used to wait after the passes and again after the steps)."""
    for m in ("a", "b"):
        assert not create(worker, m)["failed"]
    for _ in range(2):  # the first cycle makes the layout's plans and slot tensors
        c = Cycle(worker)
        ids = [c.add("compute", m, RequestKind.FORWARD_BACKWARD, fb(m)) for m in ("a", "b")]
        ids += [c.add("optim", m, RequestKind.OPTIM_STEP, AdamParams(learning_rate=1e-3)) for m in ("a", "b")]
        with SyncAudit() as audit:
            c.run()
    assert dict(audit.reasons) == {"wait_for_device": 1}
    assert not any(answer(worker, r)["failed"] for r in ids)
    assert all(answer(worker, r)["metrics"]["grad_norm"] > 0 for r in ids[2:])


def grads(worker: TrainingWorker, model_id: str) -> list[torch.Tensor | None]:
    return [None if p.grad is None else p.grad.clone() for p in worker.runtime.adapter(model_id).parameters()]


@pytest.mark.parametrize("earlier", [False, True], ids=["fresh", "after-an-earlier-cycle"])
def test_a_request_whose_answer_fails_after_its_pass_leaves_no_gradient(worker, monkeypatch, earlier):
    """Two forward_backwards of one model share a pass; storing the second one's answer fails (as a
    server bug would) after its backward added its gradients. It fails, and the model's gradients
    are, bit for bit, those of a model that ran only the first one (with the same earlier cycle, if
    any). They used to keep the failed request's gradients, for the next optim_step to apply."""
    for m in ("m", "ref"):
        assert not create(worker, m)["failed"]
    for m in ("m", "ref") if earlier else ():
        c = Cycle(worker)
        c.add("compute", m, RequestKind.FORWARD_BACKWARD, fb(m, seed=3))
        c.run()
    c = Cycle(worker)
    kept = c.add("compute", "m", RequestKind.FORWARD_BACKWARD, fb("m", seed=1))
    lost = c.add("compute", "m", RequestKind.FORWARD_BACKWARD, fb("m", seed=2))
    resolve = worker.futures.resolve

    def broken_resolve(request_id, *args, **kwargs):
        if request_id == lost:
            raise OSError("disk I/O error")
        resolve(request_id, *args, **kwargs)

    monkeypatch.setattr(worker.futures, "resolve", broken_resolve)
    c.run()
    assert not answer(worker, kept)["failed"]
    got = answer(worker, lost)
    assert got["failed"] and got["category"] == "server" and "OSError" in got["error"]
    c = Cycle(worker)
    c.add("compute", "ref", RequestKind.FORWARD_BACKWARD, fb("ref", seed=1))
    c.run()
    for a, b in zip(grads(worker, "m"), grads(worker, "ref"), strict=True):
        assert a is not None and torch.equal(a, b)
    assert worker.compute.launched.rolled_back == 1


def test_a_requests_only_gradient_goes_with_it(worker, monkeypatch):
    """The model's only request of its cycle fails as its answer is stored (the cycle's one write
    of its answers raises, as a full disk would): the device loop fails it, and the model has no
    gradients left for its next optim_step to apply."""
    assert not create(worker, "m")["failed"]
    c = Cycle(worker)
    lost = c.add("compute", "m", RequestKind.FORWARD_BACKWARD, fb("m"))
    write = worker.futures.store.futures.complete_batch

    def broken_write(results, touched_models):
        if any(rid == lost for rid, *_ in results):
            raise OSError("disk I/O error")
        return write(results, touched_models)

    monkeypatch.setattr(worker.futures.store.futures, "complete_batch", broken_write)
    with pytest.raises(OSError):
        c.run()
    # What the device loop does with a cycle that raised (device_loop.py): its requests fail.
    assert worker.futures.fail_unanswered([lost], "the cycle failed") == [lost]
    Cycle(worker).run()  # the next cycle settles the failed request first
    assert answer(worker, lost)["failed"]
    assert grads(worker, "m") == [None] * len(grads(worker, "m"))


def test_a_request_whose_images_could_not_be_processed_fails_before_its_pass(worker):
    """Images are processed on image_decodes.py's threads before a request is planned; one its
    processor refused fails its request as the user's, before the pass, and the cycle's other
    request runs (no pass fails, nobody is rerun)."""
    assert not create(worker, "m")["failed"]
    bad = fb("m", seed=4)
    bad.data[0].pixels = Pixels(images=[], error=ImageError("datum 0 image 0: this model's image processor "
                                                            "cannot use this 64x32 CMYK image"))
    c = Cycle(worker)
    failed = c.add("compute", "m", RequestKind.FORWARD_BACKWARD, bad)
    fine = c.add("compute", "m", RequestKind.FORWARD_BACKWARD, fb("m", seed=5))
    c.run()
    assert answer(worker, failed) == {"failed": True, "category": "user", "error": (
        "forward_backward failed: ImageError: datum 0 image 0: this model's image processor cannot use this 64x32 "
        "CMYK image")}
    assert not answer(worker, fine)["failed"]
    assert worker.compute.failed_passes == 0


def test_a_cycles_answers_are_written_in_one_transaction_whatever_the_tenants(runtime, tmp_path, monkeypatch):
    """Four models' forward_backward + optim_step in one cycle: their eight results, their loss-curve
    rows and the runs' last_request_at are written in two SQLite transactions (the loss rows; the
    answers with the runs), not one or more per request (transactions counted on every connection
    the store opens, by a trace callback)."""
    transactions, open_on = [], set()
    connect = sqlite3.connect

    def traced(*args, **kwargs):
        connection = connect(*args, **kwargs)

        def statement(sql: str) -> None:
            head, thread = sql.lstrip()[:6].upper(), threading.get_ident()
            if head.startswith("BEGIN"):
                open_on.add(thread)
            elif head.startswith(("COMMIT", "ROLLBA")):
                open_on.discard(thread)
                transactions.append(sql)
            elif head.startswith(("INSERT", "UPDATE", "DELETE", "REPLAC")) and thread not in open_on:
                transactions.append(sql)  # autocommit: a transaction of its own

        connection.set_trace_callback(statement)
        return connection

    monkeypatch.setattr(sqlite3, "connect", traced)
    for mid in list(runtime.adapters):
        runtime.remove_adapter(mid)
    store = Store(tmp_path / "db.sqlite3")
    store.sessions.create("s", "alice", [], {}, None, None)
    worker = TrainingWorker(runtime, FutureStore(store), store, CheckpointCatalog(store, tmp_path / "ckpt"),
                            NewWeightsRecorder())
    try:
        models = ["a", "b", "c", "d"]
        for m in models:
            assert not create(worker, m)["failed"]
        c = Cycle(worker)
        ids = [c.add("compute", m, RequestKind.FORWARD_BACKWARD, fb(m)) for m in models]
        ids += [c.add("optim", m, RequestKind.OPTIM_STEP, AdamParams(learning_rate=1e-3)) for m in models]
        transactions.clear()
        c.run()
        assert len(transactions) == 2, transactions
        assert not any(answer(worker, r)["failed"] for r in ids)
        assert [p.requests for p in store.losses.curve("a")] == [1]
        assert store.futures.get(ids[-1]).status == "done"
    finally:
        store.close()


def test_an_optim_step_that_joins_the_running_cycle_is_stepped_and_answered_in_it(worker):
    """The device loop's join_optim runs once the pass is launched and before the optimizer steps:
    an optim_step it adds to the plan then (a pipelining client's, arrived during the pass) is
    launched with the cycle's steps and answered by it, the cycle still waiting for the device once."""
    assert not create(worker, "m")["failed"]
    for _ in range(2):  # the first cycle makes the layout's plans and slot tensors
        c = Cycle(worker)
        fb_id = c.add("compute", "m", RequestKind.FORWARD_BACKWARD, fb("m"))
        joined = Cycle(worker)
        opt_id = joined.add("optim", "m", RequestKind.OPTIM_STEP, AdamParams(learning_rate=1e-3))
        with SyncAudit() as audit:
            worker.run_cycle(c.plan, on_compute_answered=lambda models: None,
                             join_optim=lambda: c.plan.optim.extend(joined.plan.optim))
    assert dict(audit.reasons) == {"wait_for_device": 1}
    assert not answer(worker, fb_id)["failed"]
    assert answer(worker, opt_id)["metrics"]["grad_norm"] > 0
