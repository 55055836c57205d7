#!/usr/bin/env bash
# Set up, build, and run every test (GoogleTest suite and CLI checks) through CTest, twice: against
# Debian's LibTorch 1.13 (build/) and against LibTorch 2.x from the pinned PyPI torch wheel
# (build-torch2/). Fails if either build or either run fails; both always run.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
t0=$(date +%s)
bash scripts/setup_torch2.sh >/dev/null
echo "test: LibTorch 2.x wheel ready in $(( $(date +%s) - t0 )) s"
status=0
for libtorch in debian wheel; do
  dir=build; [ "$libtorch" = wheel ] && dir=build-torch2
  echo "=== LibTorch from $libtorch: build into $dir/ ==="
  t0=$(date +%s)
  if ! bash scripts/build.sh --libtorch "$libtorch"; then
    echo "=== LibTorch from $libtorch: BUILD FAILED ==="; status=1; continue
  fi
  echo "=== LibTorch from $libtorch: built in $(( $(date +%s) - t0 )) s; tests ==="
  t0=$(date +%s)
  if ! (cd "$dir" && ctest --output-on-failure -j "$(nproc)"); then
    echo "=== LibTorch from $libtorch: TESTS FAILED ==="; status=1
  fi
  echo "=== LibTorch from $libtorch: tests took $(( $(date +%s) - t0 )) s ==="
done
exit $status
