#!/usr/bin/env bash
# frugal against transformers (the pinned 5.23.0) on tiny random checkpoints: tests/parity/parity.py does
# the work and prints PASS/FAIL per config with the numbers.
#   bash tests/parity/parity_test.sh build/frugal [--only llama_gqa,round_trip]
# Finds the virtual environment as scripts/compare_pytorch.sh does ($FRUGAL_TORCH_VENV, else .venv-torch2 in
# this checkout or in the main worktree; scripts/setup_torch2.sh makes it). Exit 77 (CTest's skip) only
# when there is no such environment or it cannot import transformers; 1 when any config fails.
set -euo pipefail
repo=$(cd "$(dirname "$0")/../.." && pwd)
frugal=${1:?usage: parity_test.sh FRUGAL_BINARY [--only CASES]}
shift
[[ -x $frugal ]] || { echo "parity: $frugal is not an executable file" >&2; exit 2; }
frugal=$(cd "$(dirname "$frugal")" && pwd)/$(basename "$frugal")

venv=$(bash "$repo/scripts/torch_venv.sh")  # $FRUGAL_TORCH_VENV, or .venv-torch2 here or in the main worktree
if [[ -z $venv || ! -x $venv/bin/python ]]; then
  echo "parity: no torch virtual environment (set FRUGAL_TORCH_VENV, or run scripts/setup_torch2.sh): skipped" >&2
  exit 77
fi
if ! "$venv/bin/python" -c "import torch, transformers, safetensors" 2>/dev/null; then
  echo "parity: $venv/bin/python cannot import transformers (scripts/setup_torch2.sh installs it): skipped" >&2
  exit 77
fi
work=$(mktemp -d "${TMPDIR:-/tmp}/frugal-parity.XXXXXX")
trap 'rm -rf "$work"' EXIT
"$venv/bin/python" "$repo/tests/parity/parity.py" --frugal "$frugal" --work "$work" "$@"
