import os
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent))
os.environ.setdefault("TINKER_TELEMETRY", "0")

from server_process import ServerProcess  # noqa: E402

API_KEY = "tml-test-key-alice"


@pytest.fixture(scope="session")
def server(tmp_path_factory):
    """One real server process on the embedded model, shared by the end-to-end tests."""
    proc = ServerProcess(tmp_path_factory.mktemp("server")).start()
    yield proc
    proc.stop()


@pytest.fixture
def service_client(server):
    import tinker

    client = tinker.ServiceClient(base_url=server.base_url, api_key=API_KEY)
    yield client


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


@pytest.fixture(scope="session")
def vllm_stacks(request, tmp_path_factory):
    """Every vLLM stack the selected tests use, started together; each module takes its own (`VLLM_STACK`)."""
    from vllm_support import StackPool

    pool = StackPool(tmp_path_factory, [item.module.VLLM_STACK for item in _vllm_items(request.session)])
    yield pool
    pool.close()
