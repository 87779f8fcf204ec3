"""One key's images cannot fail another key's work, nor cost the server work before they are refused
(issue 33), through the real SDK and the real openai SDK against a server process with two API keys
on a tiny random Qwen3-VL (tests/tiny_vl_model.py).

- A request whose tokens the model's forward would misread (the image placeholder in its text, or two
  images with no text between them: the multimodal rotary positions read them as one image) is a 400
  naming the datum and the token, before it is queued; the other key's text and image requests get
  the results they get alone.
- Every bound is checked from the images' headers before any image is decoded: the images decoded
  (`hosted_tinker_images_decoded` on /metrics) do not move for a refused request. An image the
  processor would upscale counts at its processed size.
- An image the processor refuses (an aspect ratio of 200 or more) is a 400 naming the image and the
  rule on forward_backward, asample and /v1/chat/completions (it was a 500); odd but valid images
  (1x1, CMYK, 16-bit, palette with transparency, animated, EXIF-rotated) work, converted as the
  model's own processor converts them; a truncated file is a 400.
- A key decoding `max_image_decodes_per_key` requests' images gets a 429 for another, while another
  key's images go through: the first decode is held in flight by a gate the test opens
  (faults.gate), not by a race.
"""

from __future__ import annotations

import base64
import io
import json
import os

import httpx
import numpy as np
import pytest
import tinker
from tinker import types

from helpers import forward_backward_body, logprobs_of, metric, open_gate
from hosted_tinker import faults
from server_process import ServerProcess
from tiny_vl_model import build_tiny_vl_model, png

pytestmark = pytest.mark.e2e
ALICE, BOB = "tml-alice-images", "tml-bob-images"
DECODED = "hosted_tinker_images_decoded_total"


@pytest.fixture(scope="module")
def vl_dir(tmp_path_factory):
    return build_tiny_vl_model(tmp_path_factory.mktemp("vl") / "tiny-qwen3-vl")


@pytest.fixture(scope="module")
def vision_tokens(vl_dir) -> dict[str, int]:
    config = json.loads((vl_dir / "config.json").read_text())
    return {name: config[f"{name}_token_id"] for name in ("image", "vision_start", "vision_end")}


def keys_file(folder) -> str:
    path = folder / "keys.txt"
    path.write_text(f"alice: {ALICE}\nbob: {BOB}\n")
    return str(path)


@pytest.fixture(scope="module")
def srv(vl_dir, tmp_path_factory):
    folder = tmp_path_factory.mktemp("srv")
    proc = ServerProcess(folder, env={"HOSTED_TINKER_MAX_IMAGE_PIXELS": str(100 * 100),
                                      "HOSTED_TINKER_MAX_IMAGE_PIXELS_PER_KEY": "6000"},
                         args=("--base-model", str(vl_dir), "--api-keys-file", keys_file(folder))).start()
    yield proc
    proc.stop()


@pytest.fixture(scope="module")
def alice(srv, vl_dir):
    with srv.client(ALICE) as sc:
        yield sc, sc.create_lora_training_client(base_model=str(vl_dir), rank=4, seed=1).result()


@pytest.fixture(scope="module")
def bob(srv, vl_dir):
    with srv.client(BOB) as sc:
        yield sc, sc.create_lora_training_client(base_model=str(vl_dir), rank=4, seed=2).result()


def chunks(*parts) -> list:
    """Model input chunks: a list of ints is a text chunk, bytes a PNG image chunk (its tokens counted
    by the server), a (bytes, format) pair an image of that format."""
    out = []
    for p in parts:
        if isinstance(p, list):
            out.append(types.EncodedTextChunk(tokens=p))
        else:
            data, fmt = p if isinstance(p, tuple) else (p, "png")
            out.append(types.ImageChunk(data=data, format=fmt))
    return out


def datum(*parts, n: int) -> types.Datum:
    """A cross_entropy datum of `parts` (see `chunks`), `n` tokens long once its images' tokens are in."""
    return types.Datum(model_input=types.ModelInput(chunks=chunks(*parts)),
                       loss_fn_inputs={"target_tokens": list(range(10, 10 + n)), "weights": [1.0] * n})


def prompt(*parts) -> types.ModelInput:
    return types.ModelInput(chunks=chunks(*parts))


def sample(sampler, model_input: types.ModelInput):
    return sampler.sample(model_input, 1, types.SamplingParams(max_tokens=4, seed=7, stop=[])).result().sequences[0]


def test_a_placeholder_in_text_or_adjacent_images_are_a_400_and_fail_no_one_else(srv, vl_dir, alice, bob,
                                                                                   vision_tokens):
    """Alice's datums whose tokens the model would misread are refused before they are queued, by
    name, while Bob's text and image requests, in flight beside them, get the bits they get alone."""
    pad = vision_tokens["image"]
    (_, a), (b_client, b) = alice, bob
    image = png(64, 32)  # 2 tokens
    b_text = [datum([5, 17, 230, 41], n=4)]
    b_image = [datum([5, 17], image, [41, 99], n=6)]
    b_sampler = b_client.create_sampling_client(base_model=str(vl_dir)).result()
    alone = (logprobs_of(b.forward(b_text, "cross_entropy").result()),
             logprobs_of(b.forward(b_image, "cross_entropy").result()), sample(b_sampler, prompt([5], image, [6])))
    decoded = metric(srv, DECODED)
    # In flight together: Bob's three requests, and each of Alice's refused ones.
    b_futures = (b.forward(b_text, "cross_entropy"), b.forward(b_image, "cross_entropy"))
    with pytest.raises(tinker.BadRequestError, match=rf"datum 0: its text holds {pad} \(<\|image_pad\|>\), this "
                                                     "model's image placeholder, at index 5 of its text tokens, in a "
                                                     "request with images"):
        a.forward_backward([datum([5, 17, 230], image, [41, 99, pad], n=8)], "cross_entropy").result()
    with pytest.raises(tinker.BadRequestError, match=rf"datum 1: its text holds {pad} .* at index 1 "):
        a.forward([datum([5], image, [6], n=4), datum([7, pad, 8], n=3)], "cross_entropy").result()
    adjacent = ("images 0 and 1 have no text between them, and this model reads adjacent images' tokens as one "
                r"image: put text between them \(its chat template wraps each image as "
                r"<\|vision_start\|>...<\|vision_end\|>\)")
    with pytest.raises(tinker.BadRequestError, match="datum 0: " + adjacent):
        a.forward_backward([datum([5], image, image, [6], n=6)], "cross_entropy").result()
    with pytest.raises(tinker.BadRequestError, match="datum 0: " + adjacent):  # an empty text chunk is no text
        a.forward_backward([datum([5], image, [], image, [6], n=6)], "cross_entropy").result()
    a_sampler = a.save_weights_and_get_sampling_client().result()
    with pytest.raises(tinker.BadRequestError, match=rf"prompt: its text holds {pad} .* at index 0 "):
        a_sampler.sample(prompt([pad, 5], image, [6]), 1, types.SamplingParams(max_tokens=2)).result()
    with pytest.raises(tinker.BadRequestError, match="prompt: " + adjacent):
        a_sampler.compute_logprobs(prompt([5], image, image, [6])).result()
    b_sample = sample(b_sampler, prompt([5], image, [6]))
    assert metric(srv, DECODED) == decoded + 2  # Bob's image forward and sample: none of Alice's
    np.testing.assert_array_equal(logprobs_of(b_futures[0].result())[0], alone[0][0])
    np.testing.assert_array_equal(logprobs_of(b_futures[1].result())[0], alone[1][0])
    assert b_sample.tokens == alone[2].tokens and b_sample.logprobs == alone[2].logprobs
    # Well-formed, the same images work: separated (as the chat template writes them), or a
    # placeholder in a request without images (the forward replaces nothing: an ordinary token)
    start, end = vision_tokens["vision_start"], vision_tokens["vision_end"]
    a.forward([datum([5, start], image, [end, start], image, [end, 6], n=10)], "cross_entropy").result()
    a.forward([datum([5, pad, 6], n=3)], "cross_entropy").result()


def test_bounds_are_checked_from_headers_before_anything_is_decoded(srv, vl_dir, alice):
    """The key's 6000 pixels (the module's server) and the model's context refuse requests whose
    images were never decoded; an image the processor upscales (1x1 to 32x32) counts at 1024 pixels."""
    sc, a = alice
    decoded = metric(srv, DECODED)
    with pytest.raises(tinker.BadRequestError, match=r"8192 pixels together.*6000 \(max_image_pixels_per_key\)"):
        a.forward([datum([5], png(64, 64), [6], png(64, 64, seed=1), [7], n=11)], "cross_entropy").result()
    tiny = png(1, 1)  # resized to 32 x 32 by the processor: 1024 pixels held, one token
    with pytest.raises(tinker.BadRequestError, match=r"6144 pixels together.*6000 \(max_image_pixels_per_key\)"):
        a.forward([datum(*[p for _ in range(6) for p in ([5], tiny)], [6], n=13)], "cross_entropy").result()
    sampler = sc.create_sampling_client(base_model=str(vl_dir)).result()
    with pytest.raises(tinker.BadRequestError, match="context"):
        sampler.sample(prompt([5] * 509, png(64, 64), [6]), 1, types.SamplingParams(max_tokens=1)).result()
    with pytest.raises(tinker.BadRequestError, match="context"):
        a.forward([datum([5] * 509, png(64, 64), [6], n=514)], "cross_entropy").result()
    assert metric(srv, DECODED) == decoded
    a.forward([datum(*[p for _ in range(5) for p in ([5], tiny)], [6], n=11)], "cross_entropy").result()
    assert metric(srv, DECODED) == decoded + 5


def data_url(image: bytes, fmt: str = "png") -> str:
    return f"data:image/{fmt};base64," + base64.b64encode(image).decode()


@pytest.mark.parametrize("size", [(1, 4096), (4096, 2)])
def test_an_aspect_ratio_the_processor_refuses_is_a_400_everywhere(srv, vl_dir, alice, size):
    import openai

    sc, a = alice
    image, rule = png(*size), rf"refuses a {size[0]}x{size[1]} image: absolute aspect ratio must be smaller than 200"
    with pytest.raises(tinker.BadRequestError, match="datum 0 image 0: this model's image processor " + rule):
        a.forward_backward([datum([5], image, [6], n=4)], "cross_entropy").result()
    sampler = sc.create_sampling_client(base_model=str(vl_dir)).result()
    with pytest.raises(tinker.BadRequestError, match="prompt image 0: this model's image processor " + rule):
        sampler.sample(prompt([5], image, [6]), 1, types.SamplingParams(max_tokens=2)).result()
    with openai.OpenAI(base_url=srv.base_url + "/v1", api_key=ALICE, max_retries=0) as oai:
        with pytest.raises(openai.BadRequestError, match="messages image 0: this model's image processor " + rule):
            oai.chat.completions.create(model=str(vl_dir), max_tokens=2, messages=[
                {"role": "user", "content": [{"type": "image_url", "image_url": {"url": data_url(image)}}]}])


def encoded(image, fmt: str = "PNG", **save) -> bytes:
    out = io.BytesIO()
    image.save(out, format=fmt, **save)
    return out.getvalue()


def test_odd_images_work_as_the_models_processor_converts_them(alice):
    """Images PIL opens in modes other than RGB reach the processor as Hugging Face's converts them:
    transparency onto white, 16-bit grayscale scaled to 8 bits (PIL's own conversion clips it: nearly
    all white). A truncated file is a 400 naming the image."""
    from PIL import Image

    _, a = alice
    rng = np.random.default_rng(0)
    rgb = Image.fromarray(rng.integers(0, 256, (32, 64, 3), dtype=np.uint8))
    gray = rng.integers(0, 256, (32, 64), dtype=np.uint8)
    rgba = Image.fromarray(np.dstack([np.asarray(rgb), rng.integers(0, 256, (32, 64), dtype=np.uint8)]))
    palette = encoded(rgb.convert("P"), transparency=0)  # palette entry 0 transparent (a tRNS chunk)

    def on_white(image: bytes) -> bytes:  # as transformers' convert_to_rgb composites transparency
        rgba = Image.open(io.BytesIO(image)).convert("RGBA")
        return encoded(Image.alpha_composite(Image.new("RGBA", rgba.size, (255, 255, 255, 255)), rgba).convert("RGB"))

    exif = Image.Exif()
    exif[0x0112] = 6  # "rotate 90": not applied (the cookbook sends the pixels as stored, too)

    def logprobs(image: bytes, fmt: str = "png", n_image: int = 2):
        return logprobs_of(a.forward([datum([5], (image, fmt), [6], n=2 + n_image)], "cross_entropy").result())[0]

    same = [(encoded(Image.fromarray(gray.astype(np.uint16) * 257)), encoded(Image.fromarray(gray))),  # 16-bit
            (encoded(rgba), on_white(encoded(rgba))), (palette, on_white(palette)),
            (encoded(rgb, save_all=True, append_images=[rgb.transpose(Image.Transpose.FLIP_LEFT_RIGHT)]),
             encoded(rgb)),  # animated: its first frame
            (encoded(rgb, exif=exif), encoded(rgb))]
    for odd, plain in same:
        np.testing.assert_array_equal(logprobs(odd), logprobs(plain))
    for fine in (encoded(rgb.convert("CMYK"), "JPEG"), encoded(rgb.convert("1")), encoded(rgb.convert("LA"))):
        logprobs(fine, "jpeg" if fine[:2] == b"\xff\xd8" else "png")
    logprobs(png(1, 1), n_image=1)
    for fmt, whole in (("png", encoded(rgb)), ("jpeg", encoded(rgb, "JPEG"))):
        with pytest.raises(tinker.BadRequestError, match=f"datum 0 image 0: the {fmt} data cannot be decoded"):
            logprobs(whole[:len(whole) // 2], fmt)


def test_a_keys_decodes_in_flight_are_bounded_and_another_key_is_not_held(vl_dir, tmp_path):
    """With max_image_decodes_per_key 1, Alice's first image request is held in its decode (a gate):
    her second is a 429 naming the setting, given nothing; Bob's image request is decoded and
    answered meanwhile. Once the gate opens, Alice's first is answered too."""
    gates = tmp_path / "gates"
    gates.mkdir()
    os.mkfifo(gates / "image.decode")
    srv = ServerProcess(tmp_path / "srv", env={"HOSTED_TINKER_MAX_IMAGE_DECODES_PER_KEY": "1",
                                               faults.ENV_VAR: "image.decode:1", faults.GATES_VAR: str(gates)},
                        args=("--base-model", str(vl_dir), "--api-keys-file", keys_file(tmp_path))).start()
    try:
        with srv.client(ALICE) as a_client, srv.client(BOB) as b_client, httpx.Client(
                base_url=srv.base_url, headers={"X-API-Key": ALICE}, timeout=60) as http:
            a = a_client.create_lora_training_client(base_model=str(vl_dir), rank=4).result()
            a2 = a_client.create_lora_training_client(base_model=str(vl_dir), rank=4).result()
            b = b_client.create_lora_training_client(base_model=str(vl_dir), rank=4).result()
            image_datum = datum([5], png(64, 32), [6], n=4)
            held = a.forward([image_datum], "cross_entropy")  # its POST waits in the server's decode
            with open_gate(gates / "image.decode"):
                over = http.post("/api/v1/forward_backward", content=forward_backward_body(a2.model_id, 1, image_datum),
                                 headers={"Content-Type": "application/x-protobuf"})
                assert over.status_code == 429 and over.headers["Retry-After"] == "1", over.text
                assert "1 requests decoding images now (max_image_decodes_per_key = 1)" in over.json()["detail"]
                b.forward([image_datum], "cross_entropy").result()
            assert logprobs_of(held.result())[0].shape == (4,)
            a2.forward([image_datum], "cross_entropy").result()  # her slot is free again
    finally:
        srv.stop()
