#!/usr/bin/env bash
# Sets up a virtual environment with what manylora needs, then runs the demo or the tests.
#   scripts/bootstrap.sh demo      # a mixed multi-adapter batch, checked against peft
#   scripts/bootstrap.sh test      # the test suite (pytest arguments may follow)
# Without an NVIDIA driver it installs the CPU build torch==2.13.0; set MANYLORA_VENV to
# choose the environment's directory (default .venv).
set -euo pipefail
cd "$(dirname "$0")/.."
mode=${1:?usage: scripts/bootstrap.sh demo|test [args]}
shift
venv=${MANYLORA_VENV:-.venv}
[ -x "$venv/bin/python" ] || python3 -m venv "$venv"
py="$venv/bin/python"
if ! "$py" -c "import torch" 2>/dev/null; then
  if command -v nvidia-smi >/dev/null 2>&1; then
    "$py" -m pip install -q torch
  else
    "$py" -m pip install -q torch==2.13.0
  fi
fi
"$py" -m pip install -q -e ".[test]"
case "$mode" in
  demo) exec "$venv/bin/manylora" demo "$@" ;;
  # Two pytest-xdist workers (CI has two cores); a file's tests stay in one worker, so a
  # module's fixtures are built once. Pass `-n 0` to run in one process.
  test) exec "$py" -m pytest -q -n 2 --dist loadfile "$@" ;;
  *) echo "unknown mode $mode: use demo or test" >&2; exit 2 ;;
esac
