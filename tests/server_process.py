"""A real hosted-tinker server process for end-to-end tests: started, killed -9, restarted, and
the SDK clients that talk to it.

`client()` opens a `tinker.ServiceClient` whose lifetime stays inside the server's: `stop()`
closes every client still open before it ends the process. (The SDK keeps a heartbeat task per
client on its background thread; one that outlives its server warns every 10 s and can abort
the interpreter at exit.)
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import Callable

import httpx

# `python -m hosted_tinker` imports the package of the working directory first: the server runs
# this checkout's code whatever directory the caller (a test, a benchmark of another checkout)
# runs in.
REPO_ROOT = Path(__file__).resolve().parent.parent

START_WITHIN = 300.0  # hang guard for a start (~5 s idle, far more on a loaded 2-core CI box)
STOP_WITHIN = 120.0  # hang guard for a graceful stop (it finishes the running cycle first)
CLOSE_WITHIN = 120.0  # hang guard for a client's close (one request: finish its session)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class ServerProcess:
    def __init__(self, data_dir: Path, *, base_model: str | None = None, env: dict | None = None,
                 args: tuple[str, ...] = (), checkout: Path = REPO_ROOT,
                 wrap: Callable[[list[str]], list[str]] | None = None):
        self.data_dir = Path(data_dir)
        self.checkout = checkout  # `python -m hosted_tinker` runs the package of its working directory
        self.base_model = base_model
        self.env = {**os.environ, **(env or {})}
        self.args = args
        self.wrap = wrap  # the server's command line -> one that runs it elsewhere (two_machines.Machine.command)
        self.port = free_port()
        self.proc: subprocess.Popen | None = None
        self.log_path = self.data_dir / "server.log"
        self._clients: list = []  # tinker.ServiceClient, closed by stop() unless closed before

    @property
    def base_url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def start(self, timeout: float = START_WITHIN) -> "ServerProcess":
        self.data_dir.mkdir(parents=True, exist_ok=True)
        cmd = [sys.executable, "-m", "hosted_tinker", "serve", "--port", str(self.port),
               "--data-dir", str(self.data_dir), *self.args]
        if self.base_model:
            cmd += ["--base-model", self.base_model]
        if self.wrap is not None:
            cmd = self.wrap(cmd)
        with open(self.log_path, "ab") as log:  # the child keeps its own descriptor
            self.proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=self.env, cwd=self.checkout)
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"server exited with {self.proc.returncode}:\n{self.log()}")
            try:
                if httpx.get(f"{self.base_url}/api/v1/healthz", timeout=1).status_code == 200:
                    return self
            except httpx.HTTPError:
                pass
            time.sleep(0.1)
        self._end_process()
        raise RuntimeError(f"server did not become healthy in {timeout}s:\n{self.log()}")

    def client(self, api_key: str, **kwargs):
        """A `tinker.ServiceClient` of this server, closed by `stop()` if not closed before
        (`with srv.client(key) as sc:` closes it at the block's end)."""
        import tinker

        sc = tinker.ServiceClient(base_url=self.base_url, api_key=api_key, **kwargs)
        self._clients.append(sc)
        return sc

    def log(self, tail: int | None = 5000) -> str:
        """The server's log: its last `tail` characters (for messages), or all of it (tail=None,
        for assertions: start-up lines scroll out of a tail where probes log warnings)."""
        text = self.log_path.read_text(errors="replace") if self.log_path.exists() else ""
        return text if tail is None else text[-tail:]

    def kill9(self) -> None:
        """A real crash. Open clients stay open: they talk to the process started next."""
        assert self.proc is not None
        self.proc.send_signal(signal.SIGKILL)
        self.proc.wait(30)

    def stop(self) -> None:
        """Close this server's open clients (while it can still answer them), then end it."""
        self.close_clients()
        self._end_process()

    def restart(self) -> "ServerProcess":
        """A graceful stop and a new process on the same data dir and port; clients stay open."""
        self._end_process()
        return self.start()

    def close_clients(self) -> None:
        clients, self._clients = self._clients, []
        for sc in clients:
            if self.alive():
                sc.close("success").result(timeout=CLOSE_WITHIN)  # a no-op for one closed already
            else:  # the process is gone (killed by the test, or it crashed): no session to finish
                _stop_heartbeats(sc)

    def _end_process(self) -> None:
        if self.alive():
            self.proc.terminate()
            try:
                self.proc.wait(STOP_WITHIN)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(30)


def _stop_heartbeats(sc) -> None:
    """Release a client whose server is gone. `close()` would first retry finishing the session
    for five minutes; the SDK has no public way to skip that, so this closes its session holder
    (heartbeat and background tasks, connections) directly."""
    holder = sc._session_holder
    if holder is not None:
        holder.run_coroutine_threadsafe(holder.aclose()).result(timeout=CLOSE_WITHIN)
