"""A forward_backward's datums out of its protobuf (`decode_data`), for codec.py, and the types they come in.

Decoding treats the body as hostile, as codec.py says: anything the SDK would not send raises
`WireError` naming the datum and field, and the decoded arrays count against the request's byte
limit (`_Allowance`). Two paths give the same datums: a request as the SDK sends it (text chunks,
dense tensors) is decoded field by field over all its datums at once (`_decode_data_together`);
anything else, and anything wrong, datum by datum (`_decode_datum`), which names what is wrong.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import numpy as np

from . import tinker_wire_pb2 as pb
from ..models.vision import ImageIn

_I32, _I64, _F32 = np.dtype("<i4"), np.dtype("<i8"), np.dtype("<f4")
_REQUEST_DTYPES = {pb.DTYPE_FLOAT32: _F32, pb.DTYPE_INT64: _I64}
_MAX_NDIM = 32  # numpy's limit is 32 or 64 depending on version


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


def decode_data(data, max_bytes: int) -> list[WireDatum]:
    """The request's datums (its repeated `Datum` field), their arrays within `max_bytes` in all."""
    together = _decode_data_together(data, max_bytes)
    if together is not None:
        return together
    allowance = _Allowance(max_bytes)  # not the common shape, or something in it is wrong
    return [_decode_datum(f"data[{i}]", d, allowance) for i, d in enumerate(data)]


class _Allowance:
    """What is left of the byte budget for decoded arrays."""

    def __init__(self, nbytes: int):
        self.left = nbytes

    def take(self, nbytes: int, where: str) -> None:
        self.left -= nbytes
        if self.left < 0:
            raise WireError(f"{where}: the decoded request is larger than the server's limit")


def _decode_data_together(data, max_bytes: int) -> list[WireDatum] | None:
    """The datums of a request as the SDK sends them (text chunks, dense tensors), each field's
    values of every datum copied at once into one array and handed out as per-datum views: a
    request of many datums pays numpy's per-call cost per field, not per datum (64 datums x 1000
    tokens: ~1 ms of the host's work before the pass, issue 42). None for anything else (an image,
    a sparse tensor, a size, shape or value that `_decode_datum` would refuse): that path decodes
    such a request and names what is wrong, so every refusal stays the one it was."""
    gathered = _Gathered()
    for i, datum in enumerate(data):
        if not gathered.add(i, datum):
            return None
    return gathered.datums() if gathered.nbytes <= max_bytes else None


class _Gathered:
    """Every datum's pieces, views of the body's bytes, until they are copied out field by field."""

    def __init__(self):
        self.token_parts: list[np.ndarray] = []
        self.token_counts: list[int] = []  # per datum
        self.groups: dict[tuple[str, np.dtype], list[np.ndarray]] = {}  # one field's values, datum after datum
        self.fields: list[list[tuple[tuple[str, np.dtype], list[int]]]] = []  # per datum: (name, dtype), shape
        self.spans: list[tuple[list[ProvenanceSpan], list[ProvenanceSpan]]] = []  # per datum
        self.nbytes = 0  # of the decoded arrays, tokens widened to int64

    def add(self, i: int, datum: pb.Datum) -> bool:
        count = 0
        for chunk in datum.model_input:
            if chunk.WhichOneof("chunk") != "encoded_text":
                return False
            buf = chunk.encoded_text.tokens
            if len(buf) % 4:
                return False
            self.token_parts.append(np.frombuffer(buf, _I32))
            count += len(buf) >> 2
        named = []
        for name, tensor in datum.loss_fn_inputs.items():
            dtype = _REQUEST_DTYPES.get(tensor.dtype)
            if dtype is None or tensor.WhichOneof("encoding") == "sparse_csr":
                return False
            shape, buf = tensor.shape[:], tensor.dense
            size, rest = divmod(len(buf), dtype.itemsize)
            if rest or len(shape) > _MAX_NDIM or (shape and (min(shape) < 0 or math.prod(shape) != size)):
                return False
            self.groups.setdefault((name, dtype), []).append(np.frombuffer(buf, dtype))
            named.append(((name, dtype), shape))
            self.nbytes += len(buf)
        try:
            spans = (_decode_spans(f"data[{i}].model_input_spans", datum.model_input_spans)
                     if datum.model_input_spans else [],
                     _decode_spans(f"data[{i}].loss_fn_input_spans", datum.loss_fn_input_spans)
                     if datum.loss_fn_input_spans else [])
        except WireError:
            return False
        self.token_counts.append(count)
        self.nbytes += count * 8
        self.fields.append(named)
        self.spans.append(spans)
        return True

    def datums(self) -> list[WireDatum] | None:
        tokens = np.concatenate(self.token_parts, dtype=np.int64) if self.token_parts else np.zeros(0, np.int64)
        if tokens.size and tokens.min() < 0:
            return None
        values = {(name, dtype): iter(_split(np.concatenate(parts, dtype=dtype.newbyteorder("=")),
                                             [p.size for p in parts]))
                  for (name, dtype), parts in self.groups.items()}
        out = []
        try:
            for toks, named, (model_spans, input_spans) in zip(_split(tokens, self.token_counts), self.fields,
                                                                self.spans):
                inputs = {key[0]: next(values[key]).reshape(shape or [-1]) for key, shape in named}
                out.append(WireDatum(tokens=toks, loss_fn_inputs=inputs, model_input_spans=model_spans,
                                     loss_fn_input_spans=input_spans))
        except ValueError:  # numpy refuses a shape such as [0, 2**62, 2**62]
            return None
        return out


def _split(values: np.ndarray, sizes: list[int]) -> list[np.ndarray]:
    """`values` as consecutive views of these sizes."""
    return np.split(values, np.cumsum(sizes[:-1], dtype=np.int64))


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
