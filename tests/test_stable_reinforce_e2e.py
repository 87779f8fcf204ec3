"""Recorded samples and the SDK 0.38 RL losses end to end: the real SDK against a real server.

- asample hands out `sample_sequence_ids` fixed at submission, recording or not;
- `record_stability_info` samples train with stable_reinforce (forward too), which uses the
  recorded logprobs and never the client's copy;
- every validation rule of shared/reference/rl-losses-v038.md is a clear 4xx naming the datum,
  and the server goes on serving;
- records belong to their key (404) and session (400), survive kill -9, and expire.
"""

from __future__ import annotations

import sqlite3

import httpx
import numpy as np
import pytest
import tinker
from tinker import types

from helpers import BASE_MODEL, database
from hosted_tinker.wire import tinker_wire_pb2 as pb
from server_process import ServerProcess

pytestmark = pytest.mark.e2e
KEY = "tml-records-alice"
PROMPT = [21, 22, 23, 24, 25]


def sample(sampler, n=3, tokens=PROMPT, max_tokens=6):
    # stop=[]: no stop token, so every sequence has exactly max_tokens tokens
    return sampler.sample(types.ModelInput.from_ints(tokens), num_samples=n,
                          sampling_params=types.SamplingParams(max_tokens=max_tokens, stop=[], seed=3)).result()


def rl_loop_datum(seq, advantage=0.5, prompt=PROMPT, *, provenance=True, **override) -> types.Datum:
    """A datum exactly as recipes/rl_loop.py builds it for stable_reinforce (placeholder targets and
    logprobs on prompt rows, Sampled(length=0) input run for a one-token sample)."""
    p, s = len(prompt), len(seq.tokens)
    inputs = {"target_tokens": [0] * (p - 1) + list(seq.tokens), "logprobs": [0.0] * (p - 1) + list(seq.logprobs),
              "advantages": [0.0] * (p - 1) + [advantage] * s, **override}
    datum = types.Datum(model_input=types.ModelInput.from_ints(prompt + list(seq.tokens[:-1])), loss_fn_inputs=inputs)
    if not provenance:
        return datum
    sid = seq.sequence_id
    return datum.with_provenance(
        model_input=[types.PromptProvenanceSpan(sequence_id=sid, length=p),
                     types.SampledProvenanceSpan(sequence_id=sid, length=s - 1)],
        loss_fn_inputs=[types.PromptProvenanceSpan(sequence_id=sid, offset=1, length=p - 1),
                        types.SampledProvenanceSpan(sequence_id=sid, length=s)])


@pytest.fixture(scope="module")
def alice(server):
    with server.client(KEY) as sc:
        tc = sc.create_lora_training_client(base_model=BASE_MODEL, rank=8, seed=1).result()
        sampler = tc.save_weights_and_get_sampling_client(record_stability_info=True).result()
        yield sc, tc, sampler, sample(sampler)


def test_sequence_ids_are_fixed_at_submission_and_unique(server, alice):
    """Every asample answer carries one id per sample, recording or not; a deduplicated re-POST of
    the same (sampling_session_id, seq_id) hands out the same ids, a new seq_id new ones."""
    sc, tc, sampler, out = alice
    ids = [s.sequence_id for s in out.sequences]
    assert len(set(ids)) == 3 and all(ids)
    plain = sc.create_sampling_client(base_model=BASE_MODEL).result()
    unrecorded = [s.sequence_id for s in sample(plain, n=2).sequences]
    assert len(set(unrecorded)) == 2 and not set(unrecorded) & set(ids)
    body = {"sampling_session_id": sampler._sampling_session_id, "seq_id": 777_000, "num_samples": 2,
            "prompt": {"chunks": [{"type": "encoded_text", "tokens": PROMPT}]},
            "sampling_params": {"max_tokens": 2}, "record_stability_info": True}
    posts = [httpx.post(f"{server.base_url}/api/v1/asample", json=b, headers={"X-API-Key": KEY}, timeout=30).json()
             for b in (body, body, {**body, "seq_id": 777_001})]
    assert posts[0] == posts[1]  # same request, same ids
    assert len(posts[0]["sample_sequence_ids"]) == 2
    assert not set(posts[0]["sample_sequence_ids"]) & set(posts[2]["sample_sequence_ids"])
    # Once the request's future is pruned (a day after it finished), its recorded ids still live:
    # the seq_id is refused rather than handing the same ids to new samples.
    _wait(server, posts[0]["request_id"])
    with sqlite3.connect(database(server.data_dir)) as db:
        db.execute("DELETE FROM futures WHERE request_id=?", (posts[0]["request_id"],))
    r = httpx.post(f"{server.base_url}/api/v1/asample", json=body, headers={"X-API-Key": KEY}, timeout=30)
    assert r.status_code == 400 and "seq_id 777000" in r.json()["detail"] and "already used" in r.json()["detail"]


def _wait(server, request_id: str) -> None:
    while True:
        r = httpx.post(f"{server.base_url}/api/v1/retrieve_future", json={"request_id": request_id},
                       headers={"X-API-Key": KEY}, timeout=60)
        if r.headers["content-type"] != "application/json" or r.json().get("type") != "try_again":
            return


def test_stable_reinforce_trains_on_the_recorded_samples(alice):
    """rl_loop's datums train with stable_reinforce; forward gives the same loss; the client's
    logprobs are not used (corrupting them changes only the mismatch metric)."""
    sc, tc, sampler, out = alice
    one_token = sample(sampler, n=1, max_tokens=1).sequences[0]  # the zero-length input run
    data = [rl_loop_datum(s, adv) for s, adv in zip(out.sequences, (1.0, -0.5, 0.25))] + [rl_loop_datum(one_token)]
    fwd = tc.forward(data, "stable_reinforce").result()
    assert fwd.metrics["sampled_tokens:sum"] == 3 * 6 + 1
    assert fwd.metrics["datum_logprobs_mismatch:max"] == 0.0  # the SDK's copy is bit-identical
    assert abs(fwd.metrics["sampler_trainer_logprob_diff:mean"]) < 1e-4  # same weights as the sampler
    corrupted = [rl_loop_datum(s, adv, logprobs=[0.0] * (len(PROMPT) - 1) + [-1.0] * 6)
                 for s, adv in zip(out.sequences, (1.0, -0.5, 0.25))] + [rl_loop_datum(one_token)]
    fb = tc.forward_backward(corrupted, "stable_reinforce", loss_fn_config={"kl_coeff": 0.01}).result()
    assert fb.metrics["loss:sum"] == fwd.metrics["loss:sum"]
    assert fb.metrics["datum_logprobs_mismatch:max"] > 0.5
    tc.optim_step(types.AdamParams(learning_rate=1e-2)).result()
    again = tc.forward_backward(data, "stable_reinforce").result()  # ids may be named again
    assert again.metrics["loss:sum"] != fb.metrics["loss:sum"]  # the weights moved
    assert abs(again.metrics["sampler_trainer_logprob_diff:mean"]) > 1e-4  # now off-policy
    gspo = tc.forward_backward(data, "gspo").result()  # provenance is fine for any loss
    assert set(gspo.metrics) == {"loss:sum", "seq_ratio:mean", "seq_clipped_frac:mean"}


def test_forward_backward_custom_with_provenance(alice):
    """forward_backward_custom sends the datums' spans along with its cross_entropy passes."""
    sc, tc, sampler, out = alice
    data = [rl_loop_datum(s) for s in out.sequences]

    def loss(batch, logprobs):
        total = sum((lp * d.loss_fn_inputs["advantages"].to_torch()).sum() for d, lp in zip(batch, logprobs))
        return -total, {"custom:sum": float(total.detach())}

    result = tc.forward_backward_custom(data, loss).result()
    assert "custom:sum" in result.metrics and len(result.loss_fn_outputs) == 3


def _raw_post(server, model_id: str, seq_id: int, mutate, loss_fn="importance_sampling") -> httpx.Response:
    """A forward_backward protobuf the SDK would refuse to send, built by hand."""
    msg = pb.ForwardBackwardRequest(model_id=model_id, seq_id=seq_id, loss_fn=loss_fn)
    d = msg.data.add()
    d.model_input.add().encoded_text.tokens = np.int32([1, 2, 3]).tobytes()
    for name, values in (("logprobs", [-1.0] * 3), ("advantages", [0.5] * 3)):
        d.loss_fn_inputs[name].dense = np.float32(values).tobytes()
        d.loss_fn_inputs[name].dtype = pb.DTYPE_FLOAT32
    d.loss_fn_inputs["target_tokens"].dense = np.int64([2, 3, 4]).tobytes()
    d.loss_fn_inputs["target_tokens"].dtype = pb.DTYPE_INT64
    mutate(d)
    return httpx.post(f"{server.base_url}/api/v1/forward_backward", content=msg.SerializeToString(),
                      headers={"X-API-Key": KEY, "Content-Type": "application/x-protobuf"}, timeout=30)


def _span(spans, kind="sampled_tokens", sid="x", offset=0, length=3):
    arm = getattr(spans.add(), kind)
    arm.sequence_id, arm.offset, arm.length = sid, offset, length


RAW_RULES = {  # rule 1, which the SDK checks client-side
    "span without arm": (lambda d: (d.model_input_spans.add(), _span(d.loss_fn_input_spans)),
                         "data[0].model_input_spans[0]: has neither prompt_tokens nor sampled_tokens"),
    "empty sequence_id": (lambda d: (_span(d.model_input_spans, sid=""), _span(d.loss_fn_input_spans)),
                          "data[0].model_input_spans[0].sampled_tokens: sequence_id is empty"),
    "negative offset": (lambda d: (_span(d.model_input_spans, offset=-1), _span(d.loss_fn_input_spans)),
                        "offset (-1) and length (3) must be >= 0"),
    "negative length": (lambda d: (_span(d.model_input_spans, length=-3), _span(d.loss_fn_input_spans)),
                        "offset (0) and length (-3) must be >= 0"),
    "one list only": (lambda d: _span(d.model_input_spans),
                      "datum 0: has model_input_spans but no loss_fn_input_spans; provenance comes as a pair"),
}


def test_malformed_provenance_is_a_400_for_every_loss(server):
    with server.client(KEY) as sc:
        tc = sc.create_lora_training_client(base_model=BASE_MODEL, rank=4).result()  # only raw posts use it
        for seq_id, (name, (mutate, message)) in enumerate(RAW_RULES.items(), start=1):
            r = _raw_post(server, tc.model_id, seq_id, mutate)
            assert r.status_code == 400 and message in r.json()["detail"], (name, r.text)
        ok = _raw_post(server, tc.model_id, len(RAW_RULES) + 1, lambda d: None)
        assert ok.status_code == 200, ok.text


def _mutated(seq, **changes):
    """rl_loop's datum for `seq` with fields replaced (spans given as lists)."""
    d = rl_loop_datum(seq)
    inputs = {k: v.tolist() for k, v in ((k, t.to_numpy()) for k, t in d.loss_fn_inputs.items())}
    tokens = d.model_input.to_ints()
    for key, fn in changes.items():
        if key == "tokens":
            tokens = fn(tokens)
        elif key in ("model_input_spans", "loss_fn_input_spans"):
            continue
        else:
            inputs[key] = fn(inputs.get(key))
    return types.Datum(model_input=types.ModelInput.from_ints(tokens), loss_fn_inputs=inputs,
                       model_input_spans=changes.get("model_input_spans", lambda s: s)(d.model_input_spans),
                       loss_fn_input_spans=changes.get("loss_fn_input_spans", lambda s: s)(d.loss_fn_input_spans))


def _set(i, value):
    return lambda xs: xs[:i] + [value] + xs[i + 1:]


NP = len(PROMPT)
SDK_RULES = [  # (name, datum from a recorded sequence, loss, config, status, message fragment)
    ("no provenance", lambda s: rl_loop_datum(s, provenance=False), "stable_reinforce", None, 400,
     "datum 0: stable_reinforce needs provenance on every datum"),
    ("spans do not tile", lambda s: _mutated(s, loss_fn_input_spans=lambda sp: sp[1:]), "importance_sampling", None,
     400, "datum 0: loss_fn_input_spans cover 6 positions but the datum has 10 target_tokens rows"),
    ("made-up id", lambda s: _mutated(s, model_input_spans=lambda sp: [
        types.PromptProvenanceSpan(sequence_id="nope", length=NP), sp[1]]), "stable_reinforce", None, 404,
     "datum 0: model_input_spans[0] (prompt run of sequence_id 'nope'): not found"),
    ("run past the record", lambda s: _mutated(s, loss_fn_input_spans=lambda sp: [
        types.PromptProvenanceSpan(sequence_id=s.sequence_id, offset=2, length=NP - 1), sp[1]]),
     "stable_reinforce", None, 400, f"positions [2, {NP + 1}) run past the {NP} recorded prompt tokens"),
    ("input token differs", lambda s: _mutated(s, tokens=_set(NP + 1, 999)), "stable_reinforce", None, 400,
     f"model_input_spans[1] (sampled run of sequence_id '{{sid}}'): model_input[{NP + 1}] is 999"),
    ("sampled target differs", lambda s: _mutated(s, target_tokens=_set(NP, 999)), "stable_reinforce", None, 400,
     f"loss_fn_input_spans[1] (sampled run of sequence_id '{{sid}}'): target_tokens[{NP}] is 999"),
    ("advantage on a prompt row", lambda s: _mutated(s, advantages=_set(1, 2.0)), "stable_reinforce", None, 400,
     "advantages[1] = 2.0 on a prompt row; stable_reinforce only accepts nonzero advantages on sampled tokens"),
    ("unknown config key", rl_loop_datum, "stable_reinforce", {"beta": 0.1}, 400,
     "loss_fn_config keys ['beta'] are not used by 'stable_reinforce' (its keys: ['kl_coeff'])"),
    ("text config value", rl_loop_datum, "stable_reinforce", {"kl_coeff": "high"}, 400,
     "loss_fn_config['kl_coeff'] must be a finite number, got the text 'high'"),
    ("negative kl_coeff", rl_loop_datum, "stable_reinforce", {"kl_coeff": -1.0}, 400, "must be >= 0"),
    ("gspo unknown key", rl_loop_datum, "gspo", {"kl_coeff": 0.1}, 400,
     "loss_fn_config keys ['kl_coeff'] are not used by 'gspo' (its keys: ['clip_high_threshold', 'clip_low_threshold'])"),
    ("gspo empty ratio rows", lambda s: _mutated(s, sequence_ratio_mask=lambda _: [0.0] * (NP - 1 + 6)), "gspo", None,
     400, "datum 0: gspo's sequence ratio has no rows"),
    ("per-row bounds crossed", lambda s: _mutated(s, clip_low_threshold=lambda _: [1.5] * (NP - 1 + 6)), "ppo", None,
     400, "datum 0: clip_low_threshold 1.5 is above clip_high_threshold 1.2 at position 0"),
]


@pytest.mark.parametrize("name,build,loss_fn,config,status,fragment", SDK_RULES, ids=[r[0] for r in SDK_RULES])
def test_each_validation_rule_is_a_clear_4xx_and_others_go_on(server, alice, name, build, loss_fn, config, status,
                                                              fragment):
    sc, tc, sampler, out = alice
    seq = out.sequences[0]
    error = tinker.NotFoundError if status == 404 else tinker.BadRequestError
    with pytest.raises(error) as exc:
        tc.forward_backward([build(seq)], loss_fn, loss_fn_config=config).result()
    assert fragment.format(sid=seq.sequence_id) in str(exc.value)
    # the same client, and the server, go on serving
    assert tc.forward([rl_loop_datum(seq)], "stable_reinforce").result().metrics["sampled_tokens:sum"] == 6


def test_records_belong_to_their_key_and_session(server, alice):
    """Another key naming alice's sequence gets a 404; alice's other session a 400 saying why;
    her own unrecorded samples a 400 with the hint to record."""
    sc, tc, sampler, out = alice
    data = [rl_loop_datum(out.sequences[0])]
    sid = out.sequences[0].sequence_id
    with server.client("tml-records-bob") as bob:
        bob_tc = bob.create_lora_training_client(base_model=BASE_MODEL, rank=4).result()
        with pytest.raises(tinker.NotFoundError, match=f"sequence_id '{sid}'.*not found"):
            bob_tc.forward_backward(data, "stable_reinforce").result()
    with server.client(KEY) as other_session:
        other_tc = other_session.create_lora_training_client(base_model=BASE_MODEL, rank=4).result()
        with pytest.raises(tinker.BadRequestError, match="only name sequences sampled in its own session"):
            other_tc.forward_backward(data, "stable_reinforce").result()
    unrecorded = sample(tc.save_weights_and_get_sampling_client().result(), n=1).sequences[0]
    with pytest.raises(tinker.BadRequestError, match="sampled without record_stability_info=True"):
        tc.forward_backward([rl_loop_datum(unrecorded)], "stable_reinforce").result()
    # other losses never look provenance up: importance_sampling trains on the same datum
    assert tc.forward([rl_loop_datum(unrecorded)], "importance_sampling").result().metrics["loss:sum"] != 0


def test_records_survive_kill_9_and_expire(tmp_path):
    """A record taken before kill -9 trains after the restart, in the same session; on a server
    whose records last 0 s the same request is refused as expired (no sleeping)."""
    srv = ServerProcess(tmp_path / "srv").start()
    try:
        with srv.client(KEY) as sc:
            tc = sc.create_lora_training_client(base_model=BASE_MODEL, rank=4).result()
            out = sample(tc.save_weights_and_get_sampling_client(record_stability_info=True).result(), n=2)
            before = tc.forward([rl_loop_datum(s) for s in out.sequences], "stable_reinforce").result()
            srv.kill9()
            srv.start()
            tc = sc.create_lora_training_client(base_model=BASE_MODEL, rank=4).result()  # adapters do not survive
            after = tc.forward([rl_loop_datum(s) for s in out.sequences], "stable_reinforce").result()
            assert after.metrics["loss:sum"] == before.metrics["loss:sum"]  # fresh B = 0 adapters: same model
    finally:
        srv.stop()
    short = ServerProcess(tmp_path / "short", args=("--sample-record-ttl-s", "0")).start()
    try:
        with short.client(KEY) as sc:
            tc = sc.create_lora_training_client(base_model=BASE_MODEL, rank=4).result()
            out = sample(tc.save_weights_and_get_sampling_client(record_stability_info=True).result(), n=1)
            with pytest.raises(tinker.BadRequestError, match="its record expired: records last 0 s from their last"):
                tc.forward([rl_loop_datum(out.sequences[0])], "stable_reinforce").result()
    finally:
        short.stop()
