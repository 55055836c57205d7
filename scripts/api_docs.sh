#!/usr/bin/env bash
# The API reference from the public headers (Doxygen, from Debian: scripts/setup.sh installs it):
#   bash scripts/api_docs.sh [OUT]          writes OUT/html/index.html (default out/api)
#   bash scripts/api_docs.sh --check [OUT]  the same, and fails when a public class or function has
#                                           no comment (the tests run this)
set -euo pipefail
cd "$(dirname "$0")/.."
check=0
if [ "${1:-}" = "--check" ]; then check=1; shift; fi
out="${1:-out/api}"
command -v doxygen >/dev/null || { echo "api_docs: doxygen is not installed (bash scripts/setup.sh installs it)" >&2; exit 2; }
mkdir -p "$out"
{ cat docs/Doxyfile; echo "INPUT = $PWD/include"; echo "OUTPUT_DIRECTORY = $out"; echo "WARN_LOGFILE = $out/warnings.txt"; } |
  doxygen - >/dev/null
undocumented=$(grep -E "warning: (Compound .* is not documented|Member .*\(function\).* is not documented)" "$out/warnings.txt" || true)
n=$(printf '%s' "$undocumented" | grep -c . || true)
echo "api_docs: $out/html/index.html; $n public classes and functions without a comment"
if [ "$check" = 1 ] && [ "$n" -gt 0 ]; then
  printf '%s\n' "$undocumented" | sed "s|$PWD/||" >&2
  exit 1
fi
