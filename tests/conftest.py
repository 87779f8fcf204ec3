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
