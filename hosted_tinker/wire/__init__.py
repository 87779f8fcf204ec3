"""Protobuf wire format of the Tinker API (see codec.py)."""

from .codec import (
    TOPK_EMPTY_LOGPROB,
    ForwardBackwardCall,
    ProvenanceSpan,
    SampledSequenceOut,
    TopkOut,
    WireDatum,
    WireError,
    decode_forward_backward_request,
    encode_forward_backward_output,
    encode_sample_response,
)

__all__ = [
    "TOPK_EMPTY_LOGPROB",
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
