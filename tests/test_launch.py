"""`./launch.sh serve` after `./launch.sh test` installs nothing (the test install is a superset), and
what it installs (pyproject's `dependencies`, no extras) holds every package the server imports.

A stand-in virtualenv: its `python` records any call and fails (so a reinstall would show and could
not touch a real environment); its `hosted-tinker` prints the arguments it was started with.
"""

from __future__ import annotations

import ast
import hashlib
import os
import subprocess
import sys
import tomllib
from importlib import metadata
from pathlib import Path

from packaging.requirements import Requirement
from packaging.utils import canonicalize_name

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


def imported_packages() -> dict[str, set[str]]:
    """Top-level modules outside the standard library that hosted_tinker imports (at a module's top
    or inside a function), each with the files that import it."""
    found: dict[str, set[str]] = {}
    for path in (ROOT / "hosted_tinker").rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                names = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom) and not node.level:
                names = [node.module]
            else:
                continue
            for name in names:
                top = name.partition(".")[0]
                if top not in sys.stdlib_module_names and top != "hosted_tinker":
                    found.setdefault(top, set()).add(str(path.relative_to(ROOT)))
    return found


def installed_with(requirements: list[str]) -> set[str]:
    """The distributions `pip install` of `requirements` brings: they and their dependencies, with the
    extras each is asked for, as this environment's metadata says."""
    todo, seen, names = [Requirement(r) for r in requirements], set(), set()
    while todo:
        req = todo.pop()
        name = canonicalize_name(req.name)
        extras = {"", *req.extras}
        if {(name, e) for e in extras} <= seen:
            continue
        seen |= {(name, e) for e in extras}
        names.add(name)
        for line in metadata.requires(name) or []:
            dep = Requirement(line)
            if dep.marker is None or any(dep.marker.evaluate({"extra": e}) for e in extras):
                todo.append(dep)
    return names


def test_the_serve_install_has_every_package_the_server_imports():
    """`./launch.sh serve` installs the project without extras: each package the server imports comes
    with its `dependencies`, directly or as one's dependency. Pillow did not (only the test extras'
    cookbook brought it), so a served vision-language model died at start-up with an empty ImportError."""
    dependencies = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["dependencies"]
    installed = installed_with(dependencies)
    providers = metadata.packages_distributions()
    missing = {module: sorted(files)[0] for module, files in imported_packages().items()
               if not {canonicalize_name(d) for d in providers.get(module, ())} & installed}
    assert not missing, f"imported, but not installed by the serve install (pyproject's dependencies): {missing}"
