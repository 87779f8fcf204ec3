"""Fuzzing a real server: schemathesis over its OpenAPI schema, and a protobuf fuzzer for
`forward_backward`. Thousands of malformed requests; never a 5xx, every 4xx a JSON body with a
non-empty "detail", and afterwards the server still trains exactly as it did before.

Run with `pytest tests/test_fuzz.py -s` to see how many requests each fuzzer sent.
"""

from __future__ import annotations

import base64
import gzip
import json
import os
import random
import time
from collections import Counter

import httpx
import numpy as np
import pytest
import tinker
import zstandard
from hypothesis import HealthCheck, Phase, example, given, seed, settings
from hypothesis import strategies as st
from hypothesis.errors import Unsatisfiable
from tinker import types
from tinker.proto import tinker_public_pb2 as pb
from tinker.proto.request_conv import forward_backward_request_to_proto

from helpers import BASE_MODEL, TEAM, sft_batch
from hosted_tinker.accounts.auth import anonymous_owner
from hosted_tinker.accounts.tokens import user_urn
from server_process import ServerProcess

# The SDK's own encoder warns when a hostile float does not fit in float32; that is the point.
pytestmark = [pytest.mark.e2e, pytest.mark.filterwarnings("ignore:overflow encountered in cast:RuntimeWarning")]
schemathesis = pytest.importorskip("schemathesis")

FUZZ_KEY = "tml-fuzz"  # the schemathesis fuzzer's key (it owns a few real objects, see `fuzz_world`)
PB_KEY = "tml-fuzz-pb"  # the protobuf fuzzer's key; it owns one throwaway model
OTHER_KEY = "tml-fuzz-bystander"  # owns a model the fuzzers name but may not touch
ADAM = types.AdamParams(learning_rate=1e-2)
# Per operation and generation mode; ~43 operations x (30 + 20) - the unsatisfiable ones >= 2,000.
POSITIVE_EXAMPLES, NEGATIVE_EXAMPLES = 35, 25
MIN_SCHEMA_REQUESTS, MIN_PROTO_REQUESTS = 2000, 1000
REQUEST_TIMEOUT = 120.0  # a request slower than this is a hang (each takes well under a second)
# A fresh seed each run (a fuzzer should explore); FUZZ_SEED=<n> replays a run, whose seed is printed.
SEED = int(os.environ.get("FUZZ_SEED") or random.randrange(2**32))


@pytest.fixture(scope="module")
def srv(tmp_path_factory):
    proc = ServerProcess(tmp_path_factory.mktemp("fuzz")).start()
    yield proc
    proc.stop()


def train_fixed(srv, key: str, steps: int = 5) -> list[float]:
    """A fresh model trained on one fixed batch; its loss after each step."""
    sc = srv.client(key)
    tc = sc.create_lora_training_client(base_model=BASE_MODEL, rank=4, seed=3).result()
    batch = sft_batch(4, seed=42)
    losses = []
    for _ in range(steps):
        fb = tc.forward_backward(batch, "cross_entropy")
        opt = tc.optim_step(ADAM)
        losses.append(fb.result().metrics["loss:sum"])
        opt.result()
    losses.append(tc.forward(batch, "cross_entropy").result().metrics["loss:sum"])
    return losses


class Tally:
    def __init__(self, name: str):
        self.name = name
        self.sent = 0
        self.statuses: Counter = Counter()
        self.failures: list[str] = []

    def check(self, what: str, status: int, body: bytes, ctype: str, ok_statuses=()) -> None:
        """No 5xx; a 4xx has a JSON {"detail": <non-empty>}."""
        self.sent += 1
        self.statuses[status] += 1
        if status >= 500:
            self.failures.append(f"{status} on {what}: {body[:300]!r}")
        elif 400 <= status < 500:
            try:
                detail = json.loads(body).get("detail")
            except (ValueError, AttributeError):
                detail = None
            if not detail:
                self.failures.append(f"{status} without a JSON detail on {what}: {ctype} {body[:300]!r}")
        elif ok_statuses and status not in ok_statuses:
            self.failures.append(f"unexpected {status} on {what}: {body[:300]!r}")

    def report(self) -> str:
        return f"{self.name}: {self.sent} requests, statuses {dict(sorted(self.statuses.items()))}"


@pytest.fixture(scope="module")
def fuzz_world(srv):
    """Real objects the fuzzers may aim at, so that some requests get past the 404s."""
    sc = srv.client(FUZZ_KEY)
    tc = sc.create_lora_training_client(base_model=BASE_MODEL, rank=2).result()
    tc.forward_backward(sft_batch(2), "cross_entropy").result()
    tc.optim_step(ADAM).result()
    state = tc.save_state("fuzz-state").result().path
    sampler_path = tc.save_weights_for_sampler("fuzz-sampler").result().path
    sampler = sc.create_sampling_client(base_model=BASE_MODEL).result()
    pb_tc = srv.client(PB_KEY).create_lora_training_client(
        base_model=BASE_MODEL, rank=2).result()
    other = srv.client(OTHER_KEY).create_lora_training_client(
        base_model=BASE_MODEL, rank=2).result()
    return {
        "model_id": tc.model_id,
        "session_id": tc.model_id.split(":")[0],
        "sampling_session_id": sampler._sampling_session_id,
        "paths": [state, sampler_path],
        "pb_model_id": pb_tc.model_id,
        "other_model_id": other.model_id,
    }


def test_fuzz_then_train(srv, fuzz_world):
    reference = train_fixed(srv, "tml-fuzz-reference")
    assert reference[-1] < reference[0], reference  # training works before the fuzzing

    t0 = time.monotonic()
    schema_tally = run_schemathesis(srv, fuzz_world)
    t1 = time.monotonic()
    proto_tally = run_protobuf_fuzzer(srv, fuzz_world)
    t2 = time.monotonic()
    print(f"\n[fuzz] seed {SEED} (FUZZ_SEED={SEED} replays this run)")
    print(f"[fuzz] {schema_tally.report()} in {t1 - t0:.0f}s")
    print(f"[fuzz] {proto_tally.report()} in {t2 - t1:.0f}s")
    print(f"[fuzz] total {schema_tally.sent + proto_tally.sent} requests")

    assert srv.proc.poll() is None, srv.log()
    assert httpx.get(f"{srv.base_url}/api/v1/healthz", timeout=60).json() == {"status": "ok"}
    failures = schema_tally.failures + proto_tally.failures
    assert not failures, f"{len(failures)} bad answers, e.g.:\n" + "\n".join(failures[:15])
    assert schema_tally.sent >= MIN_SCHEMA_REQUESTS
    assert proto_tally.sent >= MIN_PROTO_REQUESTS

    # The server still trains, and exactly as before.
    after = train_fixed(srv, "tml-fuzz-after")
    assert after[-1] < after[0], after
    assert after == reference
    assert srv.proc.poll() is None


def hostile_shapes(world: dict) -> list[tuple[str, str, bytes]]:
    """(method, path, raw JSON body): the shapes of issue 26 that a schema-driven fuzzer rarely
    builds: non-list prompt chunks, object roles, the literal NaN, huge stop lists, huge stored fields,
    request-supplied chat templates."""
    sampler, session = world["sampling_session_id"], world["session_id"]

    def asample(chunks, stop=None) -> bytes:
        return json.dumps({"sampling_session_id": sampler, "seq_id": random.randrange(2**40),
                           "prompt": {"chunks": chunks}, "sampling_params": {"max_tokens": 1, "stop": stop}}).encode()

    def chat(**fields) -> bytes:
        return json.dumps({"model": BASE_MODEL, "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 1,
                           **fields}).encode()

    huge_stops, huge = [f"s{i}" for i in range(100_000)], "x" * (1 << 20)
    nan_config = b'{"type": "adamw", "lr": NaN, "beta": Infinity}'
    cases = [("post", "/api/v1/asample", asample(chunks)) for chunks in ("x", 5, [1], [None], {"a": 1}, [[]], [{}])]
    cases += [("post", "/api/v1/asample", asample([{"tokens": [1, 2]}], stop)) for stop in (huge_stops, [huge])]
    cases += [("post", "/v1/chat/completions", chat(messages=[{"role": role, "content": "Hi"}]))
              for role in (["user"], {"a": 1}, 5, None)]
    cases += [("post", "/v1/chat/completions", chat(**fields)) for fields in (
        {"stop": huge_stops}, {"chat_template": "{{ 1 }}"}, {"chat_template_kwargs": {"chat_template": "{{ 1 }}"}},
        {"chat_template_kwargs": {"tools": [{}]}}, {"chat_template_kwargs": {"enable_thinking": huge}},
        {"chat_template_kwargs": {"x": 1}}, {"chat_template_kwargs": [1]})]
    cases += [("post", "/v1/completions", json.dumps({"model": BASE_MODEL, "prompt": "Hi", "stop": huge_stops}).encode())]
    cases += [("post", "/api/v1/create_model", b'{"session_id": "%s", "model_seq_id": 99, "base_model": "%s", '
               b'"optimizer_config": %s}' % (session.encode(), BASE_MODEL.encode(), config))
              for config in (nan_config, json.dumps({"huge": huge}).encode())]
    cases += [("post", "/api/v1/load_weights", b'{"path": "%s", "session_id": "%s", "model_seq_id": 98, '
               b'"optimizer_config": %s}' % (world["paths"][0].encode(), session.encode(), nan_config)),
              ("put", f"/api/v1/sessions/{session}/project", json.dumps({"project_id": huge}).encode()),
              ("post", f"/api/v1/sessions/{session}/finish", json.dumps({"reason": {"type": huge}}).encode()),
              ("post", "/api/v1/create_session", b'{"user_metadata": {"a": NaN}}')]
    return cases


def test_hostile_shapes_are_4xx(srv, fuzz_world):
    tally = Tally("hostile shapes")
    with httpx.Client(base_url=srv.base_url, timeout=REQUEST_TIMEOUT,
                      headers={"X-API-Key": FUZZ_KEY, "Content-Type": "application/json"}) as http:
        for method, path, body in hostile_shapes(fuzz_world):
            r = http.request(method.upper(), path, content=body)
            tally.check(f"{method} {path} {body[:120]!r}", r.status_code, r.content, r.headers.get("content-type", ""))
            if r.status_code < 400:
                tally.failures.append(f"accepted: {method} {path} {body[:120]!r}: {r.text[:200]}")
    assert not tally.failures, "\n".join(tally.failures)
    assert httpx.get(f"{srv.base_url}/api/v1/healthz", timeout=60).json() == {"status": "ok"}


# Integers a JSON body may hold that numpy, torch and SQLite do not (and the largest they do).
HUGE = (2**63 - 1, 2**63, 2**64, 2**70, -(2**63) - 1)


def huge_integer_cases(world: dict) -> list[tuple[str, dict, str, int]]:
    """(route, JSON body, the field, its value) for every integer field of the sampling and training
    requests that reaches numpy or torch, each with each of HUGE."""
    sampler, session, model = world["sampling_session_id"], world["session_id"], world["model_id"]
    seq = iter(range(10**6, 2 * 10**6))

    def asample(**fields) -> dict:
        body = {"sampling_session_id": sampler, "seq_id": next(seq), "num_samples": 1,
                "prompt": {"chunks": [{"type": "encoded_text", "tokens": [1, 2, 3, 4]}]},
                "sampling_params": {"max_tokens": 1}}
        for name, value in fields.items():
            *path, last = name.split(".")
            target = body
            for part in path:
                target = target[part]
            target[last] = value
        return body

    def targets(field: str, value: int) -> dict:
        t = {"data": [1, 2, 3], "dtype": "int64", "shape": [3, 2], "sparse_crow_indices": [0, 1, 2, 3],
             "sparse_col_indices": [0, 1, 0]}
        t[field] = [value if i == 1 else x for i, x in enumerate(t[field])]
        return t

    cases: list[tuple[str, dict, str, int]] = []
    for v in HUGE:
        some = [("/api/v1/asample", asample(**{f: v}), f) for f in (
            "seq_id", "num_samples", "sampling_params.max_tokens", "sampling_params.seed", "sampling_params.top_k",
            "topk_prompt_logprobs", "topk_sample_logprobs", "prompt_alt_tokens_k", "prompt_logprobs_last_n")]
        some += [("/api/v1/asample", asample(**{"sampling_params.stop": [v]}), "stop"),
                 ("/api/v1/asample", asample(**{"prompt.chunks": [{"type": "encoded_text", "tokens": [1, v]}]}),
                  "prompt token")]
        some += [("/api/v1/asample", asample(target_prompt_logprobs=targets(f, v)), f)
                 for f in ("data", "shape", "sparse_crow_indices", "sparse_col_indices")]
        some += [("/api/v1/create_model", {"session_id": session, "model_seq_id": 90, "base_model": BASE_MODEL,
                                           "lora_config": {"rank": 2, "seed": v}}, "seed"),
                 ("/api/v1/create_model", {"session_id": session, "model_seq_id": 91, "base_model": BASE_MODEL,
                                           "lora_config": {"rank": v}}, "rank"),
                 ("/api/v1/save_weights", {"model_id": model, "seq_id": 10**6, "path": "x", "ttl_seconds": v},
                  "ttl_seconds")]
        for route, extra, fields in (
                ("/v1/completions", {"prompt": "Hi"}, ("logprobs", "best_of")),
                ("/v1/chat/completions", {"messages": [{"role": "user", "content": "Hi"}]},
                 ("top_logprobs", "max_completion_tokens"))):
            some += [(route, {"model": BASE_MODEL, "max_tokens": 1, **extra, f: v}, f)
                     for f in ("n", "max_tokens", "seed", "top_k", *fields)]
        some += [("/v1/completions", {"model": BASE_MODEL, "max_tokens": 1, "prompt": [1, v]}, "prompt")]
        cases += [(route, body, field, v) for route, body, field in some]
    return cases


def test_integers_beyond_int64_are_4xx_naming_the_field(srv, fuzz_world):
    """Issue 33: a CSR `target_prompt_logprobs` column index of 2**70 was a 500 (OverflowError in
    numpy), and so were its row pointers and an OpenAI top_k of 2**63; now each is a 4xx naming
    the field. Every other integer field of a sample or training request that reaches numpy or
    torch, at the int64 edges and beyond, is an answer or a 4xx too (never a 5xx), through the SDK
    as through HTTP."""
    tally = Tally("huge integers")
    with httpx.Client(base_url=srv.base_url, timeout=REQUEST_TIMEOUT, headers={"X-API-Key": FUZZ_KEY}) as http:
        for route, body, field, value in huge_integer_cases(fuzz_world):
            what = f"{route} {field}={value}"
            try:
                r = http.post(route, json=body)
            except httpx.TransportError as e:  # the server dropped the connection
                tally.failures.append(f"{type(e).__name__} on {what}: {e}")
                continue
            tally.check(what, r.status_code, r.content, r.headers.get("content-type", ""))
            if not -(2**63) <= value < 2**63 and not (400 <= r.status_code < 500 and field in r.text):
                tally.failures.append(f"{r.status_code} on {what}, not a 4xx naming {field}: {r.text[:200]}")
    assert not tally.failures, "\n".join(tally.failures[:15])
    sampler = srv.client(FUZZ_KEY).create_sampling_client(base_model=BASE_MODEL).result()
    col = types.TensorData(data=[5], dtype="int64", shape=[3, 2], sparse_crow_indices=[0, 1, 1, 1],
                           sparse_col_indices=[2**70])
    with pytest.raises(tinker.APIStatusError, match="sparse_col_indices") as refused:
        sampler.sample(types.ModelInput.from_ints([1, 2, 3, 4]), 1, types.SamplingParams(max_tokens=1),
                       target_prompt_logprobs=col).result()
    assert 400 <= refused.value.status_code < 500


# -- the admin's audit log: its pages, cursors and filters (issue 40) ----------------------------------

AUDIT_EXAMPLES = 250


def _b64(data: bytes) -> str:
    return base64.urlsafe_b64encode(data).decode().rstrip("=")


@st.composite
def audit_params(draw, real_cursor: str) -> dict:
    """Query parameters of the audit route: real values, hostile ones, and cursors real, forged and broken."""
    text = st.one_of(st.text(max_size=30), st.text(min_size=1020, max_size=1030), st.just(""))
    forged = st.dictionaries(st.sampled_from(["day", "event_type", "event", "user", "after", "extra"]),
                             st.one_of(st.none(), st.integers(-(2**70), 2**70), st.floats(), st.text(max_size=12),
                                       st.sampled_from(["0001-01-01", "9999-12-31", "all", "checkpoint_read"])))
    cursor = st.one_of(st.just(real_cursor), text, st.builds(lambda d: _b64(json.dumps(d).encode()), forged),
                       st.builds(lambda b: _b64(b), st.binary(max_size=40)),
                       st.builds(lambda n: real_cursor[:n], st.integers(0, len(real_cursor))))
    fields = {
        "day": st.one_of(st.sampled_from(["0001-01-01", "9999-12-31", time.strftime("%Y-%m-%d", time.gmtime()),
                                          "2026-02-30", "today"]), text),
        "event_type": st.one_of(st.sampled_from(["all", "checkpoints", "projects", "teams", "organizations"]), text),
        "event": st.one_of(st.sampled_from(["checkpoint_read", "checkpoint_ttl_set", "project_session_assign"]), text),
        "user": st.one_of(st.sampled_from(["alice", "tml:user:alice", "tml:user:", "root"]), text),
        "limit": st.one_of(st.integers(-5, 12_000), st.sampled_from([2**63, 2**70, -(2**63) - 1]), text),
        "cursor": cursor,
    }
    return {name: draw(value) for name, value in fields.items() if draw(st.booleans())}


def test_the_audit_pages_and_filters_are_answers_or_4xx(team_server):
    """Every combination of the audit route's parameters is a page (its cursor, when it has one, giving the
    next) or a 4xx naming what is wrong; the dashboard's audit view is a page or a 4xx too."""
    tally = Tally("audit pages")
    with team_server.client(TEAM["alice"]) as sc:
        tc = sc.create_lora_training_client(base_model=BASE_MODEL, rank=2).result()
        for i in range(3):
            tc.save_state(f"fuzz-audit-{i}").result()
    with httpx.Client(base_url=team_server.base_url, timeout=REQUEST_TIMEOUT, headers={"X-API-Key": TEAM["root"]}) as http:
        real = http.get("/api/v1/audit", params={"limit": 1, "user": "alice"}).json()["next_cursor"]
        assert real is not None

        @settings(max_examples=AUDIT_EXAMPLES, deadline=None, database=None, suppress_health_check=list(HealthCheck))
        @seed(SEED)
        @given(params=audit_params(real), page=st.booleans())
        def fuzz(params, page):
            r = http.get("/dashboard/audit" if page else "/api/v1/audit", params=params)
            tally.check(f"{'dashboard' if page else 'route'} {str(params)[:200]}", r.status_code,
                        r.content if not page or r.status_code < 400 else b'{"detail": "the form"}',
                        r.headers.get("content-type", ""))
            if not page and r.status_code == 200:
                answer = r.json()
                if answer["next_cursor"] is not None:  # a cursor it gives is one it takes
                    follow = http.get("/api/v1/audit", params={"cursor": answer["next_cursor"]})
                    tally.check(f"the next page of {params}", follow.status_code, follow.content, "", ok_statuses=(200,))

        fuzz()
    print(f"\n[fuzz] {tally.report()}")
    assert not tally.failures, "\n".join(tally.failures[:15])
    assert tally.statuses[200] and sum(n for status, n in tally.statuses.items() if 400 <= status < 500)


# -- session search filters (issue 40) --------------------------------------------------------------

SEARCH_EXAMPLES = 300
PUBLIC_ONLY = {"project_id": "", "status": None, "display_name": None, "user_metadata": None}


@pytest.fixture(scope="module")
def search_world(srv, fuzz_world):
    """A published session of the bystander's, its private fields known to the test: the fuzzer guesses them."""
    secret = {"key": "wandb_api_key", "value": f"secret-{random.randrange(2**32)}", "name": "Bystander private sweep",
              "project": f"bystander-{random.randrange(2**32)}"}
    with srv.client(OTHER_KEY, user_metadata={secret["key"]: secret["value"]}, project_id=secret["project"],
                    display_name=secret["name"]) as sc:
        tc = sc.create_lora_training_client(base_model=BASE_MODEL, rank=2).result()
        path = tc.save_state("published").result().path
        tinker.RestClient(base_url=srv.base_url, api_key=OTHER_KEY).publish_checkpoint_from_tinker_path(path).result()
        yield {**secret, "session": tc.model_id.split(":")[0], "own_session": fuzz_world["session_id"]}


@st.composite
def search_bodies(draw, world: dict) -> dict:
    """SessionSearchRequest bodies, in range and out of it, their values often the bystander's real secrets."""
    words = st.sampled_from([world["value"], world["key"], world["project"], world["name"], "Bystander", "sweep",
                             "default", "", "%", "_", "\\", "x" * 1025, world["session"], world["own_session"]])
    text = st.one_of(words, st.text(max_size=20))
    body: dict = {}
    sometimes = st.integers(0, 2).map(lambda n: n == 0)  # each filter in a third of the bodies
    if draw(sometimes):
        body["user_metadata"] = draw(st.dictionaries(text, text, max_size=3) | st.just({world["key"]: world["value"]}))
    if draw(sometimes):
        body["display_name"] = draw(text)
    if draw(sometimes):
        body["session_id"] = draw(st.sampled_from([world["session"], world["own_session"]]) | text)
    if draw(sometimes):
        body["project_ids"] = draw(st.lists(text, max_size=3))
    if draw(sometimes):
        kinds = st.sampled_from(["active", "cancelled", "failed", "client_finished", "nope"])
        body["statuses"] = draw(st.lists(st.fixed_dictionaries({"type": kinds}), max_size=3))
    if draw(st.booleans()):
        urns = st.lists(st.sampled_from([urn_of(OTHER_KEY), "tml:user:x", "alice", ""]), max_size=2)
        kinds = st.sampled_from(["accessible"] * 4 + ["own", "user", "x"])  # others' sessions: "accessible"
        body["owner"] = draw(st.fixed_dictionaries({"type": kinds}, optional={"owner_urns": urns}))
    if draw(sometimes):
        body["limit"] = draw(st.integers(-5, 300) | st.sampled_from([2**63, 2**64]))
    if draw(sometimes):
        body["cursor"] = {"last_created_at": draw(st.sampled_from(["2000-01-01T00:00:00Z", "2000-01-01T00:00:00",
                                                                   "not a time", "9999-12-31T23:59:59+00:00"])),
                          "last_session_id": draw(text)}
    return body


def urn_of(key: str) -> str:
    """The user URN of a dev-mode key's owner."""
    return user_urn(anonymous_owner(key))


def test_search_filters_fuzzed_never_show_or_confirm_anothers_private_fields(srv, search_world):
    """Issue 40: whatever the filters, a search answers 2xx or a 4xx with a detail; another owner's session
    comes back with its public fields only, never for a filter on a private field (metadata, project,
    status, or a display name without a session id), and none of its private values is in any answer."""
    world, tally = search_world, Tally("search filters")
    secrets = (world["value"], world["project"], world["name"])

    with httpx.Client(base_url=srv.base_url, timeout=REQUEST_TIMEOUT, headers={"X-API-Key": FUZZ_KEY}) as http:
        @settings(max_examples=SEARCH_EXAMPLES, deadline=None, database=None, suppress_health_check=list(HealthCheck))
        @seed(SEED)
        @given(body=search_bodies(world))
        def search(body):
            r = http.post(SEARCH_ROUTE, json=body)
            what = f"search {json.dumps(body)[:300]}"
            tally.check(what, r.status_code, r.content, r.headers.get("content-type", ""))
            if r.status_code != 200:
                named = [v for v in secrets if v in r.text and v not in json.dumps(body)]
                tally.failures += [f"{v!r} in the refusal of {what}" for v in named]
                return
            private_filter = bool(body.get("user_metadata")) or "project_ids" in body or "statuses" in body or (
                "display_name" in body and "session_id" not in body)
            for found in r.json()["sessions"]:
                if found["owner"] == urn_of(FUZZ_KEY):
                    continue
                if private_filter or {k: found[k] for k in PUBLIC_ONLY} != PUBLIC_ONLY:
                    tally.failures.append(f"another owner's session {found} for {what}")
            for value in secrets:  # a refusal may name what the request named; an answer names none
                if value in r.text:
                    tally.failures.append(f"{value!r} in the answer to {what}")

        # The guesses that matched on f62a3dc (issue 40), each tried first, then the generated ones.
        accessible = {"type": "accessible"}
        for body in ({"owner": accessible}, {"owner": accessible, "user_metadata": {world["key"]: world["value"]}},
                     {"owner": accessible, "display_name": world["name"]}, {"owner": accessible, "statuses": [
                         {"type": "active"}]}, {"owner": {"type": "user", "owner_urns": [urn_of(OTHER_KEY)]},
                                                "project_ids": [world["project"]]}):
            search = example(body=body)(search)
        search()
    assert tally.statuses[200] > SEARCH_EXAMPLES // 10, tally.report()  # the filters were reached, not only refusals
    assert not tally.failures, "\n".join(tally.failures[:15])
    mine = http_search(srv, OTHER_KEY, {"user_metadata": {world["key"]: world["value"]}})
    assert [s["session_id"] for s in mine] == [world["session"]]  # the same guess, by the owner: it matches


def http_search(srv, key: str, body: dict) -> list[dict]:
    r = httpx.post(f"{srv.base_url}{SEARCH_ROUTE}", json=body, headers={"X-API-Key": key}, timeout=REQUEST_TIMEOUT)
    assert r.status_code == 200, r.text
    return r.json()["sessions"]


# -- schemathesis ------------------------------------------------------------------------------------

# Long-polls or streams by design; sent with arguments that make them answer at once (see below).
LONG_POLL = "/api/v1/retrieve_future"
OWN_KEY_ROUTE = "/api/v1/auth/apikey/me"  # tinker auth login / logout
SEARCH_ROUTE = "/api/v1/sessions/search"
# Routes whose body the schema leaves open (they parse the request themselves): given a loose
# JSON body here so that schemathesis sends something at all.
LOOSE_BODIES = {
    ("post", "/v1/completions"): {"type": "object", "properties": {
        "model": {"type": "string"}, "prompt": {}, "max_tokens": {"type": "integer", "maximum": 16},
        "n": {"type": "integer", "maximum": 3}, "stream": {"type": "boolean"}, "logprobs": {},
        "temperature": {}, "stop": {}, "echo": {}, "seed": {}}},
    ("post", "/v1/chat/completions"): {"type": "object", "properties": {
        "model": {"type": "string"}, "messages": {"type": "array"}, "max_tokens": {"type": "integer", "maximum": 16},
        "max_completion_tokens": {}, "n": {"type": "integer", "maximum": 3}, "stream": {"type": "boolean"},
        "logprobs": {}, "top_logprobs": {}, "temperature": {}, "stop": {}}},
    ("post", "/api/v1/telemetry"): {},
}


def _patched_schema(srv) -> dict:
    raw = httpx.get(f"{srv.base_url}/openapi.json", timeout=30).json()
    for (method, path), body_schema in LOOSE_BODIES.items():
        op = raw["paths"][path][method]
        op["requestBody"] = {"required": True, "content": {"application/json": {"schema": body_schema}}}
    return raw


def _aim(case, world: dict, aim: int) -> None:
    """Point a generated case at real objects (aim 0-3) or leave it random (4-9)."""
    if case.path == LONG_POLL:
        if isinstance(case.body, dict) and isinstance(case.body.get("request_id"), str):
            case.body["request_id"] = "req-unknown-" + case.body["request_id"]  # 404 at once
        return
    if aim > 3 or case.method.upper() == "DELETE" or case.path == "/api/v1/unload_model":
        return
    model = world["model_id"]
    real = {"model_id": model, "session_id": world["session_id"], "run_id": model,
            "training_run_id": model, "sampling_session_id": world["sampling_session_id"],
            "sampler_id": world["sampling_session_id"], "model": world["paths"][1],
            "path": world["paths"][aim % 2], "model_path": world["paths"][1],
            "tinker_path": world["paths"][aim % 2]}
    if aim == 3:  # real objects, but another tenant's: must be 404s
        real.update(model_id=world["other_model_id"], run_id=world["other_model_id"])
    if isinstance(case.body, dict):
        for k in case.body:
            if k in real and isinstance(case.body[k], str):
                case.body[k] = real[k]
    if case.path_parameters:
        for k in case.path_parameters:
            if k in real:
                case.path_parameters[k] = real[k]


def run_schemathesis(srv, world: dict) -> Tally:
    import requests
    from schemathesis import GenerationMode
    from schemathesis.checks import not_a_server_error

    tally = Tally("schemathesis")
    schema = schemathesis.openapi.from_dict(_patched_schema(srv))
    operations = [r.ok() for r in schema.get_all_operations()]
    assert len(operations) >= 30
    fuzzed = {(op.method.upper(), op.path) for op in operations}
    assert {("GET", OWN_KEY_ROUTE), ("DELETE", OWN_KEY_ROUTE), ("POST", SEARCH_ROUTE)} <= fuzzed
    session = requests.Session()
    keys = st.sampled_from([FUZZ_KEY] * 8 + [None, "tml-", "not-a-tinker-key"])

    def send(case, key, aim):
        _aim(case, world, aim)
        if case.path == OWN_KEY_ROUTE and case.method.upper() == "DELETE" and key == FUZZ_KEY:
            key = f"tml-fuzz-deleted-{random.randrange(2**32)}"  # dev mode deletes a key: not the fuzzer's own
        headers = {k: v for k, v in (case.headers or {}).items() if k.lower() != "x-api-key"}
        if key is not None:
            headers["X-API-Key"] = key
        case.headers = headers
        what = f"{case.method} {case.formatted_path} key={key!r} body={str(case.body)[:200]}"
        try:
            r = case.call(base_url=srv.base_url, session=session, timeout=REQUEST_TIMEOUT)
        except Exception as e:  # a hang or a dropped connection
            tally.sent += 1
            tally.failures.append(f"{type(e).__name__} on {what}: {e}")
            return
        tally.check(what, r.status_code, r.content, r.headers.get("content-type", ""))
        try:
            case.validate_response(r, checks=[not_a_server_error])
        except BaseException as e:  # schemathesis' FailureGroup is a BaseExceptionGroup
            if not isinstance(e, (Exception, BaseExceptionGroup)):
                raise
            tally.failures.append(f"not_a_server_error on {what}: {str(e)[:300]}")

    with session:  # closed however the fuzzing ends
        for op in operations:
            for mode, n in ((GenerationMode.POSITIVE, POSITIVE_EXAMPLES), (GenerationMode.NEGATIVE, NEGATIVE_EXAMPLES)):
                @settings(max_examples=n, deadline=None, database=None,
                          suppress_health_check=list(HealthCheck), phases=[Phase.explicit, Phase.generate])
                @seed(SEED)
                @given(case=op.as_strategy(generation_mode=mode), key=keys, aim=st.integers(0, 9))
                def fuzz(case, key, aim):
                    send(case, key, aim)

                try:
                    fuzz()
                except Unsatisfiable:  # nothing about this operation can be made invalid
                    pass
    return tally


# -- protobuf fuzzer for forward_backward ------------------------------------------------------------

LOSS_NAMES = ["cross_entropy", "importance_sampling", "ppo", "cispo", "dro", "gspo", "stable_reinforce",
              "custom", "", "CROSS_ENTROPY", "cross_entropy\x00"]
INPUT_NAMES = ["target_tokens", "weights", "logprobs", "advantages", "mask", ""]
CONFIG_KEYS = ["clip_low_threshold", "clip_high_threshold", "beta", "", "eps"]
I32 = st.integers(-(2**31), 2**31 - 1)
I64 = st.integers(-(2**63), 2**63 - 1)
TOKENS = st.one_of(st.integers(0, 999), st.integers(-5, 2000), I32)
FLOATS = st.floats(allow_nan=True, allow_infinity=True, width=32)


@st.composite
def tensors(draw, n_hint: int) -> pb.Tensor:
    t = pb.Tensor()
    t.dtype = draw(st.sampled_from([pb.DTYPE_FLOAT32, pb.DTYPE_INT64, pb.DTYPE_INT32, pb.DTYPE_BFLOAT16,
                                     pb.DTYPE_UNSPECIFIED, 1, 2, 99]))
    np_dtype = np.int64 if t.dtype == pb.DTYPE_INT64 else np.float32
    shape_kind = draw(st.sampled_from(["none", "n", "other", "2d", "huge"]))
    n = draw(st.sampled_from([n_hint, n_hint, max(0, n_hint - 1), n_hint + 1, 0]))
    if shape_kind == "n":
        t.shape.extend([n])
    elif shape_kind == "other":
        t.shape.extend(draw(st.lists(st.integers(-3, 50), max_size=4)))
    elif shape_kind == "2d":
        t.shape.extend([draw(st.integers(0, 4)), draw(st.integers(0, 8))])
    elif shape_kind == "huge":
        t.shape.extend(draw(st.lists(st.sampled_from([0, 1, 2**31, 2**40, 2**62, 2**63 - 1, -1]),
                                     min_size=1, max_size=40)))
    if draw(st.integers(0, 4)) == 0:  # sparse CSR, often garbage
        csr = t.sparse_csr
        nnz = draw(st.integers(0, 6))
        csr.values = np.asarray(draw(st.lists(FLOATS if np_dtype is np.float32 else I64, min_size=nnz,
                                              max_size=nnz)), np_dtype).tobytes() + draw(st.binary(max_size=3))
        csr.crow_indices = np.asarray(draw(st.lists(st.integers(-2, 8), max_size=6)), np.int64).tobytes()
        csr.col_indices = np.asarray(draw(st.lists(st.sampled_from([-1, 0, 1, 2, 7, 2**62]), min_size=nnz,
                                                   max_size=nnz + 1)), np.int64).tobytes()
    elif draw(st.booleans()):
        values = draw(st.lists(FLOATS if np_dtype is np.float32 else st.one_of(TOKENS, I64),
                               min_size=n, max_size=n))
        t.dense = np.asarray(values, np_dtype).tobytes() if values else b""
    else:
        t.dense = draw(st.binary(max_size=64))
    return t


@st.composite
def datums(draw) -> pb.Datum:
    d = pb.Datum()
    n_tokens = 0
    for _ in range(draw(st.integers(0, 3))):
        chunk = d.model_input.add()
        kind = draw(st.sampled_from(["text", "text", "text", "image", "dmel", "empty"]))
        if kind == "text":
            toks = draw(st.lists(TOKENS, max_size=24))
            n_tokens += len(toks)
            raw = np.asarray(toks, np.int32).tobytes() if toks else b""
            chunk.encoded_text.tokens = raw + draw(st.sampled_from([b"", b"", b"\x01", b"\x00\x00"]))
        elif kind == "image":
            chunk.image.data = draw(st.binary(max_size=32))
            chunk.image.format = draw(st.sampled_from(["png", "jpeg", "", "gif"]))
            if draw(st.booleans()):
                chunk.image.expected_tokens = draw(I32)
        elif kind == "dmel":
            chunk.dmel.dmel = draw(st.binary(max_size=32))
        else:
            chunk.SetInParent()
    names = draw(st.lists(st.sampled_from(INPUT_NAMES) | st.text(max_size=8), max_size=5, unique=True))
    for name in names:
        d.loss_fn_inputs[name].CopyFrom(draw(tensors(n_tokens)))
    if draw(st.integers(0, 5)) == 0:
        span = d.model_input_spans.add()
        span.prompt_tokens.sequence_id = draw(st.text(max_size=5))
        span.prompt_tokens.offset = draw(I64)
        span.prompt_tokens.length = draw(I64)
    return d


@st.composite
def hostile_requests(draw, world: dict) -> bytes:
    msg = pb.ForwardBackwardRequest()
    msg.model_id = draw(st.sampled_from([world["pb_model_id"]] * 3 + [world["other_model_id"], world["model_id"],
                                         "", "sess-x:train:0"]) | st.text(max_size=20))
    msg.seq_id = draw(st.one_of(st.integers(-3, 200), I32))
    msg.loss_fn = draw(st.sampled_from(LOSS_NAMES) | st.text(max_size=10))
    msg.forward_only = draw(st.booleans())
    for key in draw(st.lists(st.sampled_from(CONFIG_KEYS) | st.text(max_size=6), max_size=3, unique=True)):
        how = draw(st.integers(0, 2))
        if how == 0:
            msg.loss_fn_config[key] = draw(st.floats(allow_nan=True, allow_infinity=True))
        elif how == 1:
            msg.loss_fn_config_v2[key].number = draw(st.floats(allow_nan=True, allow_infinity=True))
        else:
            msg.loss_fn_config_v2[key].text = draw(st.text(max_size=6))
    if draw(st.integers(0, 9)) == 0:
        msg.loss_fn_config_v2[draw(st.text(max_size=4))].SetInParent()  # neither number nor text
    for d in draw(st.lists(datums(), max_size=4)):
        msg.data.add().CopyFrom(d)
    return msg.SerializeToString()


@st.composite
def sdk_requests(draw, world: dict) -> bytes:
    """What the SDK itself would send (often valid), via its own encoder."""
    n = draw(st.sampled_from([0, 1, 1, 2, 3]))
    data = []
    for _ in range(n):
        length = draw(st.integers(1, 12))
        hi = draw(st.sampled_from([999, 999, 999, 1100]))  # mostly inside the vocabulary
        toks = draw(st.lists(st.integers(0, hi), min_size=length + 1, max_size=length + 1))
        loss_fn_inputs = {"target_tokens": toks[1:], "weights": draw(
            st.lists(st.floats(-2, 2), min_size=length, max_size=length))}
        if draw(st.booleans()):
            loss_fn_inputs["logprobs"] = [-1.0] * length
            loss_fn_inputs["advantages"] = draw(st.lists(st.floats(allow_nan=True), min_size=length,
                                                         max_size=length))
        data.append(types.Datum(model_input=types.ModelInput.from_ints(toks[:-1]), loss_fn_inputs=loss_fn_inputs))
    loss = draw(st.sampled_from(["cross_entropy", "importance_sampling", "ppo", "dro"]))
    config = draw(st.sampled_from([None, {"beta": 0.1}, {"clip_low_threshold": 1.5, "clip_high_threshold": 1.2},
                                   {"beta": float("nan")}, {"beta": "x"}]))
    req = types.ForwardBackwardRequest(
        model_id=draw(st.sampled_from([world["pb_model_id"], world["other_model_id"]])),
        seq_id=draw(st.integers(-1, 400)),
        forward_backward_input=types.ForwardBackwardInput(data=data, loss_fn=loss, loss_fn_config=config))
    return forward_backward_request_to_proto(req).SerializeToString()


@st.composite
def mutated(draw, world: dict) -> bytes:
    body = bytearray(draw(sdk_requests(world)))
    for _ in range(draw(st.integers(1, 6))):
        op = draw(st.integers(0, 3))
        pos = draw(st.integers(0, len(body)))
        if op == 0 and pos < len(body):
            body[pos] ^= 1 << draw(st.integers(0, 7))
        elif op == 1:
            body[pos:pos] = draw(st.binary(min_size=1, max_size=8))
        elif op == 2:
            del body[pos:pos + draw(st.integers(1, 8))]
        else:
            body = body[:pos]
    return bytes(body)


def _encodings(body: bytes, how: str) -> tuple[bytes, dict]:
    if how == "zstd":
        return zstandard.ZstdCompressor().compress(body), {"Content-Encoding": "zstd"}
    if how == "gzip":
        return gzip.compress(body), {"Content-Encoding": "gzip"}
    if how == "zstd-truncated":
        z = zstandard.ZstdCompressor().compress(body)
        return z[:max(1, len(z) // 2)], {"Content-Encoding": "zstd"}
    if how == "gzip-trailing":
        return gzip.compress(body) + b"junk", {"Content-Encoding": "gzip"}
    if how == "claims-zstd":
        return body, {"Content-Encoding": "zstd"}
    if how == "claims-gzip":
        return body, {"Content-Encoding": "gzip"}
    if how == "br":
        return body, {"Content-Encoding": "br"}
    if how == "zstd-bomb":  # small on the wire, large once decompressed
        return zstandard.ZstdCompressor(level=19).compress(b"\x0a" * (64 << 20)), {"Content-Encoding": "zstd"}
    return body, {}


def run_protobuf_fuzzer(srv, world: dict) -> Tally:
    tally = Tally("protobuf forward_backward")
    with httpx.Client(base_url=srv.base_url, timeout=REQUEST_TIMEOUT) as client:
        url = "/api/v1/forward_backward"
        bodies = st.one_of(hostile_requests(world), hostile_requests(world), sdk_requests(world),
                           mutated(world), st.binary(max_size=256))
        encodings = st.sampled_from(["identity"] * 10 + ["zstd", "zstd", "gzip", "gzip", "zstd-truncated",
                                                         "gzip-trailing", "claims-zstd", "claims-gzip", "br"])
        ctypes = st.sampled_from(["application/x-protobuf"] * 12 + ["application/json", "", "application/protobuf"])
        keys = st.sampled_from([PB_KEY] * 12 + [OTHER_KEY, None])

        @settings(max_examples=1100, deadline=None, database=None,
                  suppress_health_check=list(HealthCheck), phases=[Phase.explicit, Phase.generate])
        @seed(SEED)
        @given(body=bodies, how=encodings, ctype=ctypes, key=keys)
        def fuzz(body, how, ctype, key):
            wire, headers = _encodings(body, how)
            if ctype:
                headers["Content-Type"] = ctype
            if key:
                headers["X-API-Key"] = key
            what = f"forward_backward ({how}, {ctype!r}, key={key!r}, {len(body)} bytes) {body[:120]!r}"
            try:
                r = client.post(url, content=wire, headers=headers)
            except httpx.HTTPError as e:
                tally.sent += 1
                tally.failures.append(f"{type(e).__name__} on {what}: {e}")
                return
            tally.check(what, r.status_code, r.content, r.headers.get("content-type", ""), ok_statuses=(200,))
            if r.status_code == 200 and "request_id" not in r.json():
                tally.failures.append(f"200 without a request_id on {what}: {r.text[:200]}")

        fuzz()
        # A decompression bomb, once per encoding that can carry one.
        for how in ("zstd-bomb",):
            wire, headers = _encodings(b"", how)
            r = client.post(url, content=wire, headers={**headers, "Content-Type": "application/x-protobuf",
                                                        "X-API-Key": PB_KEY})
            tally.check("zstd bomb", r.status_code, r.content, r.headers.get("content-type", ""), ok_statuses=(200,))
    return tally
