#!/usr/bin/env bash
# frugal's chat and instruction examples against transformers' apply_chat_template (the pinned 5.23.0):
# tests/parity/chat_parity.py does the work and prints PASS/FAIL per tokenizer and template.
#   bash tests/parity/chat_parity_test.sh build/frugal
# Finds the virtual environment as parity_test.sh does (scripts/torch_venv.sh). Exit 77 (CTest's skip)
# only when there is none or it cannot import transformers and tokenizers; 1 when any case differs.
set -euo pipefail
repo=$(cd "$(dirname "$0")/../.." && pwd)
frugal=${1:?usage: chat_parity_test.sh FRUGAL_BINARY}
[[ -x $frugal ]] || { echo "chat parity: $frugal is not an executable file" >&2; exit 2; }
frugal=$(cd "$(dirname "$frugal")" && pwd)/$(basename "$frugal")

venv=$(bash "$repo/scripts/torch_venv.sh")
if [[ -z $venv || ! -x $venv/bin/python ]]; then
  echo "chat parity: no torch virtual environment (set FRUGAL_TORCH_VENV, or run scripts/setup_torch2.sh): skipped" >&2
  exit 77
fi
if ! "$venv/bin/python" -c "import transformers, tokenizers, jinja2" 2>/dev/null; then
  echo "chat parity: $venv/bin/python cannot import transformers, tokenizers and jinja2 (scripts/setup_torch2.sh installs them): skipped" >&2
  exit 77
fi
work=$(mktemp -d "${TMPDIR:-/tmp}/frugal-chat-parity.XXXXXX")
trap 'rm -rf "$work"' EXIT
"$venv/bin/python" "$repo/tests/parity/chat_parity.py" --frugal "$frugal" --work "$work"
