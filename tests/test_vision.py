"""Images for a vision-language model, through the real SDK against a server process serving a
tiny random Qwen3-VL (built in the test) next to the embedded text-only model: image chunks in
forward and forward_backward give the logprobs of a plain forward of the same model in this
process; `expected_tokens` that the processor disagrees with, an image over a bound, and an
image sent to the text-only model are each a 400 naming what was wrong. A key's waiting and running
training and sample requests share one bound on their images' pixels (a 429 beyond it), given back
as they are answered."""

from __future__ import annotations

import base64

import httpx
import numpy as np
import pytest
import tinker
import torch
from tinker import types

from helpers import answered, forward_backward_body, logprobs_of
from hosted_tinker.models.embedded import EMBEDDED_MODEL_NAME
from hosted_tinker.checkpoints.export import export_checkpoint
from server_process import ServerProcess
from tiny_vl_model import build_tiny_vl_model, png

pytestmark = pytest.mark.e2e
KEY = "tml-vision"
TOL = 1e-4  # the server's LoRA-wrapped forward vs a plain one, fp32
MAX_PIXELS = 100 * 100
MAX_IMAGES = 4


@pytest.fixture(scope="module")
def vl_dir(tmp_path_factory):
    return build_tiny_vl_model(tmp_path_factory.mktemp("vl") / "tiny-qwen3-vl")


@pytest.fixture(scope="module")
def srv(vl_dir, tmp_path_factory):
    proc = ServerProcess(tmp_path_factory.mktemp("srv"), env={"HOSTED_TINKER_MAX_IMAGE_PIXELS": str(MAX_PIXELS),
                                                                     "HOSTED_TINKER_MAX_IMAGE_PIXELS_PER_KEY": "6000",
                                                                     "HOSTED_TINKER_MAX_IMAGES_PER_REQUEST": str(MAX_IMAGES)},
                         args=("--base-model", str(vl_dir), "--base-model", EMBEDDED_MODEL_NAME)).start()
    yield proc
    proc.stop()


@pytest.fixture(scope="module")
def sc(srv):
    with srv.client(KEY) as client:
        yield client


def reference_logprobs(vl_dir, tokens: list[int], image: bytes, at: int, targets: list[int]) -> np.ndarray:
    """Target logprobs of a plain transformers forward with the processor's pixels."""
    import io

    from PIL import Image
    from transformers import AutoImageProcessor, Qwen3VLForConditionalGeneration

    model = Qwen3VLForConditionalGeneration.from_pretrained(vl_dir, dtype=torch.float32).eval()
    processed = AutoImageProcessor.from_pretrained(vl_dir, backend="pil")(
        images=[Image.open(io.BytesIO(image)).convert("RGB")], return_tensors="pt")
    n = int(processed["image_grid_thw"].prod()) // 4
    ids = torch.tensor([tokens[:at] + [model.config.image_token_id] * n + tokens[at:]])
    with torch.no_grad():
        logits = model(input_ids=ids, pixel_values=processed["pixel_values"],
                       image_grid_thw=processed["image_grid_thw"],
                       mm_token_type_ids=(ids == model.config.image_token_id).long()).logits[0]
    return torch.log_softmax(logits.float(), -1)[torch.arange(len(targets)), torch.tensor(targets)].numpy()


def image_datum(image: bytes, expected: int | None, before: list[int], after: list[int], n_image: int) -> types.Datum:
    n = len(before) + n_image + len(after)
    return types.Datum(
        model_input=types.ModelInput(chunks=[
            types.EncodedTextChunk(tokens=before),
            types.ImageChunk(data=image, format="png", expected_tokens=expected),
            types.EncodedTextChunk(tokens=after)]),
        loss_fn_inputs={"target_tokens": list(range(10, 10 + n)), "weights": [1.0] * n})


def test_image_chunks_train_and_match_a_plain_forward(srv, sc, vl_dir, tmp_path):
    tc = sc.create_lora_training_client(base_model=str(vl_dir), rank=4, seed=1).result()
    image = png(64, 32)  # 4x2 patches of 16 pixels, merged 2x2: 2 image tokens
    datum = image_datum(image, 2, [5, 17, 230], [41, 99], n_image=2)
    got = logprobs_of(tc.forward([datum], "cross_entropy").result())[0]
    want = reference_logprobs(vl_dir, [5, 17, 230, 41, 99], image, 3, list(range(10, 17)))
    np.testing.assert_allclose(got, want, atol=TOL)
    first = tc.forward_backward([datum], "cross_entropy").result().metrics["loss:sum"]
    tc.optim_step(types.AdamParams(learning_rate=1e-2)).result()
    after = tc.forward_backward([datum], "cross_entropy").result().metrics["loss:sum"]
    assert after < first  # the LoRA on the language model learns from the image datum
    # `export --merged` of the trained LoRA is a plain Qwen3-VL (image processor included) that,
    # image and all, gives the server's logprobs
    trained = logprobs_of(tc.forward([datum], "cross_entropy").result())[0]
    saved = tc.save_weights_for_sampler("merged").result().path
    merged = export_checkpoint(saved, tmp_path / "merged", merged=True, data_dir=srv.data_dir)
    np.testing.assert_allclose(reference_logprobs(merged, [5, 17, 230, 41, 99], image, 3, list(range(10, 17))),
                               trained, atol=TOL)


def test_expected_tokens_that_disagree_are_a_400(sc, vl_dir):
    tc = sc.create_lora_training_client(base_model=str(vl_dir), rank=4).result()
    with pytest.raises(tinker.BadRequestError, match="expected_tokens is 3, but this model's processor makes 2"):
        tc.forward([image_datum(png(64, 32), 3, [5], [6], n_image=3)], "cross_entropy").result()
    with pytest.raises(tinker.BadRequestError, match=r"at most 10000 \(max_image_pixels\)"):
        tc.forward([image_datum(png(128, 96), None, [5], [6], n_image=48)], "cross_entropy").result()
    with pytest.raises(tinker.BadRequestError, match="not a valid png image|is JPEG, not png"):
        tc.forward([image_datum(png(64, 32, fmt="JPEG"), None, [5], [6], n_image=2)], "cross_entropy").result()


def test_an_image_over_max_image_bytes_and_a_request_over_max_images_per_request_are_400s(sc, vl_dir):
    """Both bounds are checked before anything is decoded, and each refusal names its setting."""
    tc = sc.create_lora_training_client(base_model=str(vl_dir), rank=4).result()
    huge = (10 << 20) + 1  # the default max_image_bytes, and one byte more
    with pytest.raises(tinker.BadRequestError, match=rf"{huge} bytes; at most {10 << 20} \(max_image_bytes\)"):
        tc.forward([image_datum(b"\x89PNG" + bytes(huge - 4), None, [5], [6], n_image=2)], "cross_entropy").result()
    image = types.ImageChunk(data=png(32, 32), format="png", expected_tokens=1)
    text = types.EncodedTextChunk(tokens=[5])
    many = types.ModelInput(chunks=[text, image] * (MAX_IMAGES + 1) + [text])
    datum = types.Datum(model_input=many, loss_fn_inputs={"target_tokens": [1] * many.length, "weights": [0.0] * many.length})
    with pytest.raises(tinker.BadRequestError, match=rf"{MAX_IMAGES + 1} images in one request; at most {MAX_IMAGES} "
                                                     r"\(max_images_per_request\)"):
        tc.forward([datum], "cross_entropy").result()


def test_a_text_only_model_refuses_images_by_name(sc):
    tc = sc.create_lora_training_client(base_model=EMBEDDED_MODEL_NAME, rank=4).result()
    with pytest.raises(tinker.BadRequestError, match="takes no images"):
        tc.forward_backward([image_datum(png(64, 32), 2, [5], [6], n_image=2)], "cross_entropy").result()


def test_sampling_with_an_image_matches_the_trainer(sc, vl_dir):
    """A trained LoRA's sampler, given a prompt with an image, scores the prompt (compute_logprobs) and
    its own samples exactly as the training forward does on the same tokens and image: the prefill's
    multimodal rotary positions and each decode step's rope delta are the trainer's."""
    import json

    image_token = json.loads((vl_dir / "config.json").read_text())["image_token_id"]
    tc = sc.create_lora_training_client(base_model=str(vl_dir), rank=4, seed=2).result()
    # 64x64: 2x2 merged patches, 4 tokens on 2 rotary steps, so the text after it runs 2 positions behind
    image, before, after = png(64, 64, seed=3), [5, 17, 230], [41, 99]
    tc.forward_backward([image_datum(image, 4, before, after, n_image=4)], "cross_entropy").result()
    tc.optim_step(types.AdamParams(learning_rate=5e-2)).result()
    sampler = tc.save_weights_and_get_sampling_client().result()
    prompt = types.ModelInput(chunks=[types.EncodedTextChunk(tokens=before),
                                      types.ImageChunk(data=image, format="png", expected_tokens=4),
                                      types.EncodedTextChunk(tokens=after)])
    scored = sampler.compute_logprobs(prompt).result()
    sampled = sampler.sample(prompt, 1, types.SamplingParams(max_tokens=6, seed=4, stop=[])).result().sequences[0]
    full = before + [image_token] * 4 + after + sampled.tokens
    datum = image_datum(image, 4, before, after + sampled.tokens, n_image=4)
    datum.loss_fn_inputs["target_tokens"] = types.TensorData.from_numpy(np.array(full[1:] + [0]))
    trained = logprobs_of(tc.forward([datum], "cross_entropy").result())[0]
    n = len(full) - len(sampled.tokens)
    assert len(scored) == n and scored[0] is None
    np.testing.assert_allclose(np.array(scored[1:], dtype=np.float32), trained[:n - 1], atol=1e-5)
    np.testing.assert_allclose(sampled.logprobs, trained[n - 1:-1], atol=1e-5)


def test_a_sample_request_over_the_keys_image_bound_is_a_400(sc, vl_dir):
    """Two 64x64 images are 8192 pixels, more than the 6000 a key may have in flight (the module's server)."""
    client = sc.create_sampling_client(base_model=str(vl_dir)).result()
    image = types.ImageChunk(data=png(64, 64), format="png", expected_tokens=4)
    prompt = types.ModelInput(chunks=[types.EncodedTextChunk(tokens=[5]), image, types.EncodedTextChunk(tokens=[6]),
                                      image])
    with pytest.raises(tinker.BadRequestError, match=r"8192 pixels together.*6000 \(max_image_pixels_per_key\)"):
        client.sample(prompt, 1, types.SamplingParams(max_tokens=2)).result()


def test_training_images_share_the_keys_image_bound_until_answered(srv, vl_dir):
    """The key's 6000 pixels (the module's server) hold its training requests' images from submission
    until they are answered, in one budget with its sample requests. Seq_id 2 is left unsent, so a
    forward_backward at seq_id 3 waits behind it holding a 64x64 image (4096 pixels): seq_id 4's image,
    or a sample request's, is then a 429 with Retry-After. Once seq_id 2 arrives (text-only, never held
    back) and seq_id 3 is answered, its pixels are back: seq_id 4, sent again as the SDK retries a 429,
    is taken and answered. One request over the whole bound alone is a 400."""
    key, image = "tml-vision-bound", png(64, 64)  # a key of its own: the bound is per key
    with srv.client(key) as sc, httpx.Client(base_url=srv.base_url, headers={"X-API-Key": key}, timeout=60) as http:
        tc = sc.create_lora_training_client(base_model=str(vl_dir), rank=4).result()
        with pytest.raises(tinker.BadRequestError, match=r"8192 pixels together.*6000 \(max_image_pixels_per_key\)"):
            tc.forward([image_datum(image, 4, [5], [6], n_image=4)] * 2, "cross_entropy").result()  # seq_id 1

        def post(seq_id: int, datum: types.Datum) -> httpx.Response:
            return http.post("/api/v1/forward_backward", content=forward_backward_body(tc.model_id, seq_id, datum),
                             headers={"Content-Type": "application/x-protobuf"})

        held = post(3, image_datum(image, 4, [5], [6], n_image=4))
        assert held.status_code == 200, held.text
        busy = "4096 image pixels in flight and this one has 4096 more (max_image_pixels_per_key = 6000)"
        over = post(4, image_datum(image, 4, [7], [8], n_image=4))
        assert over.status_code == 429 and over.headers["Retry-After"] == "1" and busy in over.json()["detail"]
        session = http.post("/api/v1/create_session", json={"tags": []}).json()["session_id"]
        sampler = http.post("/api/v1/create_sampling_session", json={
            "session_id": session, "sampling_session_seq_id": 0, "base_model": str(vl_dir)}).json()["sampling_session_id"]
        sample = http.post("/api/v1/asample", json={
            "sampling_session_id": sampler, "seq_id": 0, "num_samples": 1, "sampling_params": {"max_tokens": 1},
            "prompt": {"chunks": [{"type": "encoded_text", "tokens": [5]}, {
                "type": "image", "data": base64.b64encode(image).decode(), "format": "png", "expected_tokens": 4}]}})
        assert sample.status_code == 429 and busy in sample.json()["detail"], sample.text
        text = types.Datum(model_input=types.ModelInput.from_ints([5, 6, 7]),
                           loss_fn_inputs={"target_tokens": [6, 7, 8], "weights": [1.0] * 3})
        assert post(2, text).status_code == 200
        assert answered(http, held.json()["request_id"]).status_code == 200
        again = post(4, image_datum(image, 4, [7], [8], n_image=4))
        assert again.status_code == 200, again.text
        assert answered(http, again.json()["request_id"]).status_code == 200


def test_a_text_only_sampler_refuses_images_by_name(sc):
    client = sc.create_sampling_client(base_model=EMBEDDED_MODEL_NAME).result()
    prompt = types.ModelInput(chunks=[types.EncodedTextChunk(tokens=[5]),
                                      types.ImageChunk(data=png(64, 32), format="png", expected_tokens=2)])
    with pytest.raises(tinker.BadRequestError, match="takes no images"):
        client.sample(prompt, 1, types.SamplingParams(max_tokens=2)).result()


def data_url(image: bytes) -> str:
    import base64

    return "data:image/png;base64," + base64.b64encode(image).decode()


@pytest.fixture(scope="module")
def oai(srv):
    import openai

    with openai.OpenAI(base_url=srv.base_url + "/v1", api_key=KEY, max_retries=0) as client:
        yield client


def test_openai_chat_takes_data_url_images(oai, sc, vl_dir):
    """An image_url part with a data URL lands where the model's chat template puts its placeholder:
    the chat answer's logprobs are those compute_logprobs gives for the same prompt with an image
    chunk there. Other URLs are refused: the server fetches nothing."""
    import openai
    from transformers import AutoTokenizer

    image, question = png(64, 64, seed=5), "What is in the picture?"
    r = oai.chat.completions.create(
        model=str(vl_dir), max_tokens=5, temperature=0.7, seed=3, logprobs=True,
        extra_body={"return_tokens_as_token_ids": True},
        messages=[{"role": "user", "content": [{"type": "image_url", "image_url": {"url": data_url(image)}},
                                               {"type": "text", "text": question}]}])
    content = r.choices[0].logprobs.content
    ids = [int(e.token.removeprefix("token_id:")) for e in content]
    tok = AutoTokenizer.from_pretrained(vl_dir)
    head = tok.encode("<|im_start|>user\n<|vision_start|>", add_special_tokens=False)
    tail = tok.encode(f"<|vision_end|>{question}<|im_end|>\n<|im_start|>assistant\n", add_special_tokens=False)
    prompt = types.ModelInput(chunks=[types.EncodedTextChunk(tokens=head),
                                      types.ImageChunk(data=image, format="png", expected_tokens=4),
                                      types.EncodedTextChunk(tokens=tail + ids)])
    want = sc.create_sampling_client(base_model=str(vl_dir)).result().compute_logprobs(prompt).result()
    np.testing.assert_allclose([e.logprob for e in content], want[-len(ids):], atol=1e-5, rtol=0)
    assert r.usage.prompt_tokens == len(head) + 4 + len(tail)

    def ask(url: str, model: str = str(vl_dir)):
        return oai.chat.completions.create(model=model, max_tokens=2, messages=[{"role": "user", "content": [
            {"type": "text", "text": "hi"}, {"type": "image_url", "image_url": {"url": url}}]}])

    with pytest.raises(openai.BadRequestError, match="this server does not fetch images; send a data URL"):
        ask("https://example.com/cat.png")
    with pytest.raises(openai.BadRequestError, match="takes no images"):
        ask(data_url(image), EMBEDDED_MODEL_NAME)
    with pytest.raises(openai.BadRequestError, match=r"max_image_pixels"):
        ask(data_url(png(128, 96)))
