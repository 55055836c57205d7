#!/usr/bin/env bash
# `cmake --install` into a temporary prefix, moved elsewhere after the install (and its package
# files checked for paths into the source or build folder), then an outside project (this folder)
# finds it with find_package(frugal), builds against frugal::frugal and runs: a tiny model's checkpointed loss
# and gradients, and a tokenizer through the installed SentencePiece helpers.
set -u
build="$1"
here=$(cd "$(dirname "$0")" && pwd)
tmp=$(mktemp -d)
trap '[ -n "${KEEP_TMP:-}" ] || rm -rf "$tmp"' EXIT
fail() { echo "FAIL: $*"; [ -f "$tmp/log" ] && tail -30 "$tmp/log"; echo "0 passed, 1 failed"; exit 1; }

cmake --install "$build" --prefix "$tmp/prefix" >"$tmp/log" 2>&1 || fail "cmake --install"
for f in include/frugal/models/decoder.h lib/libfrugal.a lib/frugal/libfrugal_spm.so lib/frugal/frugal-spm-train \
         lib/cmake/frugal/frugalConfig.cmake lib/cmake/frugal/frugalConfigVersion.cmake; do
  [ -e "$tmp/prefix/$f" ] || fail "the install lacks $f"
done
# Relocatable: the package files name nothing inside the source or build folder (a consumer must
# work once both are gone), and the whole prefix still works after it is moved.
src=$(cd "$here/../.." && pwd)
build_abs=$(cd "$build" && pwd)
for dir in "$src" "$build_abs"; do
  if grep -rl --include='*.cmake' -- "$dir" "$tmp/prefix/lib/cmake/frugal" >"$tmp/hits" 2>/dev/null; then
    fail "the installed package names $dir: $(cat "$tmp/hits" | tr '\n' ' ')"
  fi
done
mkdir -p "$tmp/elsewhere" && mv "$tmp/prefix" "$tmp/elsewhere/prefix" || fail "moving the prefix"
prefix="$tmp/elsewhere/prefix"
launcher=()
command -v ccache >/dev/null && launcher=(-DCMAKE_CXX_COMPILER_LAUNCHER=ccache)
# The LibTorch the build used (CMAKE_PREFIX_PATH in its cache, e.g. PyPI's wheel), after the install.
torch_path=$(sed -n 's/^CMAKE_PREFIX_PATH:[A-Z]*=//p' "$build/CMakeCache.txt")
cmake -S "$here" -B "$tmp/consumer" -DCMAKE_PREFIX_PATH="$prefix${torch_path:+;$torch_path}" -DCMAKE_BUILD_TYPE=Release "${launcher[@]}" >"$tmp/log" 2>&1 ||
  fail "configuring a project with find_package(frugal)"
cmake --build "$tmp/consumer" -j2 >"$tmp/log" 2>&1 || fail "building against frugal::frugal"
mkdir -p "$tmp/run"
# Helpers from the install only: neither the build folder's nor the environment's.
# A CUDA build's module, installed beside the helpers and copied next to the program, loads from
# there (FRUGAL_CUDA=on: this machine may have no NVIDIA driver) with LibTorch's CUDA half.
cuda=""
if [ -e "$build/libfrugal_cuda.so" ]; then
  [ -e "$prefix/lib/frugal/libfrugal_cuda.so" ] || fail "the install lacks lib/frugal/libfrugal_cuda.so"
  cuda=on
fi
env -u FRUGAL_SPM_SHIM -u FRUGAL_SPM_TRAIN -u FRUGAL_CUDA_MODULE FRUGAL_CUDA=${cuda:-auto} "$tmp/consumer/consumer" "$tmp/run" \
  >"$tmp/out" 2>"$tmp/log" || fail "running the program"
python3 - "$tmp/out" "$cuda" <<'PY' || fail "the program's numbers: $(cat "$tmp/out")"
import math, re, sys
m = re.fullmatch(r"loss (\S+) grad_diff (\S+) roundtrip '(.*)'\ncuda (.*)\n", open(sys.argv[1]).read())
assert m, "unexpected output"
loss, diff = float(m.group(1)), float(m.group(2))
assert abs(loss - math.log(64)) < 0.5, loss   # an untrained model is near uniform over 64 tokens
assert diff < 1e-6, diff                      # checkpointing leaves the gradients unchanged
assert m.group(3) == "lazy fox", m.group(3)
assert (m.group(4) == "loaded") == (sys.argv[2] == "on"), m.group(4)  # a CPU build: "this build ... has no CUDA"
PY
echo "1 passed, 0 failed"
