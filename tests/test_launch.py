"""`./launch.sh serve` after `./launch.sh test` installs nothing (the test install is a superset).

A stand-in virtualenv: its `python` records any call and fails (so a reinstall would show and could
not touch a real environment); its `hosted-tinker` prints the arguments it was started with.
"""

from __future__ import annotations

import hashlib
import os
import subprocess
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def _stamp_hash() -> str:
    data = (ROOT / "pyproject.toml").read_bytes() + (ROOT / "tools" / "install_cookbook.sh").read_bytes()
    return hashlib.sha256(data).hexdigest()[:12]


def _fake_venv(tmp_path: Path) -> Path:
    venv = tmp_path / "venv"
    (venv / "bin").mkdir(parents=True)
    for name, body in (("python", f'echo "python $*" >> {tmp_path}/calls; exit 1'),
                       ("hosted-tinker", 'echo "hosted-tinker $*"')):
        script = venv / "bin" / name
        script.write_text(f"#!/bin/sh\n{body}\n")
        script.chmod(0o755)
    return venv


def test_serve_after_test_install_does_not_reinstall(tmp_path):
    venv = _fake_venv(tmp_path)
    (venv / f".installed-test-{_stamp_hash()}").touch()
    out = subprocess.run([str(ROOT / "launch.sh"), "serve", "--port", "8123"], capture_output=True, text=True,
                         timeout=60, env={**os.environ, "HOSTED_TINKER_VENV": str(venv)})
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "hosted-tinker serve --port 8123"
    assert "installing" not in out.stderr and not (tmp_path / "calls").exists()


def test_a_stale_stamp_installs_again(tmp_path):
    venv = _fake_venv(tmp_path)
    (venv / ".installed-test-000000000000").touch()  # made for another pyproject.toml
    out = subprocess.run([str(ROOT / "launch.sh"), "serve"], capture_output=True, text=True, timeout=60,
                         env={**os.environ, "HOSTED_TINKER_VENV": str(venv)})
    assert out.returncode != 0 and "installing into" in out.stderr
    assert "pip install --disable-pip-version-check torch==2.13.0" in (tmp_path / "calls").read_text()
