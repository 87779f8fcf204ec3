"""Images cost memory only while they run (issue 40, item 6), against a server process on a tiny
Qwen3-VL whose processor keeps images up to 640 x 640 (a 640 x 640 image is 400 tokens and 9.4 MiB
of float32 patches; sent as a smooth PNG, ~60 KB).

- A queued request holds its images as sent: with the device loop parked before its next cycle
  (`device_loop.before_plan`), one key queues forward requests of 48 such images and sample
  requests of 4 more; the server's resident memory grows by less than 100 MiB (decoded at
  submission, as before, the patches alone were 450 MiB), and no image is processed until the
  loop runs. Then every request is answered, with the logprobs and samples the same requests get
  when nothing waits.
- At most `max_image_decodes` images are decoded at once on the whole server: with one processing
  held in flight (`image.before_processing`), another key's request with images is a 429 naming the
  setting; both are answered once it is let go.

Memory is read from /proc (the server's VmRSS); the margins are wide (the bytes as sent are 3 MiB).
"""

from __future__ import annotations

import io
from pathlib import Path

import httpx
import numpy as np
import pytest
from tinker import types

from helpers import Gate, forward_backward_body, logprobs_of, metric, queued, wait_until
from hosted_tinker import faults
from server_process import ServerProcess
from tiny_vl_model import build_tiny_vl_model

pytestmark = pytest.mark.e2e
ALICE, BOB = "tml-alice-memory", "tml-bob-memory"
SIDE = 640
TOKENS = (SIDE // 32) ** 2  # 16-pixel patches merged 2 x 2
PATCH_BYTES = SIDE * SIDE * 24  # float32, 2 frames x 3 channels per pixel
DECODED = "hosted_tinker_images_decoded_total"


@pytest.fixture(scope="module")
def vl_dir(tmp_path_factory):
    return build_tiny_vl_model(tmp_path_factory.mktemp("vl") / "tiny-qwen3-vl", max_pixels=SIDE * SIDE)


@pytest.fixture(scope="module")
def gates(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("gates")


@pytest.fixture(scope="module")
def srv(vl_dir, gates, tmp_path_factory):
    folder = tmp_path_factory.mktemp("srv")
    keys = folder / "keys.txt"
    keys.write_text(f"alice: {ALICE}\nbob: {BOB}\n")
    proc = ServerProcess(folder, env={faults.ENV_VAR: "device_loop.before_plan,image.before_processing",
                                      faults.GATES_VAR: str(gates), "HOSTED_TINKER_MAX_IMAGE_DECODES": "1"},
                         args=("--base-model", str(vl_dir), "--api-keys-file", str(keys))).start()
    yield proc
    for point in ("device_loop.before_plan", "image.before_processing"):
        Gate(gates, point).open()
    proc.stop()


def smooth_png(seed: int) -> bytes:
    from PIL import Image

    x = np.linspace(0, 6, SIDE)
    pixels = (127 + 100 * np.sin(x + seed)[None, :, None] * np.cos(x)[:, None, None]).astype(np.uint8).repeat(3, 2)
    out = io.BytesIO()
    Image.fromarray(pixels).save(out, format="PNG")
    return out.getvalue()


def image_input(seed: int) -> types.ModelInput:
    return types.ModelInput(chunks=[types.EncodedTextChunk(tokens=[5]), types.ImageChunk(data=smooth_png(seed),
                                                                                          format="png")])


def image_datum(seed: int) -> types.Datum:
    n = 1 + TOKENS
    return types.Datum(model_input=image_input(seed),
                       loss_fn_inputs={"target_tokens": list(range(10, 10 + n)), "weights": [1.0] * n})


def resident_bytes(proc: ServerProcess) -> int:
    for line in Path(f"/proc/{proc.proc.pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    raise AssertionError("no VmRSS")


def sample(sampler, seed: int):
    return sampler.sample(image_input(seed), 1, types.SamplingParams(max_tokens=3, seed=seed, stop=[]))


@pytest.mark.skipif(not Path("/proc/self/status").exists(), reason="reads the server's memory from /proc")
def test_queued_requests_hold_their_images_as_sent(srv, vl_dir, gates):
    loop = Gate(gates, "device_loop.before_plan")
    batches = [[image_datum(4 * r + i) for i in range(4)] for r in range(12)]  # 48 images: 450 MiB of patches
    with srv.client(ALICE) as sc:
        tc = sc.create_lora_training_client(base_model=str(vl_dir), rank=4, seed=1).result()
        sampler = sc.create_sampling_client(base_model=str(vl_dir)).result()
        # What the same requests get when nothing waits (and the processor's first use is behind us).
        want = [logprobs_of(tc.forward(batches[0], "cross_entropy").result())]
        want_samples = [sample(sampler, s).result().sequences[0].tokens for s in range(2)]
        loop.close()
        depth = metric(srv, "hosted_tinker_queue_depth")
        futures = [tc.forward(batches[0], "cross_entropy")]
        queued(srv, depth + 1)
        loop.wait_held()
        before, decoded = resident_bytes(srv), metric(srv, DECODED)
        futures += [tc.forward(b, "cross_entropy") for b in batches[1:]]
        samples = [sample(sampler, s) for s in (0, 1, 2, 3)]
        queued(srv, depth + len(batches))
        wait_until(lambda: metric(srv, "hosted_tinker_sampling_waiting_jobs") >= len(samples),
                   "the sample requests are queued")
        grown = resident_bytes(srv) - before
        assert grown < 100 << 20, f"the queued requests hold {grown >> 20} MiB (patches: {52 * PATCH_BYTES >> 20} MiB)"
        assert metric(srv, DECODED) == decoded  # nothing processed while queued
        loop.open()
        got = [logprobs_of(f.result()) for f in futures]
        got_samples = [f.result().sequences[0].tokens for f in samples]
    for a, b in zip(got[0], want[0], strict=True):
        np.testing.assert_array_equal(a, b)
    assert got_samples[:2] == want_samples
    assert metric(srv, DECODED) == decoded + 52


def test_image_decodes_are_bounded_on_the_whole_server(srv, vl_dir, gates):
    """With max_image_decodes 1 and Alice's images held in their processing, Bob's request with an
    image is a 429 naming the setting, given nothing; once let go, both are answered."""
    processing = Gate(gates, "image.before_processing")
    with srv.client(ALICE) as sa, srv.client(BOB) as sb, httpx.Client(
            base_url=srv.base_url, headers={"X-API-Key": BOB}, timeout=60) as http:
        alice = sa.create_lora_training_client(base_model=str(vl_dir), rank=4, seed=2).result()
        bob = sb.create_lora_training_client(base_model=str(vl_dir), rank=4, seed=3).result()
        processing.close()
        held = alice.forward([image_datum(100)], "cross_entropy")
        processing.wait_held()
        refused = http.post("/api/v1/forward_backward", content=forward_backward_body(bob.model_id, 1, image_datum(101)),
                            headers={"Content-Type": "application/x-protobuf"})
        assert refused.status_code == 429 and refused.headers["Retry-After"] == "1", refused.text
        assert "(max_image_decodes = 1)" in refused.json()["detail"]
        assert metric(srv, "hosted_tinker_image_decodes_running") == 1
        processing.open()
        assert logprobs_of(held.result())[0].shape == (1 + TOKENS,)
        bob.forward([image_datum(101)], "cross_entropy").result()  # the refused seq_id was never taken
