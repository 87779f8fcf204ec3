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

import math
import zlib
from dataclasses import dataclass, field

import numpy as np
import zstandard

from . import tinker_wire_pb2 as pb
from ..models.vision import ImageIn

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

_I32, _I64, _F32 = np.dtype("<i4"), np.dtype("<i8"), np.dtype("<f4")
_REQUEST_DTYPES = {pb.DTYPE_FLOAT32: _F32, pb.DTYPE_INT64: _I64}
_STOP_REASONS = {"stop": pb.STOP_REASON_STOP, "length": pb.STOP_REASON_LENGTH}
_MAX_NDIM = 32  # numpy's limit is 32 or 64 depending on version
_ZSTD_INPUT_STEP = 1024  # one zstd block (>= 4 bytes) yields at most 128 KiB: <= 32 MiB per step


class WireError(ValueError):
    """A malformed request body; message says what is wrong (shown to the user as a 400)."""

    # (model_id, seq_id) when the request's envelope parsed and only its data is malformed: the
    # refusal can still count that seq_id as done (services/training.py `refused`).
    request: tuple[str, int] | None = None


@dataclass(frozen=True)
class ProvenanceSpan:
    """One run of a datum field: `length` positions that are positions [offset, offset + length)
    of the prompt (kind "prompt") or of the sampled tokens (kind "sampled") of `sequence_id`."""

    kind: str  # "prompt" | "sampled"
    sequence_id: str
    offset: int
    length: int


@dataclass
class WireDatum:
    tokens: np.ndarray  # int64 [N], all encoded_text chunks concatenated
    loss_fn_inputs: dict[str, np.ndarray]  # dense float32 or int64, in the declared shape (none: 1-D)
    images: list[ImageIn] = field(default_factory=list)  # image chunks, each at its place among the tokens
    # Runs tiling model_input / the rows of target_tokens; empty = no provenance.
    model_input_spans: list[ProvenanceSpan] = field(default_factory=list)
    loss_fn_input_spans: list[ProvenanceSpan] = field(default_factory=list)


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
        data = _decode_data_together(msg.data, max_decompressed_bytes)
        if data is None:  # not the common shape, or something in it is wrong: datum by datum, which says what
            allowance = _Allowance(max_decompressed_bytes)
            data = [_decode_datum(f"data[{i}]", d, allowance) for i, d in enumerate(msg.data)]
        return ForwardBackwardCall(
            model_id=msg.model_id,
            seq_id=msg.seq_id,
            data=data,
            loss_fn=msg.loss_fn,
            loss_fn_config=_decode_loss_fn_config(msg),
            forward_only=msg.forward_only,
        )
    except WireError as e:
        e.request = (msg.model_id, msg.seq_id)
        raise


class _Allowance:
    """What is left of the byte budget for decoded arrays."""

    def __init__(self, nbytes: int):
        self.left = nbytes

    def take(self, nbytes: int, where: str) -> None:
        self.left -= nbytes
        if self.left < 0:
            raise WireError(f"{where}: the decoded request is larger than the server's limit")


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


def _decode_data_together(data, max_bytes: int) -> list[WireDatum] | None:
    """The datums of a request as the SDK sends them (text chunks, dense tensors), each field's
    values of every datum turned into one array at once and handed out as per-datum views: a request
    of many datums pays numpy's per-call cost per field, not per datum (64 datums x 1000 tokens:
    ~2.4 ms of the host's work before the pass, issue 42). None for anything else (an image, a
    sparse tensor, a size, shape or value that `_decode_datum` would refuse): that path decodes
    such a request and names what is wrong, so every refusal stays the one it was."""
    if not data:
        return []
    token_parts: list[np.ndarray] = []  # views of the body's bytes: one copy each, into the request's array
    token_counts: list[int] = []
    groups: dict[tuple[str, np.dtype], list[np.ndarray]] = {}  # one field's values, datum after datum
    fields: list[list[tuple[str, tuple[str, np.dtype], list[int]]]] = []  # per datum: (name, group, shape)
    spans: list[tuple[list[ProvenanceSpan], list[ProvenanceSpan]]] = []
    nbytes = 0
    for i, datum in enumerate(data):
        count = 0
        for chunk in datum.model_input:
            if chunk.WhichOneof("chunk") != "encoded_text":
                return None
            buf = chunk.encoded_text.tokens
            if len(buf) % 4:
                return None
            token_parts.append(np.frombuffer(buf, _I32))
            count += len(buf) >> 2
        token_counts.append(count)
        nbytes += count * 8  # widened to int64
        named = []
        for name, tensor in datum.loss_fn_inputs.items():
            dtype = _REQUEST_DTYPES.get(tensor.dtype)
            if dtype is None or tensor.WhichOneof("encoding") == "sparse_csr":
                return None
            shape, buf = tensor.shape[:], tensor.dense
            size, rest = divmod(len(buf), dtype.itemsize)
            if rest or len(shape) > _MAX_NDIM or (shape and (min(shape) < 0 or math.prod(shape) != size)):
                return None
            groups.setdefault((name, dtype), []).append(np.frombuffer(buf, dtype))
            named.append((name, (name, dtype), shape))
            nbytes += len(buf)
        fields.append(named)
        try:
            spans.append((_decode_spans(f"data[{i}].model_input_spans", datum.model_input_spans)
                          if datum.model_input_spans else [],
                          _decode_spans(f"data[{i}].loss_fn_input_spans", datum.loss_fn_input_spans)
                          if datum.loss_fn_input_spans else []))
        except WireError:
            return None
    if nbytes > max_bytes:
        return None
    tokens = np.concatenate(token_parts, dtype=np.int64) if token_parts else np.zeros(0, np.int64)
    if tokens.size and tokens.min() < 0:
        return None
    per_datum_tokens = np.split(tokens, np.cumsum(token_counts[:-1], dtype=np.int64))
    values = {(name, dtype): iter(np.split(np.concatenate(parts, dtype=dtype.newbyteorder("=")),
                                           np.cumsum([p.size for p in parts[:-1]], dtype=np.int64)))
              for (name, dtype), parts in groups.items()}
    out = []
    try:
        for toks, named, (model_spans, input_spans) in zip(per_datum_tokens, fields, spans):
            inputs = {name: next(values[key]).reshape(shape or [-1]) for name, key, shape in named}
            out.append(WireDatum(tokens=toks, loss_fn_inputs=inputs, model_input_spans=model_spans,
                                 loss_fn_input_spans=input_spans))
    except ValueError:  # numpy refuses a shape such as [0, 2**62, 2**62]
        return None
    return out


def _decode_datum(where: str, datum: pb.Datum, allowance: _Allowance) -> WireDatum:
    parts, images = [], []
    for j, chunk in enumerate(datum.model_input):
        at = f"{where}.model_input[{j}]"
        kind = chunk.WhichOneof("chunk")
        if kind is None:
            raise WireError(f"{at}: empty chunk")
        if kind == "image":
            allowance.take(len(chunk.image.data), f"{at}.image.data")
            expected = chunk.image.expected_tokens if chunk.image.HasField("expected_tokens") else None
            images.append(ImageIn(sum(p.size for p in parts), chunk.image.data, chunk.image.format, expected))
            continue
        if kind != "encoded_text":
            raise WireError(f"{at}: {kind} chunks are not supported; this server takes text and image chunks")
        parts.append(_from_bytes(chunk.encoded_text.tokens, _I32, f"{at}.encoded_text.tokens"))
    n_tokens = sum(p.size for p in parts)
    allowance.take(n_tokens * 8, f"{where}.model_input")
    tokens = np.concatenate(parts).astype(np.int64) if parts else np.zeros(0, np.int64)
    if n_tokens and tokens.min() < 0:
        raise WireError(f"{where}.model_input: negative token id {tokens.min()}")
    inputs = {
        name: _decode_tensor(f"{where}.loss_fn_inputs[{name!r}]", tensor, allowance)
        for name, tensor in datum.loss_fn_inputs.items()
    }
    return WireDatum(tokens=tokens, loss_fn_inputs=inputs, images=images,
                     model_input_spans=_decode_spans(f"{where}.model_input_spans", datum.model_input_spans),
                     loss_fn_input_spans=_decode_spans(f"{where}.loss_fn_input_spans", datum.loss_fn_input_spans))


_SPAN_KINDS = {"prompt_tokens": "prompt", "sampled_tokens": "sampled"}


def _decode_spans(where: str, spans) -> list[ProvenanceSpan]:
    out = []
    for j, span in enumerate(spans):
        at = f"{where}[{j}]"
        arm = span.WhichOneof("span")
        if arm is None:
            raise WireError(f"{at}: has neither prompt_tokens nor sampled_tokens")
        run = getattr(span, arm)
        if not run.sequence_id:
            raise WireError(f"{at}.{arm}: sequence_id is empty")
        if run.offset < 0 or run.length < 0:
            raise WireError(f"{at}.{arm}: offset ({run.offset}) and length ({run.length}) must be >= 0")
        out.append(ProvenanceSpan(_SPAN_KINDS[arm], run.sequence_id, run.offset, run.length))
    return out


def _from_bytes(buf: bytes, dtype: np.dtype, where: str) -> np.ndarray:
    if len(buf) % dtype.itemsize:
        raise WireError(f"{where}: {len(buf)} bytes is not a whole number of {dtype.name} values")
    return np.frombuffer(buf, dtype)


def _decode_tensor(where: str, tensor: pb.Tensor, allowance: _Allowance) -> np.ndarray:
    dtype = _REQUEST_DTYPES.get(tensor.dtype)
    if dtype is None:
        name = pb.DType.Name(tensor.dtype) if tensor.dtype in pb.DType.values() else tensor.dtype
        raise WireError(f"{where}: unsupported dtype {name}; expected DTYPE_FLOAT32 or DTYPE_INT64")
    shape = list(tensor.shape)
    if any(s < 0 for s in shape) or len(shape) > _MAX_NDIM:
        raise WireError(f"{where}: invalid shape {shape}")
    if tensor.WhichOneof("encoding") == "sparse_csr":
        return _densify(where, tensor.sparse_csr, dtype, shape, allowance)
    # dense, or no encoding at all, which is how another encoder may write an empty dense tensor
    values = _from_bytes(tensor.dense, dtype, f"{where}.dense")
    if shape and math.prod(shape) != values.size:
        raise WireError(f"{where}: shape {shape} needs {math.prod(shape)} values, dense has {values.size}")
    allowance.take(values.nbytes, where)
    try:
        return values.astype(dtype.newbyteorder("="), copy=True).reshape(shape or [-1])
    except ValueError:  # numpy refuses e.g. [0, 2**62, 2**62] although it holds nothing
        raise WireError(f"{where}: invalid shape {shape}") from None


def _densify(
    where: str, csr: pb.SparseCsr, dtype: np.dtype, shape: list[int], allowance: _Allowance
) -> np.ndarray:
    if len(shape) != 2:
        raise WireError(f"{where}: sparse_csr needs a 2-D shape, got {shape}")
    rows, cols = shape
    at = f"{where}.sparse_csr"
    values = _from_bytes(csr.values, dtype, f"{at}.values")
    crow = _from_bytes(csr.crow_indices, _I64, f"{at}.crow_indices")
    col = _from_bytes(csr.col_indices, _I64, f"{at}.col_indices")
    if crow.size != rows + 1:
        raise WireError(f"{at}.crow_indices: has {crow.size} entries, shape {shape} needs {rows + 1}")
    if col.size != values.size:
        raise WireError(f"{at}: {col.size} col_indices for {values.size} values")
    if crow[0] != 0 or crow[-1] != values.size or (crow[1:] < crow[:-1]).any():
        raise WireError(f"{at}.crow_indices: must rise from 0 to the number of values ({values.size})")
    if values.size and (col.min() < 0 or col.max() >= cols):
        raise WireError(f"{at}.col_indices: out of range for {cols} columns")
    row = np.repeat(np.arange(rows), np.diff(crow))
    if ((row[1:] == row[:-1]) & (col[1:] <= col[:-1])).any():
        raise WireError(f"{at}.col_indices: must be strictly increasing within each row")
    allowance.take(rows * cols * dtype.itemsize, where)
    dense = np.zeros((rows, cols), dtype.newbyteorder("="))
    dense[row, col] = values
    return dense


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
