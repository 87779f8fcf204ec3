#!/usr/bin/env bash
# Install tinker-cookbook 0.6.1 into an existing Python environment without touching torch.
#
# Why this script exists: `pip install tinker-cookbook==0.6.1` fails because the package
# requires `tml-renderers`, which is not published on PyPI (it is only used for two
# proprietary model families, which we never exercise). So we install the cookbook's other
# requirements by hand, then the cookbook itself with --no-deps, plus what the RL recipes
# import at run time (math-verify, pylatexenc, sympy).
#
# torch (and the other core libraries the server is tested against) must stay exactly as
# installed: a resolver that "helpfully" upgrades torch would pull several GB of CUDA wheels
# on a CPU machine. We therefore pin every already-installed core package through a pip
# constraints file built from what is installed right now.
#
# Usage: tools/install_cookbook.sh [PYTHON]      (default: .venv/bin/python)
# Idempotent: exits quickly when the cookbook and its extras are already importable.
set -euo pipefail

PY="${1:-.venv/bin/python}"
COOKBOOK_VERSION="0.6.1"

if ! "$PY" -c 'import sys' 2>/dev/null; then
    echo "install_cookbook.sh: no working python at '$PY'" >&2
    exit 2
fi

# Fast path: everything already importable at the right version -> nothing to do.
if "$PY" - "$COOKBOOK_VERSION" <<'PYEOF' 2>/dev/null; then
import sys
from importlib.metadata import version
from importlib.util import find_spec
assert version("tinker-cookbook") == sys.argv[1]
for module in ("tinker_cookbook", "datasets", "chz", "blobfile", "pyrage", "tiktoken",
               "math_verify", "pylatexenc", "sympy"):
    assert find_spec(module) is not None, module
PYEOF
    exit 0
fi

if ! "$PY" -c 'import torch' 2>/dev/null; then
    echo "install_cookbook.sh: torch must be installed first (the project pins it)" >&2
    exit 2
fi

TORCH_BEFORE="$("$PY" -c 'from importlib.metadata import version; print(version("torch"))')"
CONSTRAINTS="$(mktemp)"
LOG="$(mktemp)"
trap 'rm -f "$CONSTRAINTS" "$LOG"' EXIT
# Pin the installed versions of the packages the server depends on, so that nothing the
# cookbook pulls in can replace them. Packages that are not installed are simply not pinned.
"$PY" - >"$CONSTRAINTS" <<'PYEOF'
from importlib.metadata import PackageNotFoundError, version
for name in ["torch", "transformers", "tokenizers", "huggingface-hub", "safetensors",
             "peft", "tinker", "numpy", "pydantic", "fastapi", "protobuf"]:
    try:
        print(f"{name}=={version(name)}")
    except PackageNotFoundError:
        pass
PYEOF

# pip's own output (including warnings about index locations a machine's pip.conf names but
# does not have) goes to a log that is shown only if the install fails.
pip_install() {
    if ! "$PY" -m pip install --quiet --disable-pip-version-check --no-input \
            -c "$CONSTRAINTS" "$@" >>"$LOG" 2>&1; then
        cat "$LOG" >&2
        echo "install_cookbook.sh: pip install $* failed" >&2
        exit 1
    fi
}

# tinker-cookbook 0.6.1 Requires-Dist, minus tml-renderers (not on PyPI) and torch (pinned).
pip_install \
    aiohttp anyio blobfile chz cloudpickle datasets huggingface-hub numpy pillow pydantic \
    pyrage rich safetensors termcolor tiktoken "tinker>=0.38.0" tqdm transformers \
    math-verify pylatexenc sympy
pip_install --no-deps "tinker-cookbook==${COOKBOOK_VERSION}"

# Last check: the import surface tests rely on, and torch untouched.
"$PY" - "$TORCH_BEFORE" <<'PYEOF'
import sys
from importlib.metadata import version
import tinker_cookbook.renderers, tinker_cookbook.supervised.data  # noqa: F401
import datasets, math_verify  # noqa: F401
assert version("torch") == sys.argv[1], f"torch changed: {sys.argv[1]} -> {version('torch')}"
PYEOF
