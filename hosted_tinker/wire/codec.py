"""The protobuf side of the Tinker HTTP API, as tinker==0.38.0 speaks it.

The SDK sends ``forward_backward``/``forward`` as a protobuf ``ForwardBackwardRequest`` (optionally
zstd-compressed) and only accepts ``ForwardBackwardOutput`` and ``SampleResponse`` future results as
protobuf. This module turns those bytes into numpy-based dataclasses and back, and nothing else: it
does not import the SDK, so the server never depends on the client package.

Decoding treats the body as hostile. Anything that is not what the SDK would send raises
``WireError`` (a ``ValueError``; the HTTP layer shows it as a 400) naming the datum and field, and no
other exception type escapes. Memory is bounded by ``max_decompressed_bytes`` twice over: for the
decompressed body (zstd frames need not declare their size, so the output is counted as it is
produced, never trusted from the header) and for the decoded arrays (a sparse CSR tensor can declare
a huge dense shape in a few bytes, and tokens double in size when widened).
The datums themselves are decoded in datums.py (this module: the envelope, the config, results).

Wire facts this relies on, all taken from the SDK's ``tinker/proto/{request,response}_conv.py``:

* token ids are int32 LE bytes (we widen to int64); dense tensors are float32 or int64 LE, the only
  dtypes the SDK sends; CSR indices are int64; an empty ``shape`` means 1-D; CSR is 2-D and is
  densified with 0, as the SDK auto-sparsifies 2-D ``target_tokens``/``weights`` torch tensors;
* ``loss_fn_config_v2`` carries every config entry (number or text) and is preferred; the legacy
  ``loss_fn_config`` only ever has the numeric ones;
* ``BatchedTensor.offsets`` are int64 *byte* offsets into ``data`` (the SDK divides by the item
  size), a per-datum shape is ``[n / prod(trailing_shape), *trailing_shape]``, and
  ``ArrayRecord.num_datums`` is authoritative, so it is set even when there are no fields;
* metric keys must be ``name:reduction`` with exactly one colon, or the SDK's chunk combiner crashes
  (``name, reduction = key.split(":")``) far from the cause, so we refuse them here;
* ``SampleResponse``: empty ``logprobs``/``prompt_logprobs`` bytes read back as None; top-k is
  row-major ``[length, k]`` int32 ids / float32 logprobs, an empty cell is ``(0, TOPK_EMPTY_LOGPROB)``,
  and ``length == 0`` or ``k == 0`` reads back as None;
* provenance (``Datum.model_input_spans`` / ``loss_fn_input_spans``): each span has exactly one arm
  (prompt or sampled), an empty list is the same as an absent one, and 0.38 allows ``length == 0``.
  Decoding checks each span on its own (arm, non-empty id, ``offset >= 0``, ``length >= 0``);
  whether the runs tile their field is the loss side's check (``services/provenance.py``).
"""

from __future__ import annotations

import zlib
from dataclasses import dataclass

import numpy as np
import zstandard

from . import tinker_wire_pb2 as pb
from .datums import ProvenanceSpan, WireDatum, WireError, decode_data

__all__ = [
    "TOPK_EMPTY_LOGPROB",
    "TensorOut",
    "ForwardBackwardCall",
    "ProvenanceSpan",
    "SampledSequenceOut",
    "TopkOut",
    "WireDatum",
    "WireError",
    "decode_forward_backward_request",
    "encode_forward_backward_output",
    "encode_sample_response",
]

TOPK_EMPTY_LOGPROB = -99999.0
"""Logprob of an empty top-k cell (its token id is 0); the SDK's ``MASK_LOGPROB``."""

_I32, _I64, _F32 = np.dtype("<i4"), np.dtype("<i8"), np.dtype("<f4")  # the wire's little-endian values
_STOP_REASONS = {"stop": pb.STOP_REASON_STOP, "length": pb.STOP_REASON_LENGTH}
_ZSTD_INPUT_STEP = 1024  # one zstd block (>= 4 bytes) yields at most 128 KiB: <= 32 MiB per step


@dataclass
class ForwardBackwardCall:
    model_id: str
    seq_id: int
    data: list[WireDatum]
    loss_fn: str
    loss_fn_config: dict[str, float | str]
    forward_only: bool


@dataclass
class TopkOut:
    token_ids: np.ndarray  # int [length, k]; empty cell: 0
    logprobs: np.ndarray  # float [length, k]; empty cell: TOPK_EMPTY_LOGPROB


@dataclass
class TensorOut:
    """A 2-D tensor for a ``SampleResponse``: ``dense`` is its every value; with ``csr`` = (crow, col), int64,
    only those cells go out, as sparse CSR (the layout the request used)."""

    dense: np.ndarray
    csr: tuple[np.ndarray, np.ndarray] | None = None


@dataclass
class SampledSequenceOut:
    tokens: list[int] | np.ndarray
    logprobs: np.ndarray | None  # one per token, or None when not requested
    stop_reason: str  # "stop" | "length"
    topk_sampled_logprobs: TopkOut | None = None


# ---------------------------------------------------------------------------------------------
# Request decoding


def decode_forward_backward_request(
    body: bytes, content_encoding: str | None = None, *, max_decompressed_bytes: int = 1 << 30
) -> ForwardBackwardCall:
    """Decode a ``ForwardBackwardRequest`` body as the SDK posts it to ``/api/v1/forward_backward``.

    ``content_encoding`` is the request's Content-Encoding header (identity, zstd or gzip).
    ``max_decompressed_bytes`` caps both the decompressed body and the total size of the decoded
    arrays. Raises ``WireError`` for anything malformed.
    """
    raw = _decompress(body, content_encoding, max_decompressed_bytes)
    msg = pb.ForwardBackwardRequest()
    try:
        msg.ParseFromString(raw)
    except Exception as e:  # DecodeError from upb; the pure-Python parser also leaks e.g. UnicodeDecodeError
        raise WireError(f"body is not a valid ForwardBackwardRequest protobuf ({e})") from None
    try:
        return ForwardBackwardCall(
            model_id=msg.model_id,
            seq_id=msg.seq_id,
            data=decode_data(msg.data, max_decompressed_bytes),
            loss_fn=msg.loss_fn,
            loss_fn_config=_decode_loss_fn_config(msg),
            forward_only=msg.forward_only,
        )
    except WireError as e:
        e.request = (msg.model_id, msg.seq_id)
        raise


def _decompress(body: bytes, content_encoding: str | None, limit: int) -> bytes:
    encoding = (content_encoding or "identity").strip().lower()
    if encoding == "identity":
        return body
    if encoding == "zstd":
        return _unzstd(body, limit)
    if encoding == "gzip":
        return _gunzip(body, limit)
    raise WireError(f"unsupported Content-Encoding {content_encoding!r} (use zstd, gzip or none)")


def _too_big(limit: int) -> WireError:
    return WireError(f"body decompresses to more than {limit} bytes")


def _unzstd(body: bytes, limit: int) -> bytes:
    # Feed the input in small steps so that no single call can expand far past the limit, frame by
    # frame so that a truncated frame is an error rather than silently short output.
    view, pos, out, total = memoryview(body), 0, [], 0
    try:
        while True:
            frame = zstandard.ZstdDecompressor().decompressobj()
            while not frame.eof and pos < len(view):
                end = min(pos + _ZSTD_INPUT_STEP, len(view))
                piece = frame.decompress(view[pos:end])
                pos = end
                total += len(piece)
                if total > limit:
                    raise _too_big(limit)
                out.append(piece)
            if not frame.eof:
                raise WireError("zstd body is truncated")
            pos -= len(frame.unused_data)
            if pos == len(view):
                return b"".join(out)
    except zstandard.ZstdError as e:
        raise WireError(f"body is not valid zstd ({e})") from None


def _gunzip(body: bytes, limit: int) -> bytes:
    d = zlib.decompressobj(wbits=16 + zlib.MAX_WBITS)
    try:
        out = d.decompress(body, limit + 1)
    except zlib.error as e:
        raise WireError(f"body is not valid gzip ({e})") from None
    if len(out) > limit:
        raise _too_big(limit)
    if not d.eof or d.unused_data:
        raise WireError("gzip body is truncated or has trailing data")
    return out


def _decode_loss_fn_config(msg: pb.ForwardBackwardRequest) -> dict[str, float | str]:
    if not msg.loss_fn_config_v2:
        return dict(msg.loss_fn_config)
    config: dict[str, float | str] = {}
    for key, value in msg.loss_fn_config_v2.items():
        kind = value.WhichOneof("value")
        if kind is None:
            raise WireError(f"loss_fn_config_v2[{key!r}]: has neither a number nor a text value")
        config[key] = getattr(value, kind)
    return config


# ---------------------------------------------------------------------------------------------
# Result encoding (server bugs, not client input, so these raise plain ValueError)


def encode_forward_backward_output(
    outputs: list[dict[str, np.ndarray]],
    metrics: dict[str, float],
    loss_fn_output_type: str = "ArrayRecord",
) -> bytes:
    """Encode one datum's outputs per request datum, plus ``name:reduction`` metrics.

    Each field becomes one ``BatchedTensor`` over all datums: float32 for float arrays, int64 for
    integer/bool ones. A per-datum array may be 0-D (sent as 1-D of length 1), 1-D or N-D; the
    trailing dimensions must agree across datums.
    """
    names = set(outputs[0]) if outputs else set()
    for i, out in enumerate(outputs):
        if set(out) != names:
            raise ValueError(
                f"output {i} has fields {sorted(out)} but output 0 has {sorted(names)}; "
                "every datum must carry the same fields"
            )
    record = pb.ArrayRecord(type_tag=loss_fn_output_type, num_datums=len(outputs))
    for name in sorted(names):
        _fill_batched(record.fields[name], name, [np.asarray(out[name]) for out in outputs])
    msg = pb.ForwardBackwardOutput(loss_fn_output_type=loss_fn_output_type, loss_fn_outputs=[record])
    for key, value in metrics.items():
        if key.count(":") != 1:
            raise ValueError(f"metric key {key!r} must be 'name:reduction' with exactly one ':'")
        msg.metrics[key] = float(value)
    return msg.SerializeToString()


def _fill_batched(bt: pb.BatchedTensor, name: str, arrays: list[np.ndarray]) -> None:
    arrays = [a.reshape(1) if a.ndim == 0 else a for a in arrays]
    kinds = {a.dtype.kind for a in arrays}
    if kinds <= {"f"}:
        dtype, bt.dtype = _F32, pb.DTYPE_FLOAT32
    elif kinds <= {"i", "u", "b"}:
        dtype, bt.dtype = _I64, pb.DTYPE_INT64
    else:
        raise ValueError(f"field {name!r}: need all-float or all-integer arrays, got kinds {sorted(kinds)}")
    trailing = arrays[0].shape[1:]
    if any(a.shape[1:] != trailing for a in arrays):
        raise ValueError(f"field {name!r}: per-datum arrays disagree on their trailing dimensions")
    bt.trailing_shape.extend(trailing)
    bt.data = b"".join(a.astype(dtype, copy=False).tobytes() for a in arrays)
    sizes = [a.size * dtype.itemsize for a in arrays]
    bt.offsets = np.cumsum([0, *sizes], dtype=_I64).tobytes()


def encode_sample_response(
    sequences: list[SampledSequenceOut],
    prompt_logprobs: np.ndarray | None = None,
    topk_prompt_logprobs: TopkOut | None = None,
    prompt_cache_hit_tokens: int = 0,
    target_prompt_logprobs: TensorOut | None = None,
    prompt_alt_tokens: tuple[np.ndarray, np.ndarray] | None = None,
) -> bytes:
    """Encode a ``SampleResponse``.

    ``prompt_logprobs`` has one float per prompt token, NaN where there is none (always index 0).
    ``target_prompt_logprobs`` is float32 ``[len(prompt) - 1, K]``; ``prompt_alt_tokens`` is (token ids,
    logprobs), both ``[len(prompt) - 1, k]``, sent dense as int64 and float32.
    """
    msg = pb.SampleResponse(prompt_cache_hit_tokens=prompt_cache_hit_tokens)
    for i, seq in enumerate(sequences):
        if seq.stop_reason not in _STOP_REASONS:
            raise ValueError(f"sequence {i}: stop_reason {seq.stop_reason!r} is not 'stop' or 'length'")
        tokens = _int32_bytes(seq.tokens, f"sequence {i} tokens")
        out = msg.sequences.add(stop_reason=_STOP_REASONS[seq.stop_reason], tokens=tokens)
        if seq.logprobs is not None:
            logprobs = np.asarray(seq.logprobs, _F32).reshape(-1)
            if logprobs.size * 4 != len(tokens):
                raise ValueError(f"sequence {i}: {logprobs.size} logprobs for {len(tokens) // 4} tokens")
            out.logprobs = logprobs.tobytes()
        if seq.topk_sampled_logprobs is not None:
            _fill_topk(out.topk_sampled_logprobs, seq.topk_sampled_logprobs, f"sequence {i} top-k")
    if prompt_logprobs is not None:
        msg.prompt_logprobs = np.asarray(prompt_logprobs, _F32).reshape(-1).tobytes()
    if topk_prompt_logprobs is not None:
        _fill_topk(msg.topk_prompt_logprobs, topk_prompt_logprobs, "prompt top-k")
    if target_prompt_logprobs is not None:
        _fill_tensor(msg.target_prompt_logprobs, target_prompt_logprobs, _F32)
    if prompt_alt_tokens is not None:
        tokens, logprobs = prompt_alt_tokens
        _fill_tensor(msg.prompt_alt_tokens.tokens, TensorOut(tokens), _I64)
        _fill_tensor(msg.prompt_alt_tokens.logprobs, TensorOut(logprobs), _F32)
    return msg.SerializeToString()


def _fill_tensor(msg: pb.Tensor, tensor: TensorOut, dtype: np.dtype) -> None:
    """A 2-D ``Tensor`` as the SDK's ``_tensor_data_from_proto`` reads it: values in ``dtype``, CSR indices int64."""
    dense = np.asarray(tensor.dense)
    msg.dtype = pb.DTYPE_FLOAT32 if dtype == _F32 else pb.DTYPE_INT64
    msg.shape.extend(dense.shape)
    if tensor.csr is None:
        msg.dense = dense.astype(dtype).tobytes()
        return
    crow, col = (np.asarray(a, _I64) for a in tensor.csr)
    rows = np.repeat(np.arange(crow.size - 1), np.diff(crow))
    msg.sparse_csr.values = dense[rows, col].astype(dtype).tobytes()
    msg.sparse_csr.crow_indices = crow.tobytes()
    msg.sparse_csr.col_indices = col.tobytes()


def _int32_bytes(values: list[int] | np.ndarray, what: str) -> bytes:
    a = np.asarray(values)
    if a.size == 0:
        return b""
    if a.dtype.kind not in "iub" or a.min() < -(2**31) or a.max() >= 2**31:
        raise ValueError(f"{what}: need int32 token ids, got {a.dtype} in [{a.min()}, {a.max()}]")
    return a.astype(_I32).reshape(-1).tobytes()


def _fill_topk(msg: pb.TopkLogprobs, topk: TopkOut, what: str) -> None:
    logprobs = np.asarray(topk.logprobs, _F32)
    if logprobs.ndim != 2 or np.shape(topk.token_ids) != logprobs.shape:
        raise ValueError(
            f"{what}: token_ids {np.shape(topk.token_ids)} and logprobs {logprobs.shape} "
            "must both be [length, k]"
        )
    msg.length, msg.k = logprobs.shape
    msg.token_ids = _int32_bytes(topk.token_ids, f"{what} token_ids")
    msg.logprobs = logprobs.tobytes()
