"""The SDK's real `tinker` command-line tool, run against a test server: a subprocess with a HOME of its
own (its `~/.tinker/credentials.json` is the test's), the server's base URL, and an API key in
TINKER_API_KEY, or none (then it uses the credential `tinker auth login` stored).

It runs as on a machine with the SDK alone: torch is an optional extra of the `tinker` package (its
types use it when it is there), and importing it is most of the start of every command here (~3x).
"""

from __future__ import annotations

import atexit
import functools
import json
import os
import shutil
import subprocess
import sys
import tempfile
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Callable

# The SDK's own `tinker` program (its console script's entry point, run as that script runs it), ended
# with os._exit once it has returned: tinker 0.38's interpreter has aborted (-6, "Fatal Python error:
# Aborted", no Python frame: native code at finalization) after printing its whole answer, in 3 of ~7
# full runs, in `checkpoint download`, `checkpoint info` and `run info`. That is the SDK's process ending,
# not its answer; what these tests check (the output and the exit status the command chose) is unchanged.
TINKER = [sys.executable, "-c", "import os, sys\n"
          "from tinker.cli.__main__ import cli\n"
          "sys.argv[0] = 'tinker'\n"
          "try:\n    code = cli()\nexcept SystemExit as e:\n    code = e.code\n"
          "if isinstance(code, str):\n    print(code, file=sys.stderr)\n    code = 1\n"
          "sys.stdout.flush()\nsys.stderr.flush()\nos._exit(code or 0)\n"]
CLI_WITHIN = 600.0  # hang guard for one command (a download starts a training session; seconds when idle)
# What the test's own environment may hold that would point the CLI elsewhere or at another credential.
_NOT_INHERITED = ("TINKER_API_KEY", "TINKER_CREDENTIAL_CMD", "TINKER_PROJECT_ID", "TINKER_BASE_URL")


@functools.cache
def _without_torch() -> str:
    """A directory that, first on PYTHONPATH, makes `import torch` fail as where it is not installed."""
    root = tempfile.mkdtemp(prefix="cli-without-torch-")
    atexit.register(shutil.rmtree, root, True)
    (Path(root) / "torch").mkdir()
    (Path(root) / "torch" / "__init__.py").write_text('raise ImportError("torch is not installed here")\n')
    return root


def cli(base_url: str, home: Path, *args: str, key: str | None = None, stdin: str | None = None, rc: int = 0,
           env: dict | None = None) -> subprocess.CompletedProcess:
    """`tinker ARGS...` run to its end; its exit status must be `rc`."""
    environment = {k: v for k, v in os.environ.items() if k not in _NOT_INHERITED}
    # PYTHONFAULTHANDLER: a crash of the program before its end leaves its threads' stacks in the failure.
    environment.update({"TINKER_BASE_URL": base_url, "TINKER_TELEMETRY": "0", "HOME": str(home),
                        "COLUMNS": "250", "PYTHONPATH": _without_torch(), "PYTHONFAULTHANDLER": "1",
                        **(env or {})})  # COLUMNS: no cut cells
    if key is not None:
        environment["TINKER_API_KEY"] = key
    out = subprocess.run([*TINKER, *args], env=environment, cwd=home, input=stdin if stdin is not None else "",
                         capture_output=True, text=True, timeout=CLI_WITHIN)
    assert out.returncode == rc, (f"tinker {' '.join(args)} exited with {out.returncode}, not {rc}:\n"
                                  f"{out.stdout}\n{out.stderr}")
    return out


def as_json(out: subprocess.CompletedProcess):
    return json.loads(out.stdout)


def in_parallel(*calls: Callable[[], subprocess.CompletedProcess]) -> list[subprocess.CompletedProcess]:
    """Independent commands run side by side (each one mostly starts Python and imports the SDK)."""
    with ThreadPoolExecutor(max_workers=4) as pool:
        return list(pool.map(lambda call: call(), calls))
