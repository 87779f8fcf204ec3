"""The wire codec against the real tinker==0.38.0 SDK: requests built and serialized by the SDK's own
send path, results decoded by the SDK's own proto readers, and hostile bodies that must only ever
produce WireError."""

from __future__ import annotations

import asyncio
import gzip
import math
import types as pytypes

import numpy as np
import pytest
import torch
import zstandard
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from tinker import types
from tinker.proto.response_conv import deserialize_forward_backward_output, deserialize_sample_response
from tinker.resources.training import AsyncTrainingResource

from hosted_tinker.wire import (
    TOPK_EMPTY_LOGPROB,
    ProvenanceSpan,
    SampledSequenceOut,
    TopkOut,
    WireError,
    decode_forward_backward_request,
    encode_forward_backward_output,
    encode_sample_response,
)
from hosted_tinker.models.vision import ImageIn
from hosted_tinker.wire import datums
from hosted_tinker.wire import tinker_wire_pb2 as pb


def sdk_post(data, loss_fn="cross_entropy", config=None, *, forward_only=False, compress=False):
    """Run the SDK's real forward_backward send path against a stub client; return (body, headers)."""
    sent = {}

    async def post(path, *, body, options, cast_to):
        sent.update(body=body, headers=options.get("headers") or {})

    client = pytypes.SimpleNamespace(
        _client_config=pytypes.SimpleNamespace(proto_compress_fwdbwd=compress),
        post=post, get=None, patch=None, put=None, delete=None, get_api_list=None,
    )
    request = types.ForwardBackwardRequest(
        forward_backward_input=types.ForwardBackwardInput(data=data, loss_fn=loss_fn, loss_fn_config=config),
        model_id="sess:train:0",
        seq_id=7,
    )
    asyncio.run(AsyncTrainingResource(client).forward_backward(request=request, forward_only=forward_only))
    return sent["body"], sent["headers"]


def datum(tokens, **inputs):
    return types.Datum(model_input=types.ModelInput.from_ints(tokens), loss_fn_inputs=inputs)


def valid_request() -> pb.ForwardBackwardRequest:
    msg = pb.ForwardBackwardRequest()
    msg.ParseFromString(sdk_post([datum([1, 2, 3], target_tokens=[2, 3, 4], weights=[0.0, 1.0, 1.0])] * 2)[0])
    return msg


# ---------------------------------------------------------------------------------------------
# Requests: SDK -> our decoder


def test_decode_sdk_request_with_sparse_weights_v2_config_and_zstd():
    weights = torch.zeros(4, 6)
    weights[1, 2:5] = torch.tensor([0.5, 1.0, 2.0])
    targets = torch.zeros(4, 6, dtype=torch.int64)
    targets[3, 0] = 42
    first = types.Datum(
        model_input=types.ModelInput(
            chunks=[types.EncodedTextChunk(tokens=[5, 6]), types.EncodedTextChunk(tokens=[2**31 - 1, 0, 9])]
        ),
        loss_fn_inputs={
            "weights": weights,
            "target_tokens": targets,
            "advantages": np.array([[1.5, -2.0], [0.0, 3.25]], dtype=np.float32),
            "extra_ids": types.TensorData(data=[7, 8, 9], dtype="int64"),  # no shape: 1-D
            "empty": types.TensorData(data=[], dtype="float32", shape=[0]),
        },
    )
    assert first.loss_fn_inputs["weights"].sparse_crow_indices is not None  # the SDK sparsified it
    assert first.loss_fn_inputs["target_tokens"].sparse_crow_indices is not None
    second = datum([11, 12], target_tokens=[12, 13], weights=[1.0, 0.0])
    config = {"clip_low_threshold": 0.8, "kl_coeff": 2, "loss_id": "my-loss"}

    body, headers = sdk_post([first, second], "ppo", config, forward_only=True, compress=True)
    assert headers["Content-Encoding"] == "zstd"
    call = decode_forward_backward_request(body, headers["Content-Encoding"])

    assert (call.model_id, call.seq_id, call.loss_fn, call.forward_only) == ("sess:train:0", 7, "ppo", True)
    assert call.loss_fn_config == {"clip_low_threshold": 0.8, "kl_coeff": 2.0, "loss_id": "my-loss"}
    assert isinstance(call.loss_fn_config["kl_coeff"], float)
    assert len(call.data) == 2
    d0, d1 = call.data
    assert d0.tokens.dtype == np.int64
    np.testing.assert_array_equal(d0.tokens, [5, 6, 2**31 - 1, 0, 9])
    expected = {
        "weights": weights.numpy(),
        "target_tokens": targets.numpy(),
        "advantages": np.array([[1.5, -2.0], [0.0, 3.25]], dtype=np.float32),
        "extra_ids": np.array([7, 8, 9], dtype=np.int64),
        "empty": np.zeros(0, np.float32),
    }
    assert d0.loss_fn_inputs.keys() == expected.keys()
    for name, want in expected.items():
        got = d0.loss_fn_inputs[name]
        assert got.dtype == want.dtype and got.shape == want.shape, name
        np.testing.assert_array_equal(got, want)
        assert got.flags.writeable, name
    np.testing.assert_array_equal(d1.tokens, [11, 12])
    np.testing.assert_array_equal(d1.loss_fn_inputs["target_tokens"], np.array([12, 13], np.int64))
    np.testing.assert_array_equal(d1.loss_fn_inputs["weights"], np.array([1.0, 0.0], np.float32))


def test_decode_uncompressed_gzip_and_zstd_bodies():
    body, headers = sdk_post([datum([1, 2], target_tokens=[2, 3], weights=[1.0, 1.0])])
    assert "Content-Encoding" not in headers  # the SDK compresses only if client/config says so
    for encoded, encoding in [
        (body, None),
        (body, "identity"),
        (gzip.compress(body), "gzip"),
        (zstandard.ZstdCompressor().compress(body), " ZSTD "),
    ]:
        call = decode_forward_backward_request(encoded, encoding)
        np.testing.assert_array_equal(call.data[0].tokens, [1, 2])
        assert call.loss_fn_config == {} and call.forward_only is False


def test_decode_legacy_numeric_config_without_v2():
    msg = valid_request()
    msg.loss_fn_config["beta"] = 0.25
    assert decode_forward_backward_request(msg.SerializeToString()).loss_fn_config == {"beta": 0.25}


def test_decode_prefers_v2_config_over_the_legacy_map():
    """When loss_fn_config_v2 is set it is the whole config: the legacy map's keys are ignored."""
    msg = valid_request()
    msg.loss_fn_config["kl_coeff"] = 9.0
    msg.loss_fn_config["stale"] = 1.0
    msg.loss_fn_config_v2["kl_coeff"].number = 0.5
    msg.loss_fn_config_v2["mode"].text = "fast"
    assert decode_forward_backward_request(msg.SerializeToString()).loss_fn_config == {"kl_coeff": 0.5, "mode": "fast"}


def test_decode_provenance_spans_as_the_sdk_sends_them():
    """Datum.with_provenance as rl_loop builds it (a zero-length sampled run included) arrives as
    ordered runs per field; a datum without provenance has none."""
    with_spans = datum([1, 2, 3, 4], target_tokens=[0, 0, 7, 8]).with_provenance(
        model_input=[types.PromptProvenanceSpan(sequence_id="s:0:1", length=3),
                     types.SampledProvenanceSpan(sequence_id="s:0:1", length=1)],
        loss_fn_inputs=[types.PromptProvenanceSpan(sequence_id="s:0:1", offset=1, length=2),
                        types.SampledProvenanceSpan(sequence_id="s:0:1", length=2),
                        types.SampledProvenanceSpan(sequence_id="s:5:0", offset=4, length=0)])
    call = decode_forward_backward_request(sdk_post([with_spans, datum([1], target_tokens=[2])], "gspo")[0])
    d0, d1 = call.data
    assert d0.model_input_spans == [ProvenanceSpan("prompt", "s:0:1", 0, 3), ProvenanceSpan("sampled", "s:0:1", 0, 1)]
    assert d0.loss_fn_input_spans == [ProvenanceSpan("prompt", "s:0:1", 1, 2), ProvenanceSpan("sampled", "s:0:1", 0, 2),
                                      ProvenanceSpan("sampled", "s:5:0", 4, 0)]
    assert d1.model_input_spans == [] and d1.loss_fn_input_spans == []


def _same_datums(together, apart) -> None:
    assert len(together) == len(apart)
    for x, y in zip(together, apart):
        assert x.tokens.dtype == y.tokens.dtype and x.tokens.flags.writeable and np.array_equal(x.tokens, y.tokens)
        assert list(x.loss_fn_inputs) == list(y.loss_fn_inputs)
        for name, a in x.loss_fn_inputs.items():
            b = y.loss_fn_inputs[name]
            assert (a.dtype, a.shape) == (b.dtype, b.shape) and a.flags.writeable
            assert np.array_equal(a, b, equal_nan=a.dtype.kind == "f")
        assert (x.images, x.model_input_spans, x.loss_fn_input_spans) == (
            y.images, y.model_input_spans, y.loss_fn_input_spans)


def test_sdk_requests_decode_together_as_datum_by_datum():
    """A request as the SDK sends it is decoded on the many-datum path (each field's values of every
    datum at once, handed out per datum) into what decoding datum by datum gives: 60 seeded requests
    of 1-24 datums of 0-300 tokens in one to three text chunks, int64 and float32 fields of shape
    (N,) and (N, K), with and without provenance spans."""
    rng = np.random.default_rng(11)
    for case in range(60):
        data = []
        for _ in range(int(rng.integers(1, 25))):
            n, k = int(rng.integers(0, 301)), int(rng.integers(1, 4)) if case % 5 == 0 else 0
            cuts = sorted(int(c) for c in rng.integers(0, n + 1, int(rng.integers(0, 3))))
            tokens = rng.integers(0, 5000, n)
            chunks = [types.EncodedTextChunk(tokens=part.tolist()) for part in np.split(tokens, cuts)]
            shape = (n, k) if k else (n,)
            inputs = {"target_tokens": types.TensorData.from_numpy(rng.integers(0, 5000, shape)),
                      "weights": types.TensorData.from_numpy(rng.standard_normal(shape).astype(np.float32))}
            if case % 3 == 1:
                inputs["advantages"] = rng.standard_normal(n).tolist()
            d = types.Datum(model_input=types.ModelInput(chunks=chunks), loss_fn_inputs=inputs)
            if case % 4 == 2 and n:
                d = d.with_provenance(model_input=[types.PromptProvenanceSpan(sequence_id="s:0:1", length=n)],
                                      loss_fn_inputs=[types.SampledProvenanceSpan(sequence_id="s:0:1", length=n)])
            data.append(d)
        msg = pb.ForwardBackwardRequest()
        msg.ParseFromString(sdk_post(data, "cross_entropy" if k or case % 3 != 1 else "ppo")[0])
        together = datums._decode_data_together(msg.data, 1 << 30)
        assert together is not None, f"case {case}: an SDK request left the many-datum path"
        apart = [datums._decode_datum(f"data[{i}]", d, datums._Allowance(1 << 30)) for i, d in enumerate(msg.data)]
        _same_datums(together, apart)


def test_decode_together_leaves_what_it_does_not_take_to_the_datum_by_datum_path():
    """An image chunk, a sparse tensor, a negative token id or a body over the limit is not decoded
    on the many-datum path: it goes datum by datum, which decodes it or names the fault."""
    msg = valid_request()
    assert datums._decode_data_together(msg.data, 1 << 20) is not None
    assert datums._decode_data_together(msg.data, 16) is None  # the limit
    image = valid_request()
    image.data[1].model_input.add().image.data = b"png"
    negative = valid_request()
    negative.data[1].model_input[0].encoded_text.tokens = np.array([1, -2], "<i4").tobytes()
    sparse = valid_request()
    _csr(sparse, [0, 1, 2], [0, 1], [1.0, 2.0])
    for m in (image, negative, sparse):
        assert datums._decode_data_together(m.data, 1 << 20) is None


def test_decode_image_chunks_at_their_place_among_the_tokens():
    """An image chunk arrives as its bytes, format, expected_tokens (if set) and the number of
    text tokens before it; the server's processor turns it into tokens later (vision.py)."""
    model_input = types.ModelInput(chunks=[
        types.EncodedTextChunk(tokens=[1, 2]), types.ImageChunk(data=b"png-bytes", format="png", expected_tokens=4),
        types.EncodedTextChunk(tokens=[3]), types.ImageChunk(data=b"jpeg-bytes", format="jpeg")])
    d = types.Datum(model_input=model_input, loss_fn_inputs={"target_tokens": [0] * 7, "weights": [1.0] * 7})
    (got,) = decode_forward_backward_request(sdk_post([d])[0]).data
    assert got.tokens.tolist() == [1, 2, 3]
    assert got.images == [ImageIn(2, b"png-bytes", "png", 4), ImageIn(3, b"jpeg-bytes", "jpeg", None)]


def test_decode_multi_frame_zstd_and_zstd_without_content_size():
    body = valid_request().SerializeToString()
    cctx = zstandard.ZstdCompressor(write_content_size=False)
    two_frames = cctx.compress(body[:10]) + cctx.compress(body[10:])
    call = decode_forward_backward_request(two_frames, "zstd")
    assert len(call.data) == 2


# ---------------------------------------------------------------------------------------------
# Results: our encoder -> SDK


def test_forward_backward_output_round_trips_through_the_sdk():
    outputs = [
        {
            "logprobs": np.array([-0.5, -1.25, -2.0], np.float32),
            "elementwise_loss": np.array([0.5, 1.25, 2.0], np.float64),
            "topk": np.arange(6, dtype=np.float32).reshape(3, 2),
            "ids": np.array([4, 5, 6], np.int32),
            "scalar": np.float32(7.5),
        },
        {
            "logprobs": np.array([-3.0], np.float32),
            "elementwise_loss": np.array([3.0], np.float32),
            "topk": np.array([[9.0, 10.0]], np.float32),
            "ids": np.array([1], np.int64),
            "scalar": np.float32(1.0),
        },
    ]
    metrics = {"loss:sum": 6.75, "tokens:sum": 4, "nan_thing:mean": math.nan, "big:max": math.inf}
    result = deserialize_forward_backward_output(encode_forward_backward_output(outputs, metrics))

    assert result.loss_fn_output_type == "ArrayRecord"
    assert result.metrics["loss:sum"] == 6.75 and result.metrics["tokens:sum"] == 4.0
    assert math.isnan(result.metrics["nan_thing:mean"]) and result.metrics["big:max"] == math.inf
    assert len(result.loss_fn_outputs) == 2
    for sent, got in zip(outputs, result.loss_fn_outputs):
        assert got.keys() == sent.keys()
        for name, want in sent.items():
            want = np.atleast_1d(want)
            td = got[name]
            assert td.dtype == ("int64" if want.dtype.kind == "i" else "float32"), name
            assert td.shape == list(want.shape), name
            np.testing.assert_array_equal(td.to_numpy().reshape(td.shape), want)


def test_forward_backward_output_without_fields_keeps_the_datum_count():
    result = deserialize_forward_backward_output(encode_forward_backward_output([{}, {}, {}], {"loss:sum": 1.0}))
    assert result.loss_fn_outputs == [{}, {}, {}]
    assert deserialize_forward_backward_output(encode_forward_backward_output([], {})).loss_fn_outputs == []


def test_forward_backward_output_sets_byte_offsets_and_num_datums():
    out = pb.ForwardBackwardOutput()
    out.ParseFromString(encode_forward_backward_output([{"x": np.ones(2)}, {"x": np.ones(3)}], {}))
    (record,) = out.loss_fn_outputs
    assert record.num_datums == 2
    assert np.frombuffer(record.fields["x"].offsets, "<i8").tolist() == [0, 8, 20]
    assert record.fields["x"].dtype == pb.DTYPE_FLOAT32


@pytest.mark.parametrize(
    "outputs, metrics, message",
    [
        ([{"a": np.ones(1)}, {"b": np.ones(1)}], {}, "same fields"),
        ([{"a": np.ones(1)}], {"loss": 1.0}, "exactly one ':'"),
        ([{"a": np.ones(1)}], {"loss:sum:x": 1.0}, "exactly one ':'"),
        ([{"a": np.ones(1)}, {"a": np.ones(1, np.int64)}], {}, "all-float or all-integer"),
        ([{"a": np.array(["x"])}], {}, "all-float or all-integer"),
        ([{"a": np.ones((2, 3))}, {"a": np.ones((2, 4))}], {}, "trailing dimensions"),
    ],
)
def test_forward_backward_output_refuses_what_the_sdk_cannot_read(outputs, metrics, message):
    with pytest.raises(ValueError, match=message):
        encode_forward_backward_output(outputs, metrics)


def test_sample_response_round_trips_through_the_sdk():
    topk = TopkOut(
        token_ids=np.array([[3, 9], [4, 0], [0, 0]]),
        logprobs=np.array([[-0.1, -2.0], [-0.3, TOPK_EMPTY_LOGPROB], [TOPK_EMPTY_LOGPROB] * 2]),
    )
    prompt_topk = TopkOut(token_ids=np.array([[0], [17]]), logprobs=np.array([[TOPK_EMPTY_LOGPROB], [-1.5]]))
    body = encode_sample_response(
        [
            SampledSequenceOut(tokens=[3, 4, 2], logprobs=np.array([-0.1, -0.3, -5.0]), stop_reason="stop",
                               topk_sampled_logprobs=topk),
            SampledSequenceOut(tokens=np.array([7, 8], np.int64), logprobs=None, stop_reason="length"),
            SampledSequenceOut(tokens=[], logprobs=np.zeros(0), stop_reason="length"),
        ],
        prompt_logprobs=np.array([np.nan, -1.5], np.float32),
        topk_prompt_logprobs=prompt_topk,
        prompt_cache_hit_tokens=5,
    )
    result = deserialize_sample_response(body)

    first, second, third = result.sequences
    assert (first.stop_reason, second.stop_reason, third.stop_reason) == ("stop", "length", "length")
    assert first.tokens == [3, 4, 2] and second.tokens == [7, 8] and third.tokens == []
    np.testing.assert_array_equal(first.logprobs_np, np.array([-0.1, -0.3, -5.0], np.float32))
    assert second.logprobs is None and third.logprobs is None  # the SDK reads empty bytes as None
    assert first.topk_logprobs == [
        [(3, pytest.approx(-0.1)), (9, -2.0)],
        [(4, pytest.approx(-0.3))],
        None,
    ]
    assert second.topk_logprobs is None
    assert result.prompt_logprobs == [None, -1.5]
    assert result.topk_prompt_logprobs == [None, [(17, -1.5)]]
    assert result.prompt_cache_hit_tokens == 5


def test_sample_response_without_prompt_logprobs():
    result = deserialize_sample_response(encode_sample_response([]))
    assert result.sequences == [] and result.prompt_logprobs is None and result.topk_prompt_logprobs is None


@pytest.mark.parametrize(
    "seq, message",
    [
        (SampledSequenceOut(tokens=[1], logprobs=None, stop_reason="eos"), "stop_reason"),
        (SampledSequenceOut(tokens=[1, 2], logprobs=np.zeros(1), stop_reason="stop"), "1 logprobs for 2 tokens"),
        (SampledSequenceOut(tokens=[2**31], logprobs=None, stop_reason="stop"), "int32"),
        (SampledSequenceOut(tokens=[1], logprobs=None, stop_reason="stop",
                            topk_sampled_logprobs=TopkOut(np.zeros((1, 2), int), np.zeros((1, 3)))), "length, k"),
    ],
)
def test_sample_response_refuses_bad_sequences(seq, message):
    with pytest.raises(ValueError, match=message):
        encode_sample_response([seq])


# ---------------------------------------------------------------------------------------------
# Malformed requests


def _tensor(msg, name="weights", i=1):
    return msg.data[i].loss_fn_inputs[name]


def _csr(msg, crow, col, values, shape=(2, 3)):
    t = _tensor(msg)
    del t.shape[:]
    t.shape.extend(shape)
    t.sparse_csr.crow_indices = np.array(crow, "<i8").tobytes()
    t.sparse_csr.col_indices = np.array(col, "<i8").tobytes()
    t.sparse_csr.values = np.array(values, "<f4").tobytes()


MUTATIONS = {
    "dmel chunk": (lambda m: setattr(m.data[1].model_input.add().dmel, "dmel", b"\x00"),
                   "data[1].model_input[1]: dmel chunks are not supported"),
    "empty chunk": (lambda m: m.data[1].model_input.add(), "data[1].model_input[1]: empty chunk"),
    "odd token bytes": (lambda m: setattr(m.data[1].model_input[0].encoded_text, "tokens", b"\x01\x00\x00"),
                        "data[1].model_input[0].encoded_text.tokens: 3 bytes is not a whole number of int32"),
    "negative token": (lambda m: setattr(m.data[1].model_input[0].encoded_text, "tokens",
                                         np.array([-4], "<i4").tobytes()),
                       "data[1].model_input: negative token id -4"),
    "dense too short": (lambda m: setattr(_tensor(m), "dense", b"\x00" * 8),
                        "data[1].loss_fn_inputs['weights']: shape [3] needs 3 values, dense has 2"),
    "dense ragged bytes": (lambda m: setattr(_tensor(m), "dense", b"\x00" * 7),
                           "data[1].loss_fn_inputs['weights'].dense: 7 bytes is not a whole number of float32"),
    "int32 dtype": (lambda m: setattr(_tensor(m), "dtype", pb.DTYPE_INT32),
                    "data[1].loss_fn_inputs['weights']: unsupported dtype DTYPE_INT32"),
    "unknown dtype": (lambda m: setattr(_tensor(m), "dtype", 99),
                      "data[1].loss_fn_inputs['weights']: unsupported dtype 99"),
    "unspecified dtype": (lambda m: setattr(_tensor(m), "dtype", 0), "unsupported dtype DTYPE_UNSPECIFIED"),
    "negative shape": (lambda m: _tensor(m).shape.__setitem__(0, -3),
                       "data[1].loss_fn_inputs['weights']: invalid shape [-3]"),
    "absurd empty shape": (lambda m: (_tensor(m).ClearField("shape"), _tensor(m).shape.extend([0, 2**62, 2**62]),
                                      setattr(_tensor(m), "dense", b"")), "invalid shape [0, "),
    "csr not 2-D": (lambda m: _csr(m, [0, 0], [], [], shape=(6,)), "sparse_csr needs a 2-D shape, got [6]"),
    "csr crow length": (lambda m: _csr(m, [0, 1], [0], [1.0]),
                        "data[1].loss_fn_inputs['weights'].sparse_csr.crow_indices: has 2 entries, "
                        "shape [2, 3] needs 3"),
    "csr col count": (lambda m: _csr(m, [0, 1, 1], [0, 1], [1.0]), "2 col_indices for 1 values"),
    "csr crow decreasing": (lambda m: _csr(m, [0, 2, 1], [0], [1.0]), "crow_indices: must rise from 0"),
    "csr crow end": (lambda m: _csr(m, [0, 1, 1], [0, 1], [1.0, 2.0]), "crow_indices: must rise from 0"),
    "csr col out of range": (lambda m: _csr(m, [0, 1, 1], [3], [1.0]), "col_indices: out of range for 3 columns"),
    "csr col unsorted": (lambda m: _csr(m, [0, 2, 2], [2, 1], [1.0, 2.0]), "strictly increasing within each row"),
    "csr huge shape": (lambda m: _csr(m, [0, 0, 0], [], [], shape=(2, 2**40)),
                       "data[1].loss_fn_inputs['weights']: the decoded request is larger than the server's limit"),
    "v2 config without value": (lambda m: m.loss_fn_config_v2["beta"].SetInParent(),
                                "loss_fn_config_v2['beta']: has neither a number nor a text value"),
    "span without arm": (lambda m: m.data[1].model_input_spans.add(),
                         "data[1].model_input_spans[0]: has neither prompt_tokens nor sampled_tokens"),
    "span without id": (lambda m: setattr(m.data[1].loss_fn_input_spans.add().sampled_tokens, "length", 3),
                        "data[1].loss_fn_input_spans[0].sampled_tokens: sequence_id is empty"),
    "span negative offset": (lambda m: m.data[1].model_input_spans.add().prompt_tokens.MergeFrom(
        pb.PromptProvenanceSpan(sequence_id="x", offset=-1, length=3)),
        "data[1].model_input_spans[0].prompt_tokens: offset (-1) and length (3) must be >= 0"),
    "span negative length": (lambda m: m.data[1].loss_fn_input_spans.add().sampled_tokens.MergeFrom(
        pb.SampledProvenanceSpan(sequence_id="x", length=-2)),
        "data[1].loss_fn_input_spans[0].sampled_tokens: offset (0) and length (-2) must be >= 0"),
}


@pytest.mark.parametrize("name", MUTATIONS)
def test_malformed_request_names_the_datum_and_field(name):
    mutate, message = MUTATIONS[name]
    msg = valid_request()
    mutate(msg)
    with pytest.raises(WireError) as excinfo:
        decode_forward_backward_request(msg.SerializeToString())
    assert message in str(excinfo.value)


def test_csr_densifies_valid_input():
    msg = valid_request()
    _csr(msg, [0, 2, 3], [0, 2, 1], [1.0, 2.0, 3.0])
    got = decode_forward_backward_request(msg.SerializeToString()).data[1].loss_fn_inputs["weights"]
    np.testing.assert_array_equal(got, np.array([[1, 0, 2], [0, 3, 0]], np.float32))


@pytest.mark.parametrize(
    "body, encoding, message",
    [
        (b"\xff\xff\xff", None, "not a valid ForwardBackwardRequest protobuf"),
        (b"\x1a\x10\x0a", None, "not a valid ForwardBackwardRequest protobuf"),
        (b"anything", "br", "unsupported Content-Encoding 'br'"),
        (b"not zstd at all", "zstd", "not valid zstd"),
        (b"", "zstd", "zstd body is truncated"),
        (zstandard.ZstdCompressor().compress(b"\x0a\x01x" * 100)[:-2], "zstd", "zstd body is truncated"),
        (b"not gzip", "gzip", "not valid gzip"),
        (gzip.compress(b"\x0a\x01x")[:-4], "gzip", "gzip body is truncated"),
    ],
)
def test_malformed_body(body, encoding, message):
    with pytest.raises(WireError, match=message):
        decode_forward_backward_request(body, encoding)


def test_truncated_sdk_body_is_refused():
    body = valid_request().SerializeToString()
    with pytest.raises(WireError, match="not a valid ForwardBackwardRequest"):
        decode_forward_backward_request(body[:-3])


@pytest.mark.parametrize("encoding", ["zstd", "gzip"])
def test_decompression_bomb_is_capped(encoding):
    bomb = b"\x00" * (64 << 20)  # 64 MiB of zeros, compressed to a few KiB
    if encoding == "zstd":  # as a streaming compressor writes it: the frame does not declare its size
        body = zstandard.ZstdCompressor(write_content_size=False).compress(bomb)
    else:
        body = gzip.compress(bomb)
    assert len(body) < 1 << 20
    with pytest.raises(WireError, match="decompresses to more than 1048576 bytes"):
        decode_forward_backward_request(body, encoding, max_decompressed_bytes=1 << 20)


def test_token_widening_counts_against_the_limit():
    body = sdk_post([datum(list(range(1000)), target_tokens=list(range(1000)))])[0]
    decode_forward_backward_request(body, max_decompressed_bytes=20_000)
    with pytest.raises(WireError, match=r"data\[0\].model_input: the decoded request is larger"):
        decode_forward_backward_request(body, max_decompressed_bytes=7_999)


# ---------------------------------------------------------------------------------------------
# Fuzzing: nothing but WireError may come out


def _decode_or_wire_error(body, encoding=None):
    try:
        decode_forward_backward_request(body, encoding, max_decompressed_bytes=1 << 20)
    except WireError:
        pass


VALID_BODY = sdk_post(
    [
        datum([1, 2, 3], target_tokens=[2, 3, 4], weights=[0.0, 1.0, 1.0]),
        datum([4, 5], target_tokens=torch.tensor([[0, 0, 7], [0, 0, 0], [0, 1, 0], [0, 0, 0]]),
              weights=torch.tensor([[0.0, 0.0, 1.0], [0, 0, 0], [0, 0.5, 0], [0, 0, 0]])),
    ],
    "ppo",
    {"clip_low_threshold": 0.8, "loss_id": "x"},
)[0]
FUZZ = settings(max_examples=300, deadline=None, database=None, suppress_health_check=[HealthCheck.too_slow])


@FUZZ
@given(st.binary(max_size=200), st.sampled_from([None, "zstd", "gzip"]))
def test_fuzz_random_bytes(body, encoding):
    _decode_or_wire_error(body, encoding)


@FUZZ
@given(st.lists(st.tuples(st.integers(0, len(VALID_BODY) - 1), st.integers(0, 255),
                          st.sampled_from(["set", "insert", "delete"])), max_size=6),
       st.one_of(st.none(), st.integers(0, len(VALID_BODY))), st.booleans())
def test_fuzz_mutated_sdk_body(edits, cut, compress):
    body = bytearray(VALID_BODY[:cut])
    for pos, byte, op in edits:
        pos = min(pos, len(body))
        if op == "set" and pos < len(body):
            body[pos] = byte
        elif op == "insert":
            body.insert(pos, byte)
        elif pos < len(body):
            del body[pos]
    _decode_or_wire_error(bytes(body))
    if compress:  # and a damaged zstd frame around the intact body
        frame = bytearray(zstandard.ZstdCompressor().compress(VALID_BODY))
        for pos, byte, _ in edits:
            frame[pos % len(frame)] ^= byte
        _decode_or_wire_error(bytes(frame), "zstd")


def _ints_bytes(dtype):
    return st.lists(st.integers(-3, 8), max_size=8).map(lambda v: np.array(v, dtype).tobytes())


tensors = st.builds(
    lambda dtype, shape, dense, crow, col, values, sparse: pb.Tensor(
        dtype=dtype, shape=shape,
        **({"sparse_csr": pb.SparseCsr(crow_indices=crow, col_indices=col, values=values)} if sparse
           else {"dense": dense}),
    ),
    st.integers(0, 5), st.lists(st.integers(-2, 5), max_size=3), st.binary(max_size=48),
    _ints_bytes("<i8"), _ints_bytes("<i8"), st.binary(max_size=48), st.booleans(),
)


@FUZZ
@given(st.dictionaries(st.sampled_from(["weights", "target_tokens", "x"]), tensors, max_size=3),
       st.binary(max_size=12))
def test_fuzz_structured_tensors(inputs, tokens):
    msg = pb.ForwardBackwardRequest()
    d = msg.data.add()
    d.model_input.add().encoded_text.tokens = tokens
    for name, tensor in inputs.items():
        d.loss_fn_inputs[name].CopyFrom(tensor)
    try:
        call = decode_forward_backward_request(msg.SerializeToString())
    except WireError:
        return
    for name, arr in call.data[0].loss_fn_inputs.items():
        assert arr.dtype in (np.float32, np.int64)
        if inputs[name].shape:
            assert list(arr.shape) == list(inputs[name].shape)
