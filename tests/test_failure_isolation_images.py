"""A real hostile input does not fail another key's training (issue 33, item 1), against a real
server on a tiny Qwen3-VL with two keys (a keys file) through the real SDK.

Bob sends an image datum the model cannot take whatever the validation around it: the image
placeholder token in his text beside an image chunk ("Image features and image tokens do not
match"), or two image chunks with no text between them (the rope index takes their tokens for one
image). Alice's plain text forward_backward shares his pass (queued while the device loop is parked
before planning it: helpers.Gate). Whether Bob's datum is refused up front (a 400), taken, or fails
in the pass, Alice gets exactly the results she gets alone: before, she failed with category server.
"""

from __future__ import annotations

import json

import httpx
import numpy as np
import pytest
from tinker import types

from helpers import Gate, answered, forward_backward_body, logprobs_of, metric, queued, sft_batch, write_team_keys
from server_process import ServerProcess
from tiny_vl_model import build_tiny_vl_model, png

pytestmark = pytest.mark.e2e
ALICE, BOB = "tml-vl-alice", "tml-vl-bob"
KINDS = ("placeholder_in_text", "adjacent_images")
KEYS = {"alice": ALICE, **{f"bob-{kind}": f"{BOB}-{kind}" for kind in KINDS}}  # the server's keys file


@pytest.fixture(scope="module")
def vl_dir(tmp_path_factory):
    return build_tiny_vl_model(tmp_path_factory.mktemp("vl") / "tiny-qwen3-vl")


@pytest.fixture(scope="module")
def gate(tmp_path_factory) -> Gate:
    return Gate(tmp_path_factory.mktemp("gates"), "device_loop.before_plan")


@pytest.fixture(scope="module")
def srv(vl_dir, tmp_path_factory, gate):
    keys = write_team_keys(tmp_path_factory.mktemp("keys") / "keys", KEYS)
    proc = ServerProcess(tmp_path_factory.mktemp("srv"), args=("--base-model", str(vl_dir), "--api-keys-file", str(keys)),
                         env={"HOSTED_TINKER_FAULTS": "device_loop.before_plan", **gate.gates_env()}).start()
    yield proc
    gate.open()
    proc.stop()


def hostile(kind: str, image_pad: int) -> types.Datum:
    image = types.ImageChunk(data=png(64, 32), format="png", expected_tokens=2)  # 2 image tokens
    if kind == "placeholder_in_text":
        chunks = [types.EncodedTextChunk(tokens=[5, image_pad, 17]), image, types.EncodedTextChunk(tokens=[41])]
    else:  # adjacent images
        chunks = [types.EncodedTextChunk(tokens=[5, 17]), image, image, types.EncodedTextChunk(tokens=[41, 99])]
    n = sum(len(c.tokens) if isinstance(c, types.EncodedTextChunk) else 2 for c in chunks)
    return types.Datum(model_input=types.ModelInput(chunks=chunks),
                       loss_fn_inputs={"target_tokens": list(range(10, 10 + n)), "weights": [1.0] * n})


@pytest.mark.parametrize("kind", KINDS)
def test_a_hostile_image_datum_fails_no_other_key(srv, gate, vl_dir, kind):
    image_pad = json.loads((vl_dir / "config.json").read_text())["image_token_id"]
    batch = sft_batch(2, seed=5)
    with srv.client(ALICE) as sa, srv.client(f"{BOB}-{kind}") as sb, httpx.Client(
            base_url=srv.base_url, headers={"X-API-Key": f"{BOB}-{kind}"}, timeout=60) as http:
        def alice_model():
            return sa.create_lora_training_client(base_model=str(vl_dir), rank=4, seed=1).result()

        want = alice_model().forward_backward(batch, "cross_entropy").result()
        alice, bob = alice_model(), sb.create_lora_training_client(base_model=str(vl_dir), rank=4).result()
        gate.close()
        depth = metric(srv, "hosted_tinker_queue_depth")
        got = alice.forward_backward(batch, "cross_entropy")
        queued(srv, depth + 1)
        gate.wait_held()
        posted = http.post("/api/v1/forward_backward", content=forward_backward_body(bob.model_id, 1, hostile(
            kind, image_pad)), headers={"Content-Type": "application/x-protobuf"})
        if posted.status_code == 200:  # taken: it runs in Alice's pass
            queued(srv, depth + 2)
        else:
            assert posted.status_code == 400 and posted.json()["detail"], posted.text
        gate.open()
        got = got.result()
        if posted.status_code == 200:  # answered (as a result, if the model can take it) or failed alone
            bob_answer = answered(http, posted.json()["request_id"])
            if bob_answer.headers["content-type"].startswith("application/json"):
                assert "the requests of its cycle ran again without it" in bob_answer.json()["error"], bob_answer.text
    assert got.metrics == want.metrics
    assert all(np.array_equal(a, b) for a, b in zip(logprobs_of(got), logprobs_of(want), strict=True))
