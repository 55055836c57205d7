#!/usr/bin/env bash
# Installs every system package frugal needs on Debian 12. Idempotent: safe to re-run.
set -euo pipefail

packages=(
  cmake g++ make ccache
  ninja-build           # the build tool scripts/build.sh uses where it is installed
  libtorch-dev          # LibTorch 1.13 (CPU)
  libopenblas0-pthread  # without it matrix products fall back to reference BLAS (~30x slower)
  libgtest-dev          # GoogleTest
  libgloo-dev           # the Gloo headers c10d's ProcessGroupGloo.hpp includes (data-parallel training)
  python3               # the CLI test reads the JSON back
  python3-venv          # the virtual environment that holds the LibTorch 2.x wheel (scripts/setup_torch2.sh)
  pkg-config
  libsentencepiece-dev  # tokenizers (Llama's tokenizer.model format)
  libyaml-cpp-dev       # training recipes
  libpcre2-dev          # tokenizer.json's pre-tokenizer regexes, as written (\p{L}, \p{N}, lookahead)
  libutf8proc-dev       # tokenizer.json's NFC / NFKC normalizers
  fortunes              # the default recipe's corpus (/usr/share/games/fortunes)
  chromium              # headless, for the HTML report's browser test (tests/apps/report_browser_test.sh)
  fonts-dejavu-core     # the report's font, so the browser test's screenshots show text
  doxygen               # the API reference from the headers (scripts/api_docs.sh), checked by the tests
  clang-format          # the house style (.clang-format), checked by the tests (scripts/format.sh --check)
)

missing=()
for p in "${packages[@]}"; do
  dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed" || missing+=("$p")
done
if [ ${#missing[@]} -eq 0 ]; then
  echo "setup: all packages present"
  exit 0
fi
SUDO=""
if [ "$(id -u)" != 0 ]; then SUDO="sudo"; fi
echo "setup: installing ${missing[*]}"
$SUDO apt-get update -qq
DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq --no-install-recommends "${missing[@]}"
