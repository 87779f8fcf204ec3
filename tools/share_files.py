"""Hard-link one installed package's files between two virtualenvs that hold the same release.

    python tools/share_files.py PACKAGE SOURCE_PYTHON TARGET_PYTHON

Every file of PACKAGE in TARGET_PYTHON's environment that is byte-identical to the file at the
same place in SOURCE_PYTHON's is replaced by a hard link to it, so the two venvs keep one copy
(torch: 754 MB). Nothing changes unless both hold the same version of the package. Either venv
can later upgrade or remove the package on its own: pip unlinks files, which leaves the other
venv's links intact. Where hard links are impossible (two filesystems), it says so and keeps the
copies.
"""

from __future__ import annotations

import filecmp
import json
import os
import subprocess
import sys
from pathlib import Path

LOCATE = """
import importlib.metadata, importlib.util, json, sys
spec = importlib.util.find_spec(sys.argv[1])
print(json.dumps([importlib.metadata.version(sys.argv[1]), spec.submodule_search_locations[0]]))
"""


def locate(python: str, package: str) -> tuple[str, Path]:
    """(version, package folder) of `package` as `python` would import it, without importing it."""
    out = subprocess.run([python, "-c", LOCATE, package], check=True, capture_output=True, text=True).stdout
    version, folder = json.loads(out)
    return version, Path(folder)


def share(source: Path, target: Path) -> tuple[int, int]:
    """Link target's files to source's identical ones; (files linked, bytes saved)."""
    linked = saved = 0
    for path in target.rglob("*"):
        if path.is_symlink() or not path.is_file():
            continue
        twin = source / path.relative_to(target)
        if not twin.is_file() or twin.is_symlink():
            continue
        here, there = path.stat(), twin.stat()
        if here.st_ino == there.st_ino or here.st_size != there.st_size or not filecmp.cmp(path, twin, shallow=False):
            continue
        tmp = path.with_name(path.name + ".share-tmp")
        os.link(twin, tmp)
        os.replace(tmp, path)
        linked += 1
        saved += here.st_size
    return linked, saved


def main(package: str, source_python: str, target_python: str) -> int:
    source_version, source = locate(source_python, package)
    target_version, target = locate(target_python, package)
    if source_version != target_version:
        print(f"share_files: {package} {target_version} in {target} differs from {source_version} in {source}: "
              "nothing shared")
        return 0
    try:
        linked, saved = share(source, target)
    except OSError as e:  # typically EXDEV: the venvs are on different filesystems
        print(f"share_files: cannot hard-link {target} to {source} ({e}): the copies stay")
        return 0
    print(f"share_files: {package} {target_version}: {linked} files ({saved / 2**20:.0f} MiB) now hard links "
          f"to {source}")
    return 0


if __name__ == "__main__":
    if len(sys.argv) != 4:
        sys.exit(__doc__)
    sys.exit(main(*sys.argv[1:]))
