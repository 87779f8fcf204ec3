"""The model families of issue 23 in a worker pool (`serve --workers 2 --shard-base`: rank 0 + one
torchrun rank, gloo on CPU, the base sharded by FSDP2), driven through the real SDK: a tiny random
Qwen3-VL given image chunks, and a tiny random Qwen3-MoE whose experts take LoRA, each in its own
pool. Every rank gets its datums' pixels and runs the same packing plan, so forward /
forward_backward losses and logprobs, the trained adapter's weights and (MoE) a checkpoint loaded
back are what one rank gives (the reference: one server process serving both models, fp32,
<= 1e-5 as tests/test_worker_pool.py). A rank whose share holds no image pairs up with one whose
share does (FSDP2's all-gathers), the sampler takes an image, and (MoE) a rank killed mid-pass is
relaunched with the expert LoRA moved into the reloaded base."""

from __future__ import annotations

import json

import numpy as np
import pytest
import tinker
import transformers as T
from tinker import types
from tinker.types.request_error_category import RequestErrorCategory

from family_models import save_family_model
from helpers import logprobs_of, read_adapter
from hosted_tinker.models.embedded import ensure_embedded_model
from server_process import ServerProcess
from tiny_vl_model import build_tiny_vl_model, png

pytestmark = pytest.mark.e2e
WAIT = 300  # bound on any one result: a hung future fails the test here
START = 300  # two Python processes importing torch on a busy 2-core machine
KEY = "tml-pool-families"
ADAM = types.AdamParams(learning_rate=1e-2)
TOL = dict(rtol=1e-5, atol=1e-5)


def text_datum(tokens: list[int]) -> types.Datum:
    return types.Datum(model_input=types.ModelInput.from_ints(tokens),
                       loss_fn_inputs={"target_tokens": [(t * 7 + 3) % 900 for t in tokens],
                                       "weights": [1.0] * len(tokens)})


def image_datum(image: bytes, n_image: int, before: list[int], after: list[int]) -> types.Datum:
    n = len(before) + n_image + len(after)
    return types.Datum(
        model_input=types.ModelInput(chunks=[types.EncodedTextChunk(tokens=before),
                                             types.ImageChunk(data=image, format="png", expected_tokens=n_image),
                                             types.EncodedTextChunk(tokens=after)]),
        loss_fn_inputs={"target_tokens": list(range(10, 10 + n)), "weights": [1.0] * n})


def vl_batch() -> list[types.Datum]:
    """Two image datums (2 and 4 image tokens) around a text-only one: split over 2 ranks, each
    rank's share holds an image."""
    return [image_datum(png(64, 32, seed=1), 2, [5, 17, 230], [41, 99]),
            text_datum([3, 8, 21, 55, 144, 233, 377, 610, 9, 4, 2, 1]),
            image_datum(png(64, 64, seed=2), 4, [7, 11], [13, 19, 23, 29])]


def one_image_batch() -> list[types.Datum]:
    """An image datum and a longer text-only one: over 2 ranks, one holds the image, one does not."""
    return [image_datum(png(64, 32, seed=3), 2, [5, 6], [7]), text_datum(list(range(100, 112)))]


def model_input_of_images(data: list[types.Datum]) -> bool:
    return any(isinstance(c, types.ImageChunk) for d in data for c in d.model_input.chunks)


def moe_batch() -> list[types.Datum]:
    return [text_datum(list(range(s, s + n))) for s, n in ((5, 9), (40, 14), (300, 6), (77, 11))]


def workload(server: ServerProcess, model: str, data: list[types.Datum], *, reload: bool) -> dict:
    """Two steps, a forward, the adapter's weights, and (reload) a checkpoint loaded back."""
    got: dict = {"loss": [], "logprobs": []}
    with server.client(KEY) as sc:
        tc = sc.create_lora_training_client(base_model=model, rank=4, seed=1).result(timeout=WAIT)
        for _ in range(2):
            out = tc.forward_backward(data, "cross_entropy").result(timeout=WAIT)
            got["loss"].append(out.metrics["loss:sum"])
            got["logprobs"] += logprobs_of(out)
            tc.optim_step(ADAM).result(timeout=WAIT)
        got["logprobs"] += logprobs_of(tc.forward(data, "cross_entropy").result(timeout=WAIT))
        got["weights"] = read_adapter(server, tc.save_weights_for_sampler("w").result(timeout=WAIT).path)
        if model_input_of_images(data):  # one rank's share with an image, the other's without; a sample
            got["logprobs"] += logprobs_of(tc.forward(one_image_batch(), "cross_entropy").result(timeout=WAIT))
            sampler = tc.save_weights_and_get_sampling_client().result(timeout=WAIT)
            got["prompt_logprobs"] = np.array(sampler.compute_logprobs(one_image_batch()[0].model_input)
                                              .result(timeout=WAIT)[1:], dtype=np.float32)
        if reload:
            state = tc.save_state("s").result(timeout=WAIT).path
            back = sc.create_training_client_from_state_with_optimizer(state).result(timeout=WAIT)
            got["reloaded"] = logprobs_of(back.forward(data, "cross_entropy").result(timeout=WAIT))
            got["state"] = state
    return got


def assert_same(got: dict, want: dict) -> None:
    assert got["loss"][1] < got["loss"][0]  # it trains
    np.testing.assert_allclose(got["loss"], want["loss"], **TOL)
    for a, b in zip(got["logprobs"], want["logprobs"], strict=True):
        np.testing.assert_allclose(a, b, **TOL)
    assert got["weights"].keys() == want["weights"].keys()
    for key, w in want["weights"].items():
        np.testing.assert_allclose(got["weights"][key].numpy(), w.numpy(), **TOL, err_msg=key)
    if "prompt_logprobs" in want:
        np.testing.assert_allclose(got["prompt_logprobs"], want["prompt_logprobs"], **TOL)
    for a, b in zip(got.get("reloaded", []), want.get("reloaded", []), strict=True):
        np.testing.assert_allclose(a, b, **TOL)


@pytest.fixture(scope="module")
def models(tmp_path_factory) -> dict[str, str]:
    root = tmp_path_factory.mktemp("families")
    tok_dir = ensure_embedded_model(root / "embedded")
    vocab = json.loads((tok_dir / "config.json").read_text())["vocab_size"]
    moe = T.Qwen3MoeConfig(vocab_size=vocab, head_dim=8, moe_intermediate_size=16, num_experts=4,
                           num_experts_per_tok=2, num_key_value_heads=2, hidden_size=32, intermediate_size=48,
                           num_hidden_layers=2, num_attention_heads=4)
    return {"vl": str(build_tiny_vl_model(root / "vl")), "moe": save_family_model(root, "qwen3_moe", moe, tok_dir)}


@pytest.fixture(scope="module")
def one_rank(models, tmp_path_factory) -> dict:
    srv = ServerProcess(tmp_path_factory.mktemp("one_rank"), args=("--base-model", models["vl"],
                                                                   "--base-model", models["moe"])).start(timeout=START)
    try:
        return {"vl": workload(srv, models["vl"], vl_batch(), reload=False),
                "moe": workload(srv, models["moe"], moe_batch(), reload=True)}
    finally:
        srv.stop()


def killed_and_relaunched(server: ServerProcess, state: str, want: list[np.ndarray]) -> None:
    """Rank 1 is killed in the pool's fifth pass (`pool.rank_mid_pass@5`, after `workload`'s
    four): that request fails with category `server`; the relaunch re-shards a freshly loaded base
    with the served LoRA layers moved into it (experts too), so the trained adapter's forward
    gives what it gave before."""
    with server.client(KEY) as sc:
        tc = sc.create_training_client_from_state(state).result(timeout=WAIT)
        with pytest.raises(tinker.RequestFailedError) as failed:
            tc.forward(moe_batch(), "cross_entropy").result(timeout=WAIT)
        assert failed.value.category is RequestErrorCategory.Server
        again = logprobs_of(tc.forward(moe_batch(), "cross_entropy").result(timeout=WAIT))
    for a, b in zip(again, want, strict=True):
        np.testing.assert_allclose(a, b, **TOL)


# Sharded only: a sharded pool runs every step of a replicated one (the split, the pixels in each
# share, the gradient reduce, the weight broadcast) plus FSDP's all-gathers; one pool per family.
@pytest.mark.parametrize("family", ["vl", "moe"], ids=["vl_fsdp2_sharded", "moe_fsdp2_sharded_relaunched"])
def test_a_sharded_pool_trains_what_one_rank_trains(tmp_path, models, one_rank, family):
    relaunch = family == "moe"
    srv = ServerProcess(tmp_path / "pool", args=("--workers", "2", "--shard-base", "--base-model", models[family]),
                        env={"HOSTED_TINKER_FAULTS": "pool.rank_mid_pass@5"} if relaunch else None).start(timeout=START)
    try:
        got = workload(srv, models[family], vl_batch() if family == "vl" else moe_batch(), reload=family == "moe")
        if relaunch:
            killed_and_relaunched(srv, got["state"], got["reloaded"])
    finally:
        srv.stop()
    assert_same(got, one_rank[family])
    log = srv.log_path.read_text()
    assert "base sharded (FSDP2)" in log and "rank 1 stopped" in log
    assert ("worker pool: back (epoch 2, relaunch 1)" in log) == relaunch
