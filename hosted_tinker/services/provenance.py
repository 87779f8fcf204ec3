"""Datum provenance: which sampled sequence each run of a datum's tokens reproduces; checked by
`TrainingRequests.forward_backward` (services/training.py) before a request is queued.

A datum may carry two lists of runs (shared/reference/rl-losses-v038.md §3): `model_input_spans`
tile its input tokens, `loss_fn_input_spans` tile the rows of `target_tokens`. A run says "these
positions are positions [offset, offset + length) of the prompt (or of the sampled tokens) of
sequence `sequence_id`". Loss row i targets full-sequence position i + 1, so the loss runs are the
input runs shifted by one.

- `check_spans` (every loss): the lists come as a pair and each tiles its field exactly. The
  cookbook attaches provenance to every RL datum whatever the loss, so no other loss looks further.
- `resolve` (a loss with `needs_recorded_samples`: stable_reinforce): every run against the recorded
  samples: the record must be usable, the run inside it, input tokens and sampled targets equal to
  what was recorded, and advantages 0 on prompt rows. It returns the recorded sampler logprobs the
  loss uses instead of the client's.
Zero-length runs are legal (rl_loop sends one for a one-token sample) and are skipped.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Mapping

import numpy as np

from ..runtime.losses import LOSSES, LossInputError, prepare_inputs
from ..sampling.records import SampleRecord, Unusable
from ..wire.codec import ProvenanceSpan, WireDatum

FIELDS = ("model_input_spans", "loss_fn_input_spans")


class RecordNotFound(LookupError):
    """A datum names a sequence this API key never sampled (or another key's): a 404."""


@dataclass
class Resolved:
    recorded_logprobs: np.ndarray  # float32 [N]: recorded sampler logprob on loss rows under sampled runs, else 0
    sampled_rows: np.ndarray  # bool [N]: the loss rows under sampled runs


def has_provenance(datum: WireDatum) -> bool:
    return bool(datum.model_input_spans or datum.loss_fn_input_spans)


def check_spans(index: int, datum: WireDatum) -> None:
    """Rule 1, for every loss: both lists or neither, each tiling its field."""
    if not has_provenance(datum):
        return
    sizes = {"model_input_spans": len(datum.tokens),
             "loss_fn_input_spans": int(datum.loss_fn_inputs["target_tokens"].shape[0])}
    for name in FIELDS:
        spans: list[ProvenanceSpan] = getattr(datum, name)
        if not spans:
            other = FIELDS[1 - FIELDS.index(name)]
            raise LossInputError(f"datum {index}: has {other} but no {name}; provenance comes as a pair")
        covered = sum(s.length for s in spans)
        if covered != sizes[name]:
            what = "model_input tokens" if name == "model_input_spans" else "target_tokens rows"
            raise LossInputError(f"datum {index}: {name} cover {covered} positions but the datum has "
                                 f"{sizes[name]} {what}; the runs must tile it exactly")


def _runs(spans: list[ProvenanceSpan]):
    """(j, start position, span) of each non-empty run."""
    pos = 0
    for j, span in enumerate(spans):
        if span.length:
            yield j, pos, span
        pos += span.length


def sampled_rows(datum: WireDatum) -> np.ndarray:
    """bool [N]: the loss rows under sampled runs (all False without provenance)."""
    rows = np.zeros(int(datum.loss_fn_inputs["target_tokens"].shape[0]), bool)
    for _, pos, span in _runs(datum.loss_fn_input_spans):
        if span.kind == "sampled":
            rows[pos:pos + span.length] = True
    return rows


def named_sequences(datum: WireDatum) -> set[str]:
    return {span.sequence_id for name in FIELDS for _, _, span in _runs(getattr(datum, name))}


def resolve(index: int, datum: WireDatum, records: Mapping[str, SampleRecord | Unusable]) -> Resolved:
    """Rule 3 (stable_reinforce): check every run against its record; `records` holds every named id."""
    if not has_provenance(datum):
        raise LossInputError(
            f"datum {index}: stable_reinforce needs provenance on every datum (model_input_spans and "
            "loss_fn_input_spans naming recorded samples; Datum.with_provenance)")
    n = int(datum.loss_fn_inputs["target_tokens"].shape[0])
    out = Resolved(recorded_logprobs=np.zeros(n, np.float32), sampled_rows=np.zeros(n, bool))
    targets = datum.loss_fn_inputs["target_tokens"]
    advantages = datum.loss_fn_inputs["advantages"]
    for name in FIELDS:
        for j, pos, span in _runs(getattr(datum, name)):
            where = f"datum {index}: {name}[{j}] ({span.kind} run of sequence_id {span.sequence_id!r})"
            record = records[span.sequence_id]
            if isinstance(record, Unusable):
                raise (RecordNotFound if record.not_found else LossInputError)(f"{where}: {record.reason}")
            arm = record.prompt if span.kind == "prompt" else record.tokens
            end = span.offset + span.length
            if end > len(arm):
                raise LossInputError(
                    f"{where}: positions [{span.offset}, {end}) run past the {len(arm)} recorded "
                    f"{'prompt' if span.kind == 'prompt' else 'sampled'} tokens")
            recorded = arm[span.offset:end]
            rows = slice(pos, pos + span.length)
            if name == "model_input_spans":
                _same_tokens(where, "model_input", datum.tokens[rows], recorded, pos, span)
            elif span.kind == "sampled":
                _same_tokens(where, "target_tokens", targets[rows], recorded, pos, span)
                out.recorded_logprobs[rows] = record.logprobs[span.offset:end]
                out.sampled_rows[rows] = True
            else:
                bad = np.flatnonzero(advantages[rows] != 0)
                if bad.size:
                    p = pos + int(bad[0])
                    raise LossInputError(
                        f"{where}: advantages[{p}] = {float(advantages[p])!r} on a prompt row; stable_reinforce "
                        "only accepts nonzero advantages on sampled tokens")
    return out


def _same_tokens(where: str, field: str, got: np.ndarray, recorded: np.ndarray, pos: int, span: ProvenanceSpan):
    bad = np.flatnonzero(np.asarray(got, np.int64) != recorded)
    if bad.size:
        k = int(bad[0])
        raise LossInputError(
            f"{where}: {field}[{pos + k}] is {int(got[k])} but the recorded {span.kind} token at position "
            f"{span.offset + k} is {int(recorded[k])}")


def loss_inputs(index: int, datum: WireDatum, loss_fn: str, config: dict[str, float], num_datums: int,
                records: Mapping[str, SampleRecord | Unusable]) -> dict[str, np.ndarray]:
    """A validated datum's per-token inputs for the trainer, with its provenance checked (rule 1)
    and, for a loss that needs recorded samples, resolved against `records` (rule 3)."""
    check_spans(index, datum)
    sampled = recorded = None
    if LOSSES[loss_fn].needs_recorded_samples:
        resolved = resolve(index, datum, records)
        sampled, recorded = resolved.sampled_rows, resolved.recorded_logprobs
    elif has_provenance(datum):
        sampled = sampled_rows(datum)
    return prepare_inputs(index, loss_fn, config, datum.loss_fn_inputs, num_datums,
                          sampled_rows=sampled, recorded_logprobs=recorded)
