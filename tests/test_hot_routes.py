"""The training step's requests skip FastAPI's routing, and answer exactly as FastAPI's routes do
(issue 42): api/hot_routes.py.

The server runs in this process (uvicorn in a thread, as tests/test_event_loop.py) so that the test
can see which code answered: a real SDK's training step must not reach FastAPI's dependency solving,
and every request of a catalog (valid, refused by its body, its key, its model, its size) gets the
same status, body and content type from the fast path as from the FastAPI route it stands for,
which the test reaches by letting `HotRoutes` pass every request on.
"""

from __future__ import annotations

import json
import socket

import fastapi.routing
import httpx
import pytest
import tinker
from tinker import types
from tinker.proto.request_conv import forward_backward_request_to_proto

from helpers import BASE_MODEL, sft_batch
from hosted_tinker.api import hot_routes
from hosted_tinker.config.settings import ServerConfig
from hosted_tinker.server.core import Server
from server_process import free_port, serve_in_process

pytestmark = pytest.mark.e2e
KEY, OTHER = "tml-hot-routes", "tml-hot-routes-other"


@pytest.fixture
def in_process_server(tmp_path):
    config = ServerConfig(data_dir=tmp_path, port=free_port(), max_json_request_bytes=4096)
    with serve_in_process(Server(config), config) as url:
        yield url


def test_a_training_step_never_reaches_fastapis_dependency_solving(in_process_server, monkeypatch):
    solved: list[str] = []
    real = fastapi.routing.solve_dependencies

    async def counted(*args, request, **kwargs):
        solved.append(request.url.path)
        return await real(*args, request=request, **kwargs)

    with tinker.ServiceClient(base_url=in_process_server, api_key=KEY) as sc:
        tc = sc.create_lora_training_client(base_model=BASE_MODEL, rank=4).result()
        monkeypatch.setattr(fastapi.routing, "solve_dependencies", counted)
        for _ in range(2):
            fb = tc.forward_backward(sft_batch(2), "cross_entropy")
            opt = tc.optim_step(types.AdamParams(learning_rate=1e-3))
            assert fb.result().loss_fn_outputs and opt.result() is not None
        monkeypatch.setattr(fastapi.routing, "solve_dependencies", real)
    hot = set(hot_routes.HOT_ROUTES)
    assert not [path for path in solved if path in hot], solved
    assert "/api/v1/forward_backward" in hot  # the routes the fast path stands for, named where it checks


def _catalog(model_id: str, request_id: str, fb_body: bytes, seq: int) -> list[tuple[str, str, dict, bytes]]:
    """(name, path, headers, body): every way a step's request can be answered or refused; new seq_ids
    from `seq` on."""
    js = {"Content-Type": "application/json", "X-API-Key": KEY}
    pb = {"Content-Type": "application/x-protobuf", "X-API-Key": KEY}

    def j(value) -> bytes:
        return json.dumps(value).encode()

    return [
        ("optim ok", "/api/v1/optim_step", js, j({"model_id": model_id, "seq_id": seq, "adam_params": {"learning_rate": 1e-3}})),
        ("optim repeated seq_id", "/api/v1/optim_step", js, j({"model_id": model_id, "seq_id": seq})),
        ("optim below expected", "/api/v1/optim_step", js, j({"model_id": model_id, "seq_id": 1})),
        ("optim other optimizer", "/api/v1/optim_step", js, j({"model_id": model_id, "seq_id": seq + 1,
                                                               "optimizer_params": {"type": "sgd"}})),
        ("optim unknown model", "/api/v1/optim_step", js, j({"model_id": "nobody:train:0", "seq_id": 1})),
        ("optim another key's model", "/api/v1/optim_step", {**js, "X-API-Key": OTHER}, j({"model_id": model_id, "seq_id": seq + 2})),
        ("optim no key", "/api/v1/optim_step", {"Content-Type": "application/json"}, j({"model_id": model_id, "seq_id": seq + 3})),
        ("optim bad token", "/api/v1/optim_step", {**js, "X-API-Key": "eyJ.bad.token"}, j({"model_id": model_id, "seq_id": seq + 3})),
        ("optim seq_id 0", "/api/v1/optim_step", js, j({"model_id": model_id, "seq_id": 0})),
        ("optim no model_id", "/api/v1/optim_step", js, j({"seq_id": seq + 4})),
        ("optim no key and bad body", "/api/v1/optim_step", {"Content-Type": "application/json"}, j({"seq_id": "x"})),
        ("optim not json", "/api/v1/optim_step", js, b"{not json"),
        ("optim json list", "/api/v1/optim_step", js, b"[1, 2]"),
        ("optim not utf-8", "/api/v1/optim_step", js, b"\xff\xfe"),
        ("optim text/plain", "/api/v1/optim_step", {**js, "Content-Type": "text/plain"}, j({"model_id": model_id, "seq_id": seq + 5})),
        ("optim too large", "/api/v1/optim_step", js, j({"model_id": model_id, "seq_id": seq + 6, "pad": "x" * 5000})),
        ("optim deep json", "/api/v1/optim_step", js, b"[" * 2000 + b"]" * 2000),
        ("retrieve ok", "/api/v1/retrieve_future", js, j({"request_id": request_id})),
        ("retrieve unknown", "/api/v1/retrieve_future", js, j({"request_id": "req-nothing"})),
        ("retrieve another key's", "/api/v1/retrieve_future", {**js, "X-API-Key": OTHER}, j({"request_id": request_id})),
        ("retrieve no request_id", "/api/v1/retrieve_future", js, j({})),
        ("retrieve no key", "/api/v1/retrieve_future", {"Content-Type": "application/json"}, j({"request_id": request_id})),
        ("fb ok", "/api/v1/forward_backward", pb, fb_body),
        ("fb json", "/api/v1/forward_backward", js, j({"model_id": model_id})),
        ("fb garbage", "/api/v1/forward_backward", pb, b"\x0a\xff\xff\xff"),
        ("fb no key", "/api/v1/forward_backward", {"Content-Type": "application/x-protobuf"}, fb_body),
        ("fb unknown encoding", "/api/v1/forward_backward", {**pb, "Content-Encoding": "br"}, fb_body),
    ]


def _answer(r: httpx.Response) -> tuple:
    body = r.content
    if r.headers.get("content-type", "").startswith("application/json"):
        body = json.loads(body)
        if isinstance(body, dict) and "request_id" in body and str(body["request_id"]).startswith("req-"):
            body = {**body, "request_id": "<new>"}  # a new request's id differs between the two servings
    return r.status_code, r.headers.get("content-type"), r.headers.get("www-authenticate"), body


def test_every_answer_of_the_fast_path_is_fastapis(in_process_server, monkeypatch):
    with tinker.ServiceClient(base_url=in_process_server, api_key=KEY) as sc:
        tc = sc.create_lora_training_client(base_model=BASE_MODEL, rank=4).result()
        model_id = tc.model_id
        tc.forward_backward(sft_batch(2), "cross_entropy").result()
        next_seq = tc._request_id_counter + 1  # the SDK's next seq_id (training_client.py): the next one to run
        with tinker.ServiceClient(base_url=in_process_server, api_key=OTHER) as other:
            other.create_lora_training_client(base_model=BASE_MODEL, rank=4).result()
    with httpx.Client(base_url=in_process_server, timeout=60) as http:
        done = http.post("/api/v1/optim_step", headers={"X-API-Key": KEY},
                         json={"model_id": model_id, "seq_id": next_seq, "adam_params": {"learning_rate": 1e-3}}).json()
        request_id = done["request_id"]
        assert http.post("/api/v1/retrieve_future", headers={"X-API-Key": KEY},
                         json={"request_id": request_id}).json()["type"] == "optim_step"
        seq = iter(range(100, 10_000))

        def fb_body() -> bytes:
            data = [types.Datum(model_input=d.model_input, loss_fn_inputs=d.loss_fn_inputs) for d in sft_batch(1)]
            request = types.ForwardBackwardRequest(
                forward_backward_input=types.ForwardBackwardInput(data=data, loss_fn="cross_entropy"),
                model_id=model_id, seq_id=next(seq))
            return forward_backward_request_to_proto(request).SerializeToString()

        served = {}
        for via in ("fast path", "fastapi"):
            if via == "fastapi":  # every request passed on to FastAPI's routes, as with no fast path
                monkeypatch.setattr(hot_routes.HotRoutes, "__call__",
                                    lambda self, scope, receive, send: self.app(scope, receive, send))
            for name, path, headers, body in _catalog(model_id, request_id, fb_body(), 50 if via == "fast path" else 70):
                served.setdefault(name, []).append(_answer(http.post(path, headers=headers, content=body)))
    different = {name: answers for name, answers in served.items() if answers[0] != answers[1]}
    assert not different, json.dumps(different, indent=1, default=str)
    statuses = {name: answers[0][0] for name, answers in served.items()}
    assert statuses["optim ok"] == statuses["fb ok"] == statuses["retrieve ok"] == 200
    assert {statuses["optim not json"], statuses["optim no model_id"], statuses["optim seq_id 0"]} == {422}
    assert statuses["optim no key"] == statuses["retrieve no key"] == statuses["fb no key"] == 401
    assert statuses["optim too large"] == 413 and statuses["fb json"] == 415
    for name, answers in served.items():
        status, ctype, _, body = answers[0]
        if status >= 400:
            assert ctype == "application/json" and body["detail"], name


def test_a_request_the_http_parser_refuses_is_a_json_400(in_process_server):
    """httptools refuses what it cannot parse before the app sees it; the refusal is JSON like every other."""
    host, port = in_process_server.removeprefix("http://").split(":")
    for raw in (b"GET /api/v1/healthz HTT/1.1\r\n\r\n", b"POST /api/v1/optim_step HTTP/1.1\r\nContent-Length: x\r\n\r\n",
                b"GET /api/v1/audit?\x01 HTTP/1.1\r\nHost: x\r\n\r\n"):
        with socket.create_connection((host, int(port)), timeout=30) as s:
            s.sendall(raw)
            answer = b""
            while chunk := s.recv(65536):
                answer += chunk
        head, _, body = answer.partition(b"\r\n\r\n")
        assert head.startswith(b"HTTP/1.1 400"), answer
        assert b"content-type: application/json" in head.lower(), answer
        assert json.loads(body)["detail"].startswith("invalid HTTP request: "), answer
