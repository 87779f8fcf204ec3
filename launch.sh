#!/usr/bin/env bash
# hosted-tinker launcher: installs what is needed into a local virtualenv, then runs.
#
#   ./launch.sh serve [flags]    start the server (default: the embedded tiny model, offline)
#   ./launch.sh pool-node --nnodes M --node-rank K --master-addr A --master-port P --workers N
#                                this machine's ranks of a worker pool whose server (rank 0) runs on
#                                machine A with `serve --workers N --nnodes M --master-addr A
#                                --master-port P` (`hosted-tinker pool-node`: torchrun; docs/scale.md)
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
  local hash stamp
  hash="$(cat pyproject.toml tools/install_cookbook.sh | sha256sum | cut -c1-12)"
  stamp="$VENV/.installed-$1-$hash"
  [ -f "$stamp" ] && return 0
  # The test install is a superset of the serve install: after `test`, `serve` installs nothing.
  [ "$1" = serve ] && [ -f "$VENV/.installed-test-$hash" ] && return 0
  echo "installing into $VENV ($1) ..." >&2
  "$VENV/bin/python" -m pip install --disable-pip-version-check "$TORCH_PIN"
  if [ "$1" = test ]; then
    "$VENV/bin/python" -m pip install --disable-pip-version-check -e ".[test]" "$TORCH_PIN"
    bash tools/install_cookbook.sh "$VENV/bin/python"
  else
    "$VENV/bin/python" -m pip install --disable-pip-version-check -e . "$TORCH_PIN"
  fi
  touch "$stamp"
}

# The dashboard's browser test drives Debian's Chromium (never a browser download of Playwright's own).
install_chromium() {
  command -v chromium >/dev/null && return 0
  local sudo=""
  [ "$(id -u)" = 0 ] || sudo="sudo -n"
  echo "installing chromium (Debian package) for the dashboard's browser test ..." >&2
  if ! { $sudo apt-get update -qq && $sudo apt-get install -y -qq chromium; }; then
    echo "chromium could not be installed: the dashboard's browser test will be skipped" >&2
  fi
}

cmd="${1:-serve}"
shift || true
case "$cmd" in
  serve)
    install serve
    exec "$VENV/bin/hosted-tinker" serve "$@"
    ;;
  pool-node)
    install serve
    exec "$VENV/bin/hosted-tinker" pool-node "$@"
    ;;
  test)
    install test
    install_chromium
    exec "$VENV/bin/python" -m pytest "$@"
    ;;
  *)
    echo "usage: $0 serve [flags] | pool-node [flags] | test [pytest args]" >&2
    exit 2
    ;;
esac
