"""Datum provenance (shared/reference/rl-losses-v038.md §3): the tiling every loss checks, and the
resolution of stable_reinforce datums against recorded samples, with one test per rule. The
records here are built by hand (records.py's storage is tested in test_sample_records.py)."""

from __future__ import annotations

import numpy as np
import pytest

from hosted_tinker.runtime.losses import LossInputError, resolve_loss_config
from hosted_tinker.services.provenance import RecordNotFound, check_spans, loss_inputs, named_sequences, resolve
from hosted_tinker.sampling.records import SampleRecord, Unusable
from hosted_tinker.wire import ProvenanceSpan, WireDatum


def P(sid, offset, length):
    return ProvenanceSpan("prompt", sid, offset, length)


def S(sid, offset, length):
    return ProvenanceSpan("sampled", sid, offset, length)


def record(sid, prompt, tokens, logprobs):
    return SampleRecord(sequence_id=sid, session_id="sess", prompt=np.int32(prompt), tokens=np.int32(tokens),
                        logprobs=np.float32(logprobs), weights="base:m", weights_version=None,
                        temperature=1.0, top_k=-1, top_p=1.0)


# Turn 1: prompt [10, 11, 12] sampled [20, 21]; turn 2's prompt is turn 1's plus [13], sampled [30, 31, 32].
R1 = record("a:0:0", [10, 11, 12], [20, 21], [-0.5, -1.5])
R2 = record("a:1:0", [10, 11, 12, 20, 21, 13], [30, 31, 32], [-0.25, -2.0, -0.75])
RECORDS = {"a:0:0": R1, "a:1:0": R2}
FULL = [10, 11, 12, 20, 21, 13, 30, 31, 32]
# Full-sequence runs, then the cookbook's shift: inputs drop the last position, loss rows the first.
INPUT_SPANS = [P("a:0:0", 0, 3), S("a:0:0", 0, 2), P("a:1:0", 5, 1), S("a:1:0", 0, 2)]
LOSS_SPANS = [P("a:0:0", 1, 2), S("a:0:0", 0, 2), P("a:1:0", 5, 1), S("a:1:0", 0, 3)]


def multi_turn(**changes) -> WireDatum:
    """The two-turn datum as trajectory_to_data builds it; prompt rows target 0 like rl_loop's."""
    targets = np.int64(FULL[1:])
    adv = np.float32([0, 0, 1, 1, 0, 1, 1, 1])
    inputs = {"target_tokens": targets, "advantages": adv, "logprobs": np.zeros(8, np.float32)}
    d = WireDatum(tokens=np.int64(FULL[:-1]), loss_fn_inputs=inputs, model_input_spans=list(INPUT_SPANS),
                  loss_fn_input_spans=list(LOSS_SPANS))
    for key, value in changes.items():
        if key in inputs:
            inputs[key] = value
        else:
            setattr(d, key, value)
    return d


def test_multi_turn_datum_resolves_to_the_recorded_logprobs():
    """Several sampled runs from two requests: each sampled loss row gets its record's logprob."""
    assert named_sequences(multi_turn()) == {"a:0:0", "a:1:0"}
    out = resolve(3, multi_turn(), RECORDS)
    assert out.sampled_rows.tolist() == [False, False, True, True, False, True, True, True]
    assert out.recorded_logprobs.tolist() == [0, 0, -0.5, -1.5, 0, -0.25, -2.0, -0.75]


def test_placeholder_targets_on_prompt_rows_and_zero_length_runs_are_accepted():
    """rl_loop sends target 0 on prompt rows, and a Sampled(length=0) input run for a one-token
    sample; neither is compared or looked up."""
    targets = np.int64(FULL[1:])
    targets[:2] = 0
    spans = INPUT_SPANS[:3] + [S("unknown:9:9", 0, 0)] + INPUT_SPANS[3:]
    out = resolve(0, multi_turn(target_tokens=targets, model_input_spans=spans), RECORDS)
    assert out.sampled_rows.sum() == 5


def test_check_spans_tiling_and_pairing():
    """Rule 1, every loss: both lists or neither, each covering its field exactly."""
    check_spans(0, multi_turn())
    check_spans(0, multi_turn(model_input_spans=[], loss_fn_input_spans=[]))
    with pytest.raises(LossInputError, match="datum 2: has loss_fn_input_spans but no model_input_spans; "
                                             "provenance comes as a pair"):
        check_spans(2, multi_turn(model_input_spans=[]))
    with pytest.raises(LossInputError, match="datum 2: model_input_spans cover 7 positions but the datum has 8 "
                                             "model_input tokens"):
        check_spans(2, multi_turn(model_input_spans=INPUT_SPANS[:3] + [S("a:1:0", 0, 1)]))
    with pytest.raises(LossInputError, match="datum 2: loss_fn_input_spans cover 9 positions but the datum has 8 "
                                             "target_tokens rows"):
        check_spans(2, multi_turn(loss_fn_input_spans=LOSS_SPANS + [S("a:1:0", 0, 1)]))


def test_other_losses_never_look_records_up():
    """Rule 2: with any other loss, ids that do not exist are fine (rl/train.py attaches provenance
    to every RL datum, recorded or not); gspo uses the sampled rows as its default ratio rows."""
    cfg = resolve_loss_config("gspo", {})
    out = loss_inputs(0, multi_turn(), "gspo", cfg, 1, records={})
    assert out["sequence_ratio_mask"].tolist() == [0, 0, 1, 1, 0, 1, 1, 1]
    assert set(loss_inputs(0, multi_turn(), "importance_sampling", {}, 1, records={})) == {
        "target_tokens", "logprobs", "advantages"}


def rule_error(exc_type, datum, records=RECORDS):
    with pytest.raises(exc_type) as exc:
        resolve(4, datum, records)
    return str(exc.value)


def test_stable_reinforce_needs_provenance():
    msg = rule_error(LossInputError, multi_turn(model_input_spans=[], loss_fn_input_spans=[]))
    assert msg.startswith("datum 4: stable_reinforce needs provenance on every datum")


def test_unknown_or_foreign_sequence_is_not_found():
    msg = rule_error(RecordNotFound, multi_turn(), {**RECORDS, "a:1:0": Unusable("not found", not_found=True)})
    assert msg == "datum 4: model_input_spans[2] (prompt run of sequence_id 'a:1:0'): not found"


def test_unusable_record_says_why():
    msg = rule_error(LossInputError, multi_turn(), {**RECORDS, "a:0:0": Unusable("its record expired")})
    assert msg == "datum 4: model_input_spans[0] (prompt run of sequence_id 'a:0:0'): its record expired"


def test_run_past_the_recorded_tokens():
    msg = rule_error(LossInputError, multi_turn(loss_fn_input_spans=LOSS_SPANS[:3] + [S("a:1:0", 1, 3)]))
    assert msg == ("datum 4: loss_fn_input_spans[3] (sampled run of sequence_id 'a:1:0'): positions [1, 4) run "
                   "past the 3 recorded sampled tokens")
    msg = rule_error(LossInputError, multi_turn(model_input_spans=[P("a:0:0", 2, 3)] + INPUT_SPANS[1:]))
    assert "positions [2, 5) run past the 3 recorded prompt tokens" in msg


def test_input_tokens_must_be_the_recorded_ones():
    tokens = np.int64(FULL[:-1])
    tokens[4] = 99  # a sampled token of turn 1, as the datum's input
    msg = rule_error(LossInputError, multi_turn(tokens=tokens))
    assert msg == ("datum 4: model_input_spans[1] (sampled run of sequence_id 'a:0:0'): model_input[4] is 99 but "
                   "the recorded sampled token at position 1 is 21")


def test_sampled_targets_must_be_the_recorded_ones():
    targets = np.int64(FULL[1:])
    targets[6] = 7
    msg = rule_error(LossInputError, multi_turn(target_tokens=targets))
    assert msg == ("datum 4: loss_fn_input_spans[3] (sampled run of sequence_id 'a:1:0'): target_tokens[6] is 7 "
                   "but the recorded sampled token at position 1 is 31")


def test_nonzero_advantage_on_a_prompt_row():
    adv = np.float32([0, 0, 1, 1, 0.5, 1, 1, 1])
    msg = rule_error(LossInputError, multi_turn(advantages=adv))
    assert msg == ("datum 4: loss_fn_input_spans[2] (prompt run of sequence_id 'a:1:0'): advantages[4] = 0.5 on a "
                   "prompt row; stable_reinforce only accepts nonzero advantages on sampled tokens")
