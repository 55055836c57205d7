#!/usr/bin/env bash
# The main job: set up, build, then `frugal account` with its defaults (table on the terminal,
# JSON in out/account.json).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
bash scripts/build.sh
mkdir -p out
./build/frugal account --json-out out/account.json
