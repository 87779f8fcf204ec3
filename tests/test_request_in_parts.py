"""A forward_backward larger than one clock cycle's budget runs in parts (issue 26, item 6).

`max_tokens_per_cycle` bounds what one cycle computes; a request over it is split into parts of
whole datums, one part per cycle, with other tenants' work and sampling rounds between the parts.
Against a real server with a small budget (64 tokens) and two keys:

- the split request's answer is the unsplit one's: every datum's logprobs equal a forward of that
  datum alone, and its loss is their sum;
- another key's short sample, sent while the large request runs, is answered before it
  (before the fix the large request ran as one uninterruptible cycle and the sample waited for it);
- a datum longer than the budget, which cannot be split, is a 400 naming the setting.
"""

from __future__ import annotations

import threading
import time

import numpy as np
import pytest
import tinker
from tinker import types

from helpers import BASE_MODEL, WAIT, logprobs_of, metric, sft_batch, wait_until
from server_process import ServerProcess

pytestmark = pytest.mark.e2e
BUDGET = 64
ALICE, BOB = "tml-parts-alice", "tml-parts-bob"


@pytest.fixture(scope="module")
def srv(tmp_path_factory):
    proc = ServerProcess(tmp_path_factory.mktemp("parts"), args=("--max-tokens-per-cycle", str(BUDGET))).start()
    yield proc
    proc.stop()


def test_a_request_in_parts_answers_what_it_would_unsplit(srv):
    batch = sft_batch(12, seed=3, min_len=10, max_len=40)  # ~300 tokens: about 6 cycles' budgets
    with srv.client(ALICE) as sc:
        tc = sc.create_lora_training_client(base_model=BASE_MODEL, rank=4, seed=1).result()
        cycles = metric(srv, "hosted_tinker_cycles_total")
        whole = tc.forward(batch, "cross_entropy").result()
        assert metric(srv, "hosted_tinker_cycles_total") - cycles >= 4  # it did run in parts
        alone = [tc.forward([d], "cross_entropy").result() for d in batch]
    for got, want in zip(logprobs_of(whole), [logprobs_of(r)[0] for r in alone]):
        np.testing.assert_allclose(got, want, rtol=0, atol=1e-6)
    assert whole.metrics["loss:sum"] == pytest.approx(sum(r.metrics["loss:sum"] for r in alone), rel=1e-6)


def test_another_keys_sample_is_answered_between_the_parts(srv):
    big = sft_batch(128, seed=4, min_len=40, max_len=60)  # ~6,400 tokens: ~100 cycles at this budget
    with srv.client(ALICE) as sa, srv.client(BOB) as sb:
        tc = sa.create_lora_training_client(base_model=BASE_MODEL, rank=4, seed=2).result()
        sampler = sb.create_sampling_client(base_model=BASE_MODEL).result()
        sampler.sample(types.ModelInput.from_ints([1, 2, 3]), 1, types.SamplingParams(max_tokens=2)).result()
        cycles = metric(srv, "hosted_tinker_cycles_total")
        alice_done = threading.Event()
        fb = tc.forward_backward(big, "cross_entropy")
        waiter = threading.Thread(target=lambda: (fb.result(timeout=WAIT), alice_done.set()))
        waiter.start()
        # Bob asks once Alice's request is on the device (its first part's cycle has started).
        wait_until(lambda: metric(srv, "hosted_tinker_cycles_total") > cycles, "alice's request starts")
        started = time.monotonic()
        sampler.sample(types.ModelInput.from_ints([5, 6, 7]), 1, types.SamplingParams(max_tokens=4)).result()
        bob_s = time.monotonic() - started
        answered_first = not alice_done.is_set()
        waiter.join(WAIT)
        assert alice_done.is_set()
    assert answered_first, f"bob's 4-token sample waited {bob_s:.2f} s, until alice's whole request had run"


def test_a_datum_longer_than_a_cycle_is_a_400_naming_the_setting(srv):
    with srv.client(ALICE) as sc:
        tc = sc.create_lora_training_client(base_model=BASE_MODEL, rank=4, seed=3).result()
        too_long = sft_batch(1, seed=5, min_len=BUDGET + 10, max_len=BUDGET + 11)
        with pytest.raises(tinker.BadRequestError, match=r"datum 0 has \d+ tokens, more than one clock cycle's "
                                                         rf"budget of {BUDGET} \(max_tokens_per_cycle\)"):
            tc.forward_backward(too_long, "cross_entropy").result()
        assert tc.forward(sft_batch(2, seed=6), "cross_entropy").result().metrics["loss:sum"] > 0  # serves on
