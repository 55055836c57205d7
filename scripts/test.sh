#!/usr/bin/env bash
# Set up, build, and run every test (GoogleTest suite and CLI checks) through CTest, twice: against
# Debian's LibTorch 1.13 (build/) and against LibTorch 2.x from the pinned PyPI torch wheel
# (build-torch2/). Fails if either build or either run fails; both always run. Ends with the time
# each phase took.
#   bash scripts/test.sh                    everything (CI: .ci/run)
#   bash scripts/test.sh --quick            the edit-build-test loop: no set-up, build/ only, the
#                                           tests labelled quick (ctest -L quick; a few minutes)
#   bash scripts/test.sh --libtorch wheel   one build only (debian or wheel); combines with --quick
set -euo pipefail
cd "$(dirname "$0")/.."
quick=0 builds=""
while (($#)); do
  case "$1" in
    --quick) quick=1 ;;
    --libtorch) builds=${2:?--libtorch needs debian or wheel}; shift ;;
    *) echo "test.sh: unknown argument '$1' (allowed: --quick, --libtorch debian|wheel)" >&2; exit 2 ;;
  esac
  shift
done
[[ -n $builds ]] || { builds="debian wheel"; ((quick)) && builds=debian; }
for b in $builds; do
  [[ $b == debian || $b == wheel ]] || { echo "test.sh: --libtorch must be debian or wheel, not '$b'" >&2; exit 2; }
done
phases=()
phase() {  # phase NAME START: records how long NAME took since START (seconds since the epoch)
  phases+=("$(printf '%-34s %5d s' "$1" $(( $(date +%s) - $2 )))")
}
t_all=$(date +%s)
if ((!quick)); then
  t0=$(date +%s)
  bash scripts/setup.sh
  phase "set-up (Debian packages)" "$t0"
fi
if [[ " $builds " == *" wheel "* ]]; then
  t0=$(date +%s)
  bash scripts/setup_torch2.sh >/dev/null
  phase "set-up (LibTorch 2.x wheel)" "$t0"
fi
status=0
labels=()
((quick)) && labels=(-L quick)
for libtorch in $builds; do
  dir=build; [ "$libtorch" = wheel ] && dir=build-torch2
  echo "=== LibTorch from $libtorch: build into $dir/ ==="
  t0=$(date +%s)
  if ! bash scripts/build.sh --libtorch "$libtorch"; then
    echo "=== LibTorch from $libtorch: BUILD FAILED ==="; status=1; phase "build $dir/ (FAILED)" "$t0"; continue
  fi
  phase "build $dir/" "$t0"
  echo "=== LibTorch from $libtorch: built in $(( $(date +%s) - t0 )) s; tests ==="
  t0=$(date +%s)
  if ! (cd "$dir" && ctest --output-on-failure -j "$(nproc)" "${labels[@]}"); then
    echo "=== LibTorch from $libtorch: TESTS FAILED ==="; status=1
  fi
  phase "tests in $dir/${labels[*]:+ (${labels[*]})}" "$t0"
  echo "=== LibTorch from $libtorch: tests took $(( $(date +%s) - t0 )) s ==="
done
phase "all" "$t_all"
echo "=== time per phase ==="
printf '%s\n' "${phases[@]}"
exit $status
