"""Recorded samples in the real SQLite store, with an injected clock (no sleeping for a day):
bit-identical contents, a sliding TTL that training refreshes, the sweep, surviving a reopen of
the database, and ownership by key and session."""

from __future__ import annotations

import numpy as np
import pytest

from hosted_tinker.sampling.jobs import SampleJob, SampleResult, SequenceResult
from hosted_tinker.sampling.records import DAY_S, SampleRecord, SampleRecords, Unusable, sequence_ids
from hosted_tinker.store.tables import Store

SS = "sess-1:sample:0"


class Clock:
    def __init__(self):
        self.now = 1_000_000.0

    def __call__(self):
        return self.now


@pytest.fixture
def world(tmp_path):
    store = Store(tmp_path / "db.sqlite3")
    store.sampling_sessions.create(SS, "sess-1", "alice", "m", "tinker://r/sampler_weights/w", "/ckpt")
    clock = Clock()
    yield store, clock, SampleRecords(store, clock=clock, sweep_every_s=3600)
    store.close()


# float32 values that a float64 round trip would not keep exactly, to check the bits
LOGPROBS = np.float32([-0.1, -2.7182817, -1e-8])


def record_request(records: SampleRecords, seq_id: int, num: int = 2, session: str = "sess-1", owner="alice"):
    job = SampleJob(prompt=[5, 6, 7], num_samples=num, max_tokens=3, adapter_id=None, temperature=0.7, top_k=20,
                    top_p=0.9)
    store = records.recorder(request_id=f"req-{seq_id}", owner=owner, session_id=session, sampling_session_id=SS,
                             seq_id=seq_id, weights="tinker://r/sampler_weights/w", weights_version=123.0, job=job)
    store(SampleResult(sequences=[SequenceResult(tokens=[40 + i, 41, 42], logprobs=[float(x) for x in LOGPROBS],
                                                 stop_reason="length") for i in range(num)],
                       prompt_logprobs=None, topk_prompt_ids=None, topk_prompt_logprobs=None))
    return sequence_ids(SS, seq_id, num)


def test_records_keep_what_was_sampled_bit_for_bit(world):
    store, clock, records = world
    ids = record_request(records, 7)
    assert ids == [f"{SS}:7:0", f"{SS}:7:1"]
    got = records.for_training("alice", "sess-1", ids)
    rec = got[ids[1]]
    assert isinstance(rec, SampleRecord)
    assert rec.tokens.tolist() == [41, 41, 42] and rec.prompt.tolist() == [5, 6, 7]
    assert rec.logprobs.dtype == np.float32 and rec.logprobs.tobytes() == LOGPROBS.tobytes()
    assert (rec.weights, rec.weights_version, rec.temperature, rec.top_k) == (
        "tinker://r/sampler_weights/w", 123.0, pytest.approx(0.7), 20)
    assert records.request_was_recorded(SS, 7) and not records.request_was_recorded(SS, 8)


def test_ttl_slides_with_each_use_and_then_expires(world):
    store, clock, records = world
    (sid,) = record_request(records, 1, num=1)
    clock.now += DAY_S - 1
    assert isinstance(records.for_training("alice", "sess-1", [sid])[sid], SampleRecord)  # restarts its day
    clock.now += DAY_S - 1
    assert isinstance(records.for_training("alice", "sess-1", [sid])[sid], SampleRecord)
    clock.now += DAY_S
    gone = records.for_training("alice", "sess-1", [sid])[sid]
    assert isinstance(gone, Unusable) and not gone.not_found and gone.reason.startswith("its record expired")


def test_sweep_deletes_expired_records_and_their_requests(world):
    store, clock, records = world
    old = record_request(records, 1)
    clock.now += DAY_S / 2
    fresh = record_request(records, 2)
    clock.now += DAY_S / 2
    assert records.sweep() == 2
    assert store.db.one("SELECT COUNT(*) FROM sample_requests")[0] == 1
    left = records.for_training("alice", "sess-1", old + fresh)
    assert [isinstance(left[i], SampleRecord) for i in old + fresh] == [False, False, True, True]
    # Storing new records sweeps too, once per sweep_every_s.
    clock.now += DAY_S
    record_request(records, 3)
    assert store.db.one("SELECT COUNT(*) FROM sample_records")[0] == 2


def test_records_survive_reopening_the_database(world, tmp_path):
    store, clock, records = world
    ids = record_request(records, 4)
    store.close()
    reopened = Store(tmp_path / "db.sqlite3")
    try:
        again = SampleRecords(reopened, clock=clock).for_training("alice", "sess-1", ids)
        assert all(isinstance(again[i], SampleRecord) for i in ids)
        assert again[ids[0]].logprobs.tobytes() == LOGPROBS.tobytes()
    finally:
        reopened.close()


def test_records_belong_to_their_key_and_session(world):
    store, clock, records = world
    (sid,) = record_request(records, 5, num=1)
    other_key = records.for_training("bob", "sess-9", [sid])[sid]
    assert isinstance(other_key, Unusable) and other_key.not_found
    other_session = records.for_training("alice", "sess-2", [sid])[sid]
    assert isinstance(other_session, Unusable) and not other_session.not_found
    assert "sampled in session 'sess-1'" in other_session.reason
    # an id of alice's own sampling session that was never recorded: not a 404, and it says why
    unrecorded = records.for_training("alice", "sess-1", [f"{SS}:99:0"])[f"{SS}:99:0"]
    assert not unrecorded.not_found and "without record_stability_info=True" in unrecorded.reason
    assert records.for_training("bob", "sess-9", [f"{SS}:99:0"])[f"{SS}:99:0"].not_found
    assert records.for_training("alice", "sess-1", ["made-up"])["made-up"].not_found
