#!/usr/bin/env bash
# hosted-tinker launcher: installs what is needed into a local virtualenv, then runs.
#
#   ./launch.sh serve [flags]    start the server (default: the embedded tiny model, offline)
#   ./launch.sh test [pytest args]   install the test dependencies and run the whole suite
#
# torch==2.13.0 is installed first and on its own: any other torch (pulled in by a later
# dependency) would download several GB of CUDA wheels on a CPU machine.
set -euo pipefail
cd "$(dirname "$0")"
VENV="${HOSTED_TINKER_VENV:-.venv}"
PYTHON="${PYTHON:-python3}"
TORCH_PIN="torch==2.13.0"

install() {  # $1: serve | test
  [ -x "$VENV/bin/python" ] || "$PYTHON" -m venv "$VENV"
  local stamp="$VENV/.installed-$1-$(cat pyproject.toml tools/install_cookbook.sh | sha256sum | cut -c1-12)"
  [ -f "$stamp" ] && return 0
  echo "installing into $VENV ($1) ..." >&2
  "$VENV/bin/python" -m pip install -q --disable-pip-version-check "$TORCH_PIN"
  if [ "$1" = test ]; then
    "$VENV/bin/python" -m pip install -q --disable-pip-version-check -e ".[test]" "$TORCH_PIN"
    bash tools/install_cookbook.sh "$VENV/bin/python"
  else
    "$VENV/bin/python" -m pip install -q --disable-pip-version-check -e . "$TORCH_PIN"
  fi
  touch "$stamp"
}

cmd="${1:-serve}"
shift || true
case "$cmd" in
  serve)
    install serve
    exec "$VENV/bin/hosted-tinker" serve "$@"
    ;;
  test)
    install test
    exec "$VENV/bin/python" -m pytest "$@"
    ;;
  *)
    echo "usage: $0 serve [flags] | test [pytest args]" >&2
    exit 2
    ;;
esac
