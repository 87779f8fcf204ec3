"""`SamplingAllowance`: a key's sampling work in flight, taken per request and given back exactly once."""

from __future__ import annotations

import pytest
from fastapi import HTTPException

from hosted_tinker.sampling.engine import SampleJob
from hosted_tinker.services.sampling import SamplingAllowance


def job(num_samples: int = 2, max_tokens: int = 10) -> SampleJob:
    return SampleJob(prompt=[1, 2], num_samples=num_samples, max_tokens=max_tokens, adapter_id=None)


def test_limits_name_their_setting_and_other_keys_are_unaffected():
    allowance = SamplingAllowance(max_requests=2, max_tokens=100)
    allowance.take("alice", [job()])
    allowance.take("alice", [job()])
    with pytest.raises(HTTPException, match="max_sampling_requests_per_key = 2") as e:
        allowance.take("alice", [job()])
    assert e.value.status_code == 429 and e.value.headers == {"Retry-After": "1"}
    with pytest.raises(HTTPException, match="max_sampled_tokens_per_key = 100"):
        allowance.take("bob", [job(num_samples=11)])  # 110 tokens
    allowance.take("bob", [job(num_samples=10)])


def test_a_multi_job_request_is_given_back_once_when_its_last_job_ends():
    allowance = SamplingAllowance(max_requests=1, max_tokens=1000)
    jobs = [job(), job(), job()]
    seen = []
    for j in jobs:
        j.on_done, j.on_error = seen.append, seen.append
    allowance.take("alice", jobs).release_when_done(jobs)
    jobs[0].on_done("result")
    jobs[0].on_error("its result failed to encode")  # one job, ending twice, still ends once
    jobs[1].on_error("cancelled")
    assert allowance.requests["alice"] == 1 and seen == ["result", "its result failed to encode", "cancelled"]
    jobs[2].on_done("result")
    assert "alice" not in allowance.requests and "alice" not in allowance.tokens
    allowance.take("alice", [job()])  # the allowance came back
