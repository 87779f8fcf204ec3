import compileall
import os
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent))
os.environ.setdefault("TINKER_TELEMETRY", "0")
if sys.dont_write_bytecode:
    # Where bytecode is not written (PYTHONDONTWRITEBYTECODE, set on this project's machines), each of
    # the hundreds of servers, clients and CLI commands the suite runs would compile this checkout's
    # package from source again (0.35 CPU-s of a server start's 6.3 here); written once now, each reads
    # it. Python recompiles in memory a module whose source is newer than its bytecode: never stale.
    compileall.compile_dir(Path(__file__).resolve().parent.parent / "hosted_tinker", quiet=1)

import leak_guard  # noqa: E402
from helpers import API_KEY, TEAM_ADMINS, Gate, write_team_keys  # noqa: E402
import server_process  # noqa: E402
from server_process import ServerProcess  # noqa: E402

server_process.FORK_STARTS = True  # the suite's servers start forked from a pre-imported parent (~0.5 s, not ~6)

_SESSION_SERVERS: set[int] = set()  # pids of servers that session fixtures own (they outlive modules)


@pytest.fixture(scope="session")
def server_gate(tmp_path_factory):
    """The shared server's `device_loop.before_plan` gate (helpers.Gate): open unless a test closes
    it to queue several clients' requests for one cycle (helpers.in_one_cycle)."""
    return Gate(tmp_path_factory.mktemp("server-gates"), "device_loop.before_plan")


@pytest.fixture(scope="session")
def server(tmp_path_factory, server_gate):
    """One real server process on the embedded model, shared by the end-to-end tests. Its clients
    are each test's (or module's) to close: the module guard below fails a module that leaves one."""
    env = {"HOSTED_TINKER_FAULTS": server_gate.point, **server_gate.gates_env()}
    proc = ServerProcess(tmp_path_factory.mktemp("server"), env=env).start()
    _SESSION_SERVERS.add(proc.proc.pid)
    yield proc
    proc.stop()


@pytest.fixture(scope="session")
def team_server(tmp_path_factory):
    """A server with a keys file (helpers.TEAM: alice, bob and the admin root), shared by the tests of
    the team features (identity, usage, storage, audit, copies, search, traces): each reads only what
    its own sessions and checkpoints did."""
    root = tmp_path_factory.mktemp("team")
    keys = write_team_keys(root / "keys")
    proc = ServerProcess(root / "srv", args=("--api-keys-file", str(keys), "--admin-users", ",".join(TEAM_ADMINS)))
    proc.start()
    _SESSION_SERVERS.add(proc.proc.pid)
    yield proc
    proc.stop()


@pytest.fixture
def service_client(server):
    """An SDK client of the shared server (API_KEY), closed when the test ends."""
    with server.client(API_KEY) as client:
        yield client


@pytest.fixture(autouse=True)
def rest_clients_read_their_test_s_api_key():
    """Each test's `RestClient()` without an api_key is made with that test's $TINKER_API_KEY (the SDK
    caches one per base URL for the process: leak_guard.forget_rest_clients_keyed_by_environment)."""
    yield
    leak_guard.forget_rest_clients_keyed_by_environment()


@pytest.fixture(scope="module", autouse=True)
def closes_what_it_opens():
    """After each module (and its module-scoped fixtures): no SDK client still heartbeating and no
    server process of its own still running. Either fails the module's last test, and is ended."""
    yield
    problems = []
    sessions = leak_guard.open_sdk_sessions(stop=True)
    if sessions:
        problems.append(f"{len(sessions)} tinker.ServiceClient(s) left open (sessions {', '.join(sessions)}): "
                        "open them with ServerProcess.client() or `with tinker.ServiceClient(...)`, closed before "
                        "their server stops")
    servers = [p for p in leak_guard.child_processes() if leak_guard.is_server(p) and p.pid not in _SESSION_SERVERS]
    if servers:
        problems.append("server processes left running: " + "; ".join(map(leak_guard.describe, servers)))
        leak_guard.end(servers)
    if problems:
        pytest.fail("this module leaks: " + " | ".join(problems), pytrace=False)


# -- vLLM sidecar tests (tests/vllm_support.py) --------------------------------------------------
_VLLM_INSTALL = pytest.StashKey()


def _vllm_items(session) -> list:
    return [item for item in session.items if "vllm_stacks" in getattr(item, "fixturenames", ())]


def pytest_collection_finish(session):
    """Selected tests need vLLM: install it (if needed) meanwhile, while the tests before them run."""
    if _vllm_items(session):
        from vllm_support import start_install

        session.config.stash[_VLLM_INSTALL] = start_install()


def pytest_sessionfinish(session):
    install = session.config.stash.get(_VLLM_INSTALL, None)
    if install is not None:
        from vllm_support import stop_install

        stop_install(install)
    _nothing_left_running(session)


def _nothing_left_running(session) -> None:
    """Every fixture is torn down by now: an SDK client or any child process still alive fails
    the run (a heartbeat that outlives its server can abort the interpreter at exit)."""
    problems = []
    sessions = leak_guard.open_sdk_sessions(stop=True)
    if sessions:
        problems.append(f"tinker.ServiceClient(s) still open: sessions {', '.join(sessions)}")
    children = leak_guard.child_processes()
    if children:
        problems.append("processes still running: " + "; ".join(map(leak_guard.describe, children)))
        leak_guard.end(children)
    if problems:
        reporter = session.config.pluginmanager.get_plugin("terminalreporter")
        if reporter is not None:
            reporter.write_line("the test session leaks: " + " | ".join(problems), red=True)
        session.exitstatus = pytest.ExitCode.TESTS_FAILED


@pytest.fixture(scope="session")
def vllm_stacks(request, tmp_path_factory):
    """Every vLLM stack the selected tests use, started together; each module takes its own (`VLLM_STACK`)."""
    from vllm_support import StackPool

    pool = StackPool(tmp_path_factory, [item.module.VLLM_STACK for item in _vllm_items(request.session)])
    yield pool
    pool.close()
