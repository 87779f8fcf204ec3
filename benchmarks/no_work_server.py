"""A Tinker server that does no work: the floor the SDK and loopback HTTP put under a training step.

`overhead.py`'s mode (c) points a third SDK training client here. Everything the SDK sends is
passed on to the real server (`--upstream`) until this server has seen one answered
forward_backward and one answered optim_step; from then on it answers those two routes and their
`retrieve_future` long-polls itself, from memory: a forward_backward's "pass" is a timer (no CPU,
no GIL) as long as the benchmark last set (`POST /_pass_seconds`, its in-process step), the
run's optim_step is ready when that pass ends (fused into its cycle, as the real server does for a
pipelining client), and each is answered with the bytes the real server gave for the same request
body. What such a step takes beyond the timer is the SDK's own work (building, sending, parsing,
handing results to the caller) and loopback HTTP through the same uvicorn/httptools stack, and
nothing of a server's: no server can add less. It is a lower bound, as the timer leaves the CPU to
the SDK, where a real CPU pass competes with it.

    .venv/bin/python benchmarks/no_work_server.py --upstream http://127.0.0.1:PORT [--port 0]

prints `listening on PORT`, then `accepting connections`. A benchmark's helper; nothing else uses it.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import socket
import sys
import uuid
from pathlib import Path

import httpx
import uvicorn

class NoWorkServer:
    def __init__(self, upstream: str):
        self.upstream = httpx.AsyncClient(base_url=upstream, timeout=None)
        self.pass_seconds = 0.0
        self.learned: dict[str, tuple[bytes, str]] = {}  # route -> (result body, content type) the real server gave
        self.learning: dict[str, str] = {}  # upstream request id -> its route, until its result is in
        self.ready: dict[str, tuple[float, bytes, str]] = {}  # our request id -> (when, body, content type)
        self.pass_end: dict[str, float] = {}  # model id -> when its last pass ends

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] == "lifespan":
            while (await receive())["type"] != "lifespan.shutdown":
                await send({"type": "lifespan.startup.complete"})
                print("accepting connections", flush=True)
            await send({"type": "lifespan.shutdown.complete"})
            return
        body = b""
        while True:
            message = await receive()
            body += message.get("body", b"")
            if not message.get("more_body"):
                break
        status, payload, media = await self.answer(scope, body)
        await send({"type": "http.response.start", "status": status,
                    "headers": [(b"content-type", media.encode()), (b"content-length", str(len(payload)).encode())]})
        await send({"type": "http.response.body", "body": payload})

    async def answer(self, scope, body: bytes) -> tuple[int, bytes, str]:
        path = scope["path"]
        route = path.rsplit("/", 1)[-1]
        if path == "/_pass_seconds":
            self.pass_seconds = float(body)
            return 200, json.dumps({"answering_from_memory": len(self.learned) == 2}).encode(), "application/json"
        if route in ("forward_backward", "optim_step") and len(self.learned) == 2:
            return 200, self.take(route, body), "application/json"
        if route == "retrieve_future":
            request_id = json.loads(body)["request_id"]
            if request_id in self.ready:
                when, payload, media = self.ready.pop(request_id)
                await asyncio.sleep(max(0.0, when - asyncio.get_running_loop().time()))
                return 200, payload, media
        return await self.pass_on(scope, body, route)

    def take(self, route: str, body: bytes) -> bytes:
        """A request answered from memory: its result is ready when its run's pass ends."""
        model_id = _model_id(route, body)
        now = asyncio.get_running_loop().time()
        if route == "forward_backward":
            self.pass_end[model_id] = max(now, self.pass_end.get(model_id, 0.0)) + self.pass_seconds
        request_id = f"req-nowork-{uuid.uuid4().hex}"
        self.ready[request_id] = (self.pass_end.get(model_id, now), *self.learned[route])
        return json.dumps({"request_id": request_id, "model_id": model_id}).encode()

    async def pass_on(self, scope, body: bytes, route: str) -> tuple[int, bytes, str]:
        headers = {k.decode(): v.decode() for k, v in scope["headers"] if k.decode() not in ("host", "content-length")}
        reply = await self.upstream.request(scope["method"], scope["path"], content=body, headers=headers,
                                            params=scope["query_string"].decode() or None)
        media = reply.headers.get("content-type", "application/json")
        if reply.status_code == 200 and route in ("forward_backward", "optim_step"):
            self.learning[reply.json()["request_id"]] = route
        elif reply.status_code == 200 and route == "retrieve_future":
            learnt = self.learning.get(json.loads(body)["request_id"])
            if learnt is not None and (media != "application/json" or reply.json().get("type") != "try_again"):
                self.learned[learnt] = (reply.content, media)
        return reply.status_code, reply.content, media


def _model_id(route: str, body: bytes) -> str:
    if route == "optim_step":
        return json.loads(body)["model_id"]
    from hosted_tinker.wire import tinker_wire_pb2 as pb  # forward_backward comes as protobuf

    return pb.ForwardBackwardRequest.FromString(body).model_id


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--upstream", required=True, help="the real server's base URL")
    ap.add_argument("--port", type=int, default=0, help="0: a free port")
    args = ap.parse_args()
    # IPPROTO_TCP named: asyncio sets TCP_NODELAY only on sockets whose proto says TCP (an accepted
    # socket inherits the listener's), and without it Nagle holds each answer's body ~40 ms.
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM, socket.IPPROTO_TCP)
    sock.bind(("127.0.0.1", args.port))
    config = uvicorn.Config(NoWorkServer(args.upstream), log_level="warning", access_log=False,
                            http="httptools", lifespan="on")
    server = uvicorn.Server(config)
    print(f"listening on {sock.getsockname()[1]}", flush=True)
    server.run(sockets=[sock])
    return 0


if __name__ == "__main__":
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # hosted_tinker, for the protobuf
    sys.exit(main())
