#!/usr/bin/env bash
# `cmake --install` into a temporary prefix, moved elsewhere after the install (and its package
# files checked for paths into the source or build folder), then an outside project (this folder)
# finds it with find_package(frugal), builds against frugal::frugal and runs: a tiny model's checkpointed loss
# and gradients, and a tokenizer through the installed SentencePiece helpers. Then examples/, built
# and run from the install the same way (the core ones also without pkg-config).
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
project_flags=()
# ccache with the temporary folder as its base: paths inside it are hashed relative to it, so the
# next run (another temporary folder) hits the cache.
command -v ccache >/dev/null && project_flags=(-DCMAKE_CXX_COMPILER_LAUNCHER=ccache) && export CCACHE_BASEDIR="$tmp"
# The LibTorch the build used (CMAKE_PREFIX_PATH in its cache, e.g. PyPI's wheel), after the install.
torch_path=$(sed -n 's/^CMAKE_PREFIX_PATH:[A-Z]*=//p' "$build/CMakeCache.txt")
# The outside projects are compiled unoptimised: what is checked is that they build against the
# package and run (the library is the installed, optimised one). With ccache off, the whole test on
# the 2.15 build: 95 s at -O3, 85 s at -O0.
project_flags+=(-DCMAKE_BUILD_TYPE=Unoptimised -DCMAKE_CXX_FLAGS_UNOPTIMISED=-O0)
cmake -S "$here" -B "$tmp/consumer" -DCMAKE_PREFIX_PATH="$prefix${torch_path:+;$torch_path}" "${project_flags[@]}" >"$tmp/log" 2>&1 ||
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

# The examples (examples/), built as a user builds them from the install: first the two that need
# frugal::core alone, with pkg-config made unfindable (the core asks for LibTorch only), then all
# four; each runs and its figures are checked.
cp -r "$src/examples" "$tmp/examples" || fail "copying examples/"
cmake -S "$tmp/examples" -B "$tmp/examples-core" -DFRUGAL_EXAMPLES_CORE_ONLY=ON -DCMAKE_DISABLE_FIND_PACKAGE_PkgConfig=TRUE \
  -DCMAKE_PREFIX_PATH="$prefix${torch_path:+;$torch_path}" "${project_flags[@]}" >"$tmp/log" 2>&1 ||
  fail "configuring the core examples with find_package(frugal COMPONENTS memory checkpoint optim) and no pkg-config"
cmake --build "$tmp/examples-core" -j2 >"$tmp/log" 2>&1 || fail "building the core examples against frugal::core"
cmake -S "$tmp/examples" -B "$tmp/examples-all" -DCMAKE_PREFIX_PATH="$prefix${torch_path:+;$torch_path}" "${project_flags[@]}" \
  >"$tmp/log" 2>&1 || fail "configuring examples/"
cmake --build "$tmp/examples-all" -j2 >"$tmp/log" 2>&1 || fail "building examples/"
run_example() {  # name args...: runs it in $tmp/run with the install's helpers only
  local name=$1; shift
  (cd "$tmp/run" && env -u FRUGAL_SPM_SHIM -u FRUGAL_SPM_TRAIN -u FRUGAL_CUDA_MODULE "$tmp/examples-all/$name" "$@") \
    >"$tmp/$name.out" 2>"$tmp/log" || fail "examples/$name exited non-zero: $(cat "$tmp/$name.out")"
  cat "$tmp/$name.out"
}
run_example own_model
run_example plan_budget
run_example data_parallel --nproc 2
"$tmp/examples-core/own_model" >"$tmp/own_model_core.out" 2>"$tmp/log" || fail "the core build of examples/own_model"
python3 - "$tmp" <<'PY' || fail "the examples' figures"
import re, sys
d = sys.argv[1]
own = open(d + "/own_model.out").read()
m = re.search(r"peak (\S+)x of plain; last loss (\S+) \(plain\) (\S+) \(frugal\)", own)
assert m, own
ratio, plain, cut = map(float, m.groups())
assert ratio < 0.6, f"checkpointing + int8 in backward kept {ratio} of the plain peak"
assert abs(plain - cut) < 0.05 * plain, (plain, cut)   # 8-bit state trains as fp32 does over six steps
for line in own.splitlines()[:2]:
    assert re.search(r"parameter \d", line) and "gradient" in line and "activation" in line, line
assert "within the budget" in open(d + "/plan_budget.out").read()
assert "identical parameters" in open(d + "/data_parallel.out").read()
PY
# (3) needs a Hugging Face folder: transformers writes one where the torch 2.x environment has it.
py="$src/.venv-torch2/bin/python"
if [ -x "$py" ] && "$py" -c "import transformers" 2>/dev/null; then
  "$py" "$src/scripts/make_hf_example.py" "$tmp/hf" >"$tmp/log" 2>&1 || fail "making a Hugging Face folder"
  run_example finetune_hf "$tmp/hf" /usr/share/games/fortunes/fortunes "$tmp/hf-tuned" 12
  [ -f "$tmp/hf-tuned/model.safetensors" ] && [ -f "$tmp/hf-tuned/config.json" ] || fail "finetune_hf wrote no model folder"
  "$py" -c "import sys, transformers; transformers.AutoModelForCausalLM.from_pretrained(sys.argv[1]); transformers.AutoTokenizer.from_pretrained(sys.argv[1])" \
    "$tmp/hf-tuned" >"$tmp/log" 2>&1 || fail "transformers cannot load what finetune_hf wrote"
else
  echo "examples/finetune_hf built; not run (no torch 2.x environment with transformers)"
fi
echo "1 passed, 0 failed"
