"""Sampling endpoints: sampling sessions, `samplers/{id}`, and `asample` (sample + compute_logprobs)."""

from __future__ import annotations

import base64
import binascii
from dataclasses import replace
from pathlib import Path
from typing import Any

import numpy as np
from fastapi import APIRouter, Depends, HTTPException
from pydantic import Field

from ..accounts.access import Access
from ..checkpoints.paths import TinkerPath
from ..sampling.jobs import SampleJob
from ..sampling.prompt_scoring import MAX_PROMPT_K, CsrLayout, PromptTargets
from ..sampling.records import sequence_ids
from ..server.core import Server
from ..server.served_models import ServedModel
from ..services import served_model
from ..services.sampling import SamplingRequests, sample_job
from ..services.training import checkpoint_to_load
from ..models.vision import ImageError, ImageIn, Pixels, no_images
from .deps import get_access, get_sampling, get_server, require_owner
from .schemas import Body

router = APIRouter()


class CreateSamplingSessionRequest(Body):
    session_id: str
    sampling_session_seq_id: int = Field(ge=0)
    base_model: str | None = None
    model_path: str | None = None


class SamplingParamsIn(Body):
    max_tokens: int | None = Field(None, ge=1)
    seed: int | None = None
    stop: str | list[str] | list[int] | None = None
    temperature: float = Field(1.0, ge=0, allow_inf_nan=False)
    top_k: int = -1
    top_p: float = Field(1.0, gt=0, le=1)


class TensorDataIn(Body):
    """The SDK's `TensorData` as JSON: flat `data`, and for sparse CSR the row pointers and column indices."""

    data: list[int | float]
    dtype: str
    shape: list[int] | None = None
    sparse_crow_indices: list[int] | None = None
    sparse_col_indices: list[int] | None = None


class AsampleRequest(Body):
    sampling_session_id: str
    seq_id: int = Field(ge=0)
    num_samples: int = Field(1, ge=1)
    prompt: dict[str, Any]
    sampling_params: SamplingParamsIn
    prompt_logprobs: bool | None = False
    topk_prompt_logprobs: int = Field(0, ge=0, le=100)
    topk_sample_logprobs: int = Field(0, ge=0, le=100)
    prompt_alt_tokens_k: int = Field(0, ge=0, le=MAX_PROMPT_K)
    prompt_logprobs_last_n: int | None = Field(None, ge=1)
    target_prompt_logprobs: TensorDataIn | None = None
    record_stability_info: bool | None = False


def sampling_session_id(session_id: str, seq: int) -> str:
    return f"{session_id}:sample:{seq}"


@router.post("/api/v1/create_sampling_session")
def create_sampling_session(body: CreateSamplingSessionRequest, owner: str = Depends(require_owner),
                            access: Access = Depends(get_access), sampling: SamplingRequests = Depends(get_sampling)):
    access.session(owner, body.session_id)
    sid = sampling_session_id(body.session_id, body.sampling_session_seq_id)
    if body.model_path is not None:
        spec = checkpoint_to_load(access, owner, body.model_path, with_optimizer=False,
                                  max_rank=sampling.config.max_lora_rank, purpose="sample")
        ckpt_dir, path = str(spec.checkpoint_dir), body.model_path
    elif body.base_model is not None:
        ckpt_dir, path = None, None
    else:
        raise HTTPException(400, "create_sampling_session needs model_path or base_model")
    sampling.open_session(owner, body.session_id, sid, body.base_model, path, ckpt_dir)
    return {"type": "create_sampling_session", "sampling_session_id": sid}


@router.get("/api/v1/samplers/{sampler_id}")
def get_sampler(sampler_id: str, owner: str = Depends(require_owner), access: Access = Depends(get_access)):
    row = access.sampler(owner, sampler_id).row
    return {"sampler_id": sampler_id, "base_model": row.base_model, "model_path": row.model_path}


def _prompt(prompt: dict, served: ServedModel) -> tuple[list[int], Pixels | None]:
    """The prompt's tokens, each image's placeholder tokens in its place, and its images' pixels (or None)."""
    chunks = prompt.get("chunks") or []
    if not isinstance(chunks, list) or not all(isinstance(c, dict) for c in chunks):
        raise HTTPException(400, "prompt.chunks must be a list of chunk objects, e.g. "
                                 '[{"type": "encoded_text", "tokens": [1, 2, 3]}]')
    tokens: list[int] = []
    images: list[ImageIn] = []
    for i, chunk in enumerate(chunks):
        kind = chunk.get("type", "encoded_text")
        if kind == "image":
            images.append(_image_chunk(i, chunk, len(tokens), served))
            continue
        if kind != "encoded_text":
            raise HTTPException(400, f"prompt chunk {i} is {kind!r}: this server takes encoded_text and image chunks")
        toks = chunk.get("tokens")
        if not isinstance(toks, list) or not all(isinstance(t, int) for t in toks):
            raise HTTPException(400, f"prompt chunk {i}: tokens must be a list of integers")
        tokens.extend(toks)
    if not images:
        return tokens, None
    try:
        served.images.check_count(len(images))
        expanded, pixels = served.images.expand("prompt", np.asarray(tokens, dtype=np.int64), images)
    except ImageError as e:
        raise HTTPException(400, str(e)) from None
    return expanded.tolist(), pixels


def _image_chunk(i: int, chunk: dict, position: int, served: ServedModel) -> ImageIn:
    """An image chunk of the JSON wire (base64 `data`) as the image encoder takes it."""
    if served.images is None:
        raise HTTPException(400, str(no_images(f"prompt chunk {i}", served.name)))
    data, fmt, expected = chunk.get("data"), chunk.get("format"), chunk.get("expected_tokens")
    if not isinstance(data, str) or not isinstance(fmt, str) or not (expected is None or isinstance(expected, int)):
        raise HTTPException(400, f"prompt chunk {i}: an image chunk needs data (base64), format ('png' or 'jpeg') "
                                 "and optionally expected_tokens (an integer)")
    try:
        raw = base64.b64decode(data, validate=True)
    except binascii.Error:
        raise HTTPException(400, f"prompt chunk {i}: image data is not valid base64") from None
    return ImageIn(position, raw, fmt, expected)


def build_job(server: Server, served: ServedModel, body: AsampleRequest, adapter_dir: str | None) -> SampleJob:
    """Validate a sample request against the model it samples and the server's limits."""
    cfg = server.config
    if body.num_samples > cfg.max_num_samples:
        raise HTTPException(400, f"num_samples {body.num_samples} is above this server's limit of {cfg.max_num_samples} "
                                 "(max_num_samples)")
    prompt, pixels = _prompt(body.prompt, served)
    sp = body.sampling_params
    stop_ids, stop_strings = _stops(sp.stop, served)
    job = sample_job(served, prompt, max_tokens=sp.max_tokens, default_max_tokens=cfg.default_max_tokens,
                     top_k=sp.top_k, stop_strings=stop_strings, stop_token_ids=stop_ids, num_samples=body.num_samples,
                     adapter_id=adapter_dir, temperature=sp.temperature, top_p=sp.top_p, seed=sp.seed,
                     prompt_logprobs=bool(body.prompt_logprobs), topk_prompt_logprobs=body.topk_prompt_logprobs,
                     topk_sample_logprobs=body.topk_sample_logprobs, prompt_alt_tokens_k=body.prompt_alt_tokens_k,
                     pixels=pixels)
    n_last = body.prompt_logprobs_last_n  # prompt scoring, Tinker's own: checked once the prompt is known usable
    if n_last is not None and not (body.prompt_logprobs or body.topk_prompt_logprobs):
        raise HTTPException(400, "prompt_logprobs_last_n needs prompt_logprobs or topk_prompt_logprobs")
    if n_last is not None and n_last > len(prompt) - 1:
        raise HTTPException(400, f"prompt_logprobs_last_n must be between 1 and len(prompt) - 1 = {len(prompt) - 1}")
    targets = None
    if body.target_prompt_logprobs is not None:
        targets = prompt_targets(body.target_prompt_logprobs, len(prompt), served.runtime.vocab_size)
    return replace(job, prompt_logprobs_last_n=n_last, prompt_targets=targets)


def _stops(stop: str | list[str] | list[int] | None, served: ServedModel) -> tuple[frozenset[int], tuple[str, ...]]:
    """Tinker's `stop` as (stop token ids, stop strings): unset stops at the end of sequence; token ids
    replace it ([] = no stopping at all, not even at EOS), and so do strings."""
    if stop is None:
        return frozenset(served.eos_token_ids), ()
    if isinstance(stop, str):
        return frozenset(), (stop,)
    if all(isinstance(s, int) for s in stop):
        return frozenset(stop), ()
    if all(isinstance(s, str) for s in stop):
        return frozenset(), tuple(stop)
    raise HTTPException(400, "stop must be a string, a list of strings, or a list of token ids")


def prompt_targets(t: TensorDataIn, prompt_len: int, vocab_size: int) -> PromptTargets:
    """`target_prompt_logprobs` checked against the prompt and the vocabulary (see prompt_scoring.py)."""
    field = "target_prompt_logprobs"
    if t.dtype != "int64":
        raise HTTPException(400, f"{field} must be an int64 tensor of token ids, got dtype {t.dtype!r}")
    rows = prompt_len - 1
    if t.shape is None or len(t.shape) != 2 or t.shape[0] != rows or not 1 <= t.shape[1] <= MAX_PROMPT_K:
        raise HTTPException(400, f"{field} has shape {t.shape}; expected [len(prompt) - 1, K] = [{rows}, K] "
                                 f"with 1 <= K <= {MAX_PROMPT_K}")
    values = np.asarray(t.data)
    if values.size and values.dtype.kind != "i":
        raise HTTPException(400, f"{field} values must be integer token ids (or -1), within int64")
    sparse = t.sparse_crow_indices is not None or t.sparse_col_indices is not None
    layout = _csr_layout(t, rows, t.shape[1]) if sparse else None
    expected = layout.col.size if layout is not None else rows * t.shape[1]
    if values.size != expected:
        raise HTTPException(400, f"{field} has {values.size} values, expected {expected} "
                                 f"({'one per sparse_col_indices entry' if sparse else f'dense shape {t.shape}'})")
    bad = values[(values < -1) | (values >= vocab_size)]
    if bad.size:
        raise HTTPException(400, f"{field} token {int(bad[0])} is outside the vocabulary [0, {vocab_size}) "
                                 "(-1 asks for nothing)")
    ids = np.full((rows, t.shape[1]), -1, dtype=np.int64)
    if layout is None:
        ids[:] = values.reshape(rows, t.shape[1])
    else:
        ids[layout.cells()] = values
    return PromptTargets(ids, layout)


def _csr_layout(t: TensorDataIn, rows: int, cols: int) -> CsrLayout:
    """The cells a sparse CSR `target_prompt_logprobs` lists, checked as torch's `check_invariants` would."""
    where = "target_prompt_logprobs sparse CSR"
    if t.sparse_crow_indices is None or t.sparse_col_indices is None:
        raise HTTPException(400, f"{where}: sparse_crow_indices and sparse_col_indices go together")
    crow = np.asarray(t.sparse_crow_indices, dtype=np.int64)
    col = np.asarray(t.sparse_col_indices, dtype=np.int64)
    if crow.size != rows + 1 or crow[0] != 0 or crow[-1] != col.size or (np.diff(crow) < 0).any():
        raise HTTPException(400, f"{where}: sparse_crow_indices must have {rows + 1} entries (rows + 1), rising from "
                                 f"0 to the number of sparse_col_indices ({col.size})")
    if col.size and (col.min() < 0 or col.max() >= cols):
        raise HTTPException(400, f"{where}: sparse_col_indices must be in [0, {cols})")
    layout = CsrLayout(crow, col)
    row = layout.cells()[0]
    if ((row[1:] == row[:-1]) & (col[1:] <= col[:-1])).any():
        raise HTTPException(400, f"{where}: sparse_col_indices must be strictly increasing within each row")
    return layout


@router.post("/api/v1/asample")
def asample(body: AsampleRequest, owner: str = Depends(require_owner), server: Server = Depends(get_server),
            access: Access = Depends(get_access), sampling: SamplingRequests = Depends(get_sampling)):
    grant = access.sampler(owner, body.sampling_session_id)  # the checkpoint it samples, checked again now
    existing = server.store.futures.request_id_of(body.sampling_session_id, body.seq_id)
    if existing is None:
        served = served_model(server, grant.row.base_model)  # the session's model, whatever its prompt says
        job = build_job(server, served, body, grant.adapter_dir)
        if grant.adapter_dir is not None and not Path(grant.adapter_dir).is_dir():
            raise HTTPException(404, f"the weights of sampling session {body.sampling_session_id!r} were deleted")
        if server.sample_records.request_was_recorded(body.sampling_session_id, body.seq_id):
            # its future was pruned, its records were not: new samples must not reuse their ids
            raise HTTPException(400, f"seq_id {body.seq_id} of sampling session {body.sampling_session_id!r} was "
                                     "already used; each sample request needs a new seq_id")
        request_id = sampling.submit_for_future(
            owner, served, body.sampling_session_id, body.seq_id, job,
            record=lambda request_id: _recorder(server, body, grant.row, request_id, job))
    else:
        request_id = existing
    # Fixed at submission: a deduplicated re-POST of the same seq_id hands out the same ids.
    return {"request_id": request_id,
            "sample_sequence_ids": sequence_ids(body.sampling_session_id, body.seq_id, body.num_samples)}


def _recorder(server: Server, body: AsampleRequest, row, request_id: str, job: SampleJob):
    """What stores the request's samples for stable_reinforce, or None when not asked to."""
    if not body.record_stability_info:
        return None
    version = None
    if row.model_path is not None:
        where = TinkerPath.parse(row.model_path)
        ckpt = server.store.checkpoints.get(where.run, where.checkpoint_id)
        version = None if ckpt is None else ckpt.created_at
    return server.sample_records.recorder(
        request_id=request_id, owner=row.owner, session_id=row.session_id,
        sampling_session_id=body.sampling_session_id, seq_id=body.seq_id,
        weights=row.model_path or f"base:{row.base_model}", weights_version=version, job=job)
