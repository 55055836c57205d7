#!/usr/bin/env bash
# The main job: set up, build, then train the default recipe: a ~10M-parameter Llama-style model
# on the fortune-cookie corpus with every memory technique on (about 7 minutes on 2 cores). It
# prints progress, the peak memory per category against the estimate, and a sample at the end;
# checkpoints and metrics go to out/default/. Then the memory account of a Transformer stack.
set -euo pipefail
cd "$(dirname "$0")/.."
# Debian's LibTorch 1.13 by default (the quicker install); FRUGAL_LIBTORCH=wheel uses LibTorch 2.x from
# the pinned PyPI torch wheel instead (scripts/setup_torch2.sh, about 5 GB), built into build-torch2/.
bash scripts/setup.sh
bash scripts/build.sh
dir=build; [ "${FRUGAL_LIBTORCH:-debian}" = wheel ] && dir=build-torch2
mkdir -p out
"./$dir/frugal" train default "$@"
"./$dir/frugal" account --json-out out/account.json
