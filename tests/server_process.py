"""A real hosted-tinker server process for end-to-end tests: started, killed -9, restarted, and
the SDK clients that talk to it.

`client()` opens a `tinker.ServiceClient` whose lifetime stays inside the server's: `stop()`
closes every client still open before it ends the process. (The SDK keeps a heartbeat task per
client on its background thread; one that outlives its server warns every 10 s and can abort
the interpreter at exit.)

A server starts in ~0.5 s instead of ~6: it is forked from a parent that imported torch,
transformers and the server's modules once (multiprocessing's forkserver, `_forked_start`).
It is still its own process, started by `hosted_tinker.cli` as `python -m hosted_tinker serve`
starts it, and killed -9 like any. A start the fork parent cannot stand for runs the real
command line instead: another checkout, a wrapped command, or an environment that differs from
the parent's in a variable read at import time (`forkable_env`). Only the test suite forks
(`FORK_STARTS`, set by conftest.py): a benchmark times a server started as users start it.
"""

from __future__ import annotations

import atexit
import contextlib
import multiprocessing
import os
import runpy
import signal
import socket
import subprocess
import sys
import threading
import time
import traceback
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


# The environment of this test process as it started: the fork parent imports with it, and a server
# forked from it sees it plus the variables of `forkable_env` (monkeypatched variables don't leak in).
_START_ENV = dict(os.environ)
# Read by the server at run time, so a forked server may differ from the fork parent in them (the fault
# points, parsed at import, are armed again in the fork: faults.arm_from_environment). Anything of
# torch, OpenMP or the hub is read at import time.
_RUN_TIME_PREFIX = "HOSTED_TINKER_"
# Changed in this process, never in what a server does with them: pytest's name of the running test, and
# torch's inductor cache dir, which torch sets here to its own default (read when used, not at import).
_NOT_THE_SERVERS = frozenset({"PYTEST_CURRENT_TEST", "TORCHINDUCTOR_CACHE_DIR"})
# What the fork parent imports once: the modules a server start imports (a module missing here only
# costs its import in each server). Nothing here may start a thread. Imported from the checkout's
# root (the parent starts there), so `hosted_tinker` is this checkout's.
_PRELOAD = ["torch", "transformers", "uvicorn", "uvicorn.loops.auto", "uvicorn.protocols.http.auto",
            "uvicorn.protocols.websockets.auto", "uvicorn.lifespan.on", "transformers.models.qwen3.modeling_qwen3",
            "transformers.models.llama.modeling_llama", "hosted_tinker.cli", "hosted_tinker.api.app",
            "hosted_tinker.server.core", "hosted_tinker.server.startup", "hosted_tinker.models.loading",
            "hosted_tinker.runtime.pool_launch", "hosted_tinker.observability.logs", "anyio._backends._asyncio",
            "uvicorn.loops.asyncio", "tokenizers.trainers", "transformers.convert_slow_tokenizer",
            "transformers.models.auto.tokenization_auto", "transformers.models.qwen2.tokenization_qwen2"]
_FORK = multiprocessing.get_context("forkserver")
# The test suite forks (conftest.py turns this on); a benchmark starts the real command line, so that
# what it times is a server as users start it.
FORK_STARTS = False
_fork_lock = threading.Lock()
_fork_ready = False


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextlib.contextmanager
def serve_in_process(server, config):
    """`server` (a `hosted_tinker.server.core.Server` made from `config`) served by uvicorn on a thread of
    this process, as `serve` runs it (httptools, `api/http_protocol.py`), for a test that must watch or
    patch what the server's code does; its base URL. Stopped (the device loop too) when the block ends."""
    import uvicorn

    from hosted_tinker.api.app import create_app
    from hosted_tinker.api.http_protocol import HttpProtocol

    uv = uvicorn.Server(uvicorn.Config(create_app(config, server=server), port=config.port, http=HttpProtocol,
                                       log_level="warning"))
    thread = threading.Thread(target=uv.run, daemon=True)
    thread.start()
    while not uv.started:
        if not thread.is_alive():
            raise RuntimeError("the server did not start")
        thread.join(0.05)
    try:
        yield f"http://127.0.0.1:{config.port}"
    finally:
        uv.should_exit = True
        thread.join(60)


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

    @property
    def forked(self) -> bool:
        """Whether `start` forks this server from the pre-imported parent (see the module's docstring)."""
        return FORK_STARTS and self.wrap is None and self.checkout == REPO_ROOT and forkable_env(self.env)

    def start(self, timeout: float = START_WITHIN) -> "ServerProcess":
        self.data_dir.mkdir(parents=True, exist_ok=True)
        argv = ["serve", "--port", str(self.port), "--data-dir", str(self.data_dir), *self.args]
        if self.base_model:
            argv += ["--base-model", self.base_model]
        if self.forked:
            self.proc = _forked_start(argv, self.env, self.checkout, self.log_path)
        else:
            cmd = [sys.executable, "-m", "hosted_tinker", *argv]
            if self.wrap is not None:
                cmd = self.wrap(cmd)
            with open(self.log_path, "ab") as log:  # the child keeps its own descriptor
                self.proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=self.env,
                                             cwd=self.checkout)
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


def forkable_env(env: dict[str, str]) -> bool:
    """Whether a server with this environment can be forked from the parent (which has
    `_START_ENV`): only variables the server reads at run time may differ."""
    changed = {k for k in env.keys() | _START_ENV.keys() if env.get(k) != _START_ENV.get(k)}
    return all(k.startswith(_RUN_TIME_PREFIX) or k in _NOT_THE_SERVERS for k in changed)


class ForkedProcess:
    """What the tests use of `subprocess.Popen`, for a server forked by the fork parent (its exit
    status comes back through multiprocessing: the process is the fork parent's child, not ours)."""

    def __init__(self, process: multiprocessing.Process):
        self._process = process
        self.pid = process.pid

    @property
    def returncode(self) -> int | None:
        return self._process.exitcode  # negative: ended by that signal, as Popen's

    def poll(self) -> int | None:
        return self._process.exitcode

    def wait(self, timeout: float | None = None) -> int:
        self._process.join(timeout)
        if self._process.exitcode is None:
            raise subprocess.TimeoutExpired(f"forked server {self.pid}", timeout)
        return self._process.exitcode

    def send_signal(self, sig: int) -> None:
        if self._process.exitcode is None:
            os.kill(self.pid, sig)

    def terminate(self) -> None:
        self.send_signal(signal.SIGTERM)

    def kill(self) -> None:
        self.send_signal(signal.SIGKILL)


def _forked_start(argv: list[str], env: dict[str, str], cwd: Path, log_path: Path) -> ForkedProcess:
    global _fork_ready
    with _fork_lock:
        if not _fork_ready:  # the parent starts in the checkout's root, with this process's environment as it began
            _FORK.set_forkserver_preload(_PRELOAD)
            env_now, cwd_now = dict(os.environ), os.getcwd()
            os.environ.clear()
            os.environ.update(_START_ENV)
            os.chdir(REPO_ROOT)
            try:
                from multiprocessing import forkserver

                forkserver.ensure_running()
            finally:
                os.chdir(cwd_now)
                os.environ.clear()
                os.environ.update(env_now)
            _fork_ready = True
    process = _FORK.Process(target=_serve_forked, args=(argv, env, str(cwd), str(log_path)),
                            name="hosted-tinker-serve", daemon=True)  # ended at exit if leaked
    process.start()
    return ForkedProcess(process)


def _serve_forked(argv: list[str], env: dict[str, str], cwd: str, log_path: str) -> None:
    """In the forked child: become `python -m hosted_tinker <argv>` with its log as stdout and stderr."""
    os.chdir(cwd)
    os.environ.clear()
    os.environ.update(env)
    log = os.open(log_path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
    os.dup2(log, 1)
    os.dup2(log, 2)
    os.close(log)
    sys.argv = [sys.executable, *argv]
    from hosted_tinker import faults

    faults.arm_from_environment()  # parsed when the parent imported it, from the parent's environment
    code: int | str | None = 1
    try:
        runpy.run_module("hosted_tinker", run_name="__main__")
    except SystemExit as e:
        code = e.code
    except BaseException:
        traceback.print_exc()
    if isinstance(code, str):  # as the interpreter does with sys.exit("message")
        print(code, file=sys.stderr)
        code = 1
    # What the interpreter does on its way out before the process ends: wait for non-daemon threads,
    # then run the atexit functions (logging.shutdown among them). multiprocessing's child would skip
    # both, so the child ends here itself.
    threading._shutdown()
    atexit._run_exitfuncs()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code or 0)


def _stop_heartbeats(sc) -> None:
    """Release a client whose server is gone. `close()` would first retry finishing the session
    for five minutes; the SDK has no public way to skip that, so this closes its session holder
    (heartbeat and background tasks, connections) directly."""
    holder = sc._session_holder
    if holder is not None:
        holder.run_coroutine_threadsafe(holder.aclose()).result(timeout=CLOSE_WITHIN)
