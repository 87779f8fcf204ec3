"""`SamplingAllowance`: a key's sampling work in flight, taken per request and given back exactly once; its
image pixels in the key's budget shared with training requests (`ImagePixelBudget`)."""

from __future__ import annotations

import pytest

from hosted_tinker.api.app import http_error_of
from hosted_tinker.errors import Busy
from hosted_tinker.models.image_decodes import ImageDecodes
from hosted_tinker.sampling.jobs import SampleJob
from hosted_tinker.services.images import ImagePixelBudget
from hosted_tinker.services.sampling import SamplingAllowance
from hosted_tinker.models.vision import Pixels, SizedImage


def job(num_samples: int = 2, max_tokens: int = 10) -> SampleJob:
    return SampleJob(prompt=[1, 2], num_samples=num_samples, max_tokens=max_tokens, adapter_id=None)


def test_limits_name_their_setting_and_other_keys_are_unaffected():
    allowance = SamplingAllowance(max_requests=2, max_tokens=100, images=ImagePixelBudget(1000, ImageDecodes(1, 1)))
    allowance.take("alice", [job()])
    allowance.take("alice", [job()])
    with pytest.raises(Busy, match="max_sampling_requests_per_key = 2") as e:
        allowance.take("alice", [job()])
    http = http_error_of(e.value)  # what api/app.py answers with
    assert http.status_code == 429 and http.headers == {"Retry-After": "1"}
    with pytest.raises(Busy, match="max_sampled_tokens_per_key = 100"):
        allowance.take("bob", [job(num_samples=11)])  # 110 tokens
    allowance.take("bob", [job(num_samples=10)])


def test_a_multi_job_request_is_given_back_once_when_its_last_job_ends():
    allowance = SamplingAllowance(max_requests=1, max_tokens=1000, images=ImagePixelBudget(1000, ImageDecodes(1, 1)))
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


def image_job(pixels: int) -> SampleJob:
    """A job whose one image, as its header says, is `pixels` x 1 (resized to fewer pixels)."""
    j = job()
    j.pixels = Pixels([SizedImage("prompt image 0", b"", "png", width=pixels, height=1, patches=1, tokens=1,
                                  processed_pixels=1)])
    return j


def test_image_pixels_in_flight_are_bounded_per_key():
    allowance = SamplingAllowance(max_requests=10, max_tokens=1000, images=ImagePixelBudget(1000, ImageDecodes(1, 1)))
    lease = allowance.take("alice", [image_job(600)])
    with pytest.raises(Busy, match="600 image pixels in flight and this one has 500 more "
                                            r"\(max_image_pixels_per_key = 1000\)") as e:
        allowance.take("alice", [image_job(500)])
    assert http_error_of(e.value).status_code == 429
    allowance.take("bob", [image_job(1000)])  # another key's images are its own
    allowance.take("alice", [job()])  # text-only requests are not held back
    lease.release()
    allowance.take("alice", [image_job(1000)])


def test_sample_requests_share_the_keys_image_budget_with_its_training_requests():
    images = ImagePixelBudget(1000, ImageDecodes(1, 1))
    allowance = SamplingAllowance(max_requests=10, max_tokens=1000, images=images)
    images.take("alice", 600)  # a waiting training request's images (services/training.py)
    with pytest.raises(Busy, match="600 image pixels in flight"):
        allowance.take("alice", [image_job(500)])
    assert "alice" not in allowance.requests and images.held == {"alice": 600}  # the refused one holds nothing
    allowance.take("alice", [image_job(400)]).release()
    assert images.held == {"alice": 600}
    images.give_back("alice", 600)  # the training request was answered
    assert images.held == {}
    allowance.take("alice", [image_job(1000)])
