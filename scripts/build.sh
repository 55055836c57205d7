#!/usr/bin/env bash
# Configures and builds frugal (library, CLI, tests). Extra arguments go to cmake.
#   bash scripts/build.sh                   LibTorch 1.13 from Debian's libtorch-dev, into build/
#   bash scripts/build.sh --libtorch wheel  LibTorch 2.x from the pinned PyPI torch wheel
#                                           (scripts/setup_torch2.sh installs it), into build-torch2/
# FRUGAL_LIBTORCH=wheel picks the second one too.
set -euo pipefail
cd "$(dirname "$0")/.."
# Ninja where it is installed (scripts/setup.sh installs it): it starts a target's compiles before
# the libraries it links are linked, so both cores stay busy. A folder configured before keeps its
# generator.
generator() { [[ ! -f $1/CMakeCache.txt ]] && command -v ninja >/dev/null && echo "-GNinja"; true; }
libtorch="${FRUGAL_LIBTORCH:-debian}"
if [ "${1:-}" = "--libtorch" ]; then libtorch="${2:?--libtorch needs debian or wheel}"; shift 2; fi
case "$libtorch" in
  debian)
    cmake -S . -B build $(generator build) -DCMAKE_BUILD_TYPE=Release "$@" >/dev/null
    cmake --build build -j "$(nproc)" ;;
  wheel)
    torch_dir=$(bash scripts/setup_torch2.sh | tail -n 1)
    # The wheel's own folder first: otherwise CMake finds Debian's libtorch.so before the wheel's.
    cmake -S . -B build-torch2 $(generator build-torch2) -DCMAKE_BUILD_TYPE=Release -DCMAKE_PREFIX_PATH="$torch_dir;$torch_dir/share/cmake" "$@" >/dev/null
    cmake --build build-torch2 -j "$(nproc)" ;;
  *) echo "build.sh: --libtorch must be debian or wheel, not '$libtorch'" >&2; exit 2 ;;
esac
