#!/usr/bin/env bash
# Installs the second LibTorch frugal is built and tested against: LibTorch 2.x from PyPI's torch wheel
# (a CUDA build; on a machine without a GPU it runs on the CPU), pinned, in a virtual environment in
# the repository's ignored folder .venv-torch2/ (never into the system Python). Idempotent.
# Also installs transformers (pinned, test-only) for the parity suite.
# Prints the torch folder (its CMake files are under share/cmake) on the last line.
set -euo pipefail
cd "$(dirname "$0")/.."
TORCH_PIN="${FRUGAL_TORCH_PIN:-2.15.0}"
# transformers, test-only: the parity suite (tests/parity) compares frugal against it.
TRANSFORMERS_PIN="${FRUGAL_TRANSFORMERS_PIN:-5.23.0}"
VENV=.venv-torch2
installed() {
  [ -x "$VENV/bin/python" ] &&
    "$VENV/bin/python" -c "import sys, importlib.metadata as m; sys.exit(0 if m.version('torch').split('+')[0] == '$TORCH_PIN' else 1)" 2>/dev/null
}
if ! installed; then
  start=$(date +%s)
  if [ ! -x "$VENV/bin/python" ]; then
    # python3 -m venv needs ensurepip (Debian: python3-venv, installed by scripts/setup.sh).
    python3 -m venv "$VENV" 2>/dev/null || /usr/bin/python3 -m venv "$VENV"
  fi
  echo "setup-torch2: installing torch==$TORCH_PIN into $VENV (about 5 GB with its CUDA libraries)" >&2
  "$VENV/bin/pip" install -q --disable-pip-version-check "torch==$TORCH_PIN"
  echo "setup-torch2: installed in $(( $(date +%s) - start )) s" >&2
fi
has_transformers() {
  "$VENV/bin/python" -c "import sys, importlib.metadata as m; sys.exit(0 if m.version('transformers') == '$TRANSFORMERS_PIN' else 1)" 2>/dev/null
}
if ! has_transformers; then
  echo "setup-torch2: installing transformers==$TRANSFORMERS_PIN into $VENV (test-only)" >&2
  "$VENV/bin/pip" install -q --disable-pip-version-check "transformers==$TRANSFORMERS_PIN"
fi
"$VENV/bin/python" - <<'PY'
import importlib.util, os
print(os.path.dirname(importlib.util.find_spec("torch").origin))
PY
