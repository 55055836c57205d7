#!/usr/bin/env bash
# The house style (.clang-format) on every C++ file of the checkout (tracked, or new and not ignored).
#   bash scripts/format.sh           formats them in place
#   bash scripts/format.sh --check   changes nothing; fails naming each file that is not formatted
#                                    (CTest `format`)
set -euo pipefail
cd "$(dirname "$0")/.."
command -v clang-format >/dev/null || { echo "format: clang-format is not installed (bash scripts/setup.sh installs it)" >&2; exit 2; }
# Tracked files and new ones not yet added (but not ignored ones: build folders, the venv), so a new
# file is formatted and checked before its first commit.
mapfile -t files < <(git ls-files --cached --others --exclude-standard '*.cpp' '*.h' '*.cu' '*.inc' 2>/dev/null ||
  find src include apps tests examples \( -name '*.cpp' -o -name '*.h' -o -name '*.cu' -o -name '*.inc' \))
case "${1:-}" in
  "") clang-format -i "${files[@]}" ;;
  --check)
    bad=()
    for f in "${files[@]}"; do
      clang-format --dry-run -Werror "$f" >/dev/null 2>&1 || bad+=("$f")
    done
    if ((${#bad[@]})); then
      echo "format: ${#bad[@]} files differ from .clang-format (bash scripts/format.sh fixes them): ${bad[*]}" >&2
      exit 1
    fi
    echo "format: ${#files[@]} files follow .clang-format" ;;
  *) echo "format.sh: unknown argument '$1' (allowed: --check)" >&2; exit 2 ;;
esac
