#!/usr/bin/env bash
# The main job: set up, build, then train the default recipe: a ~10M-parameter Llama-style model
# on the fortune-cookie corpus with every memory technique on (about 7 minutes on 2 cores). It
# prints progress, the peak memory per category against the estimate, and a sample at the end;
# checkpoints and metrics go to out/default/. Then the memory account of a Transformer stack.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
bash scripts/build.sh
mkdir -p out
./build/frugal train default "$@"
./build/frugal account --json-out out/account.json
