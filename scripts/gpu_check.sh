#!/usr/bin/env bash
# The GPU check: on a machine with an NVIDIA GPU and PyTorch 2.x (`python3 -c 'import torch'`), build
# frugal against that PyTorch's LibTorch, run the CUDA tests, then the GPU benchmark, in under 10
# minutes on one H200 with 16 cores.
#
#   bash scripts/gpu_check.sh                 # writes out/gpu-check/summary.json and prints a table
#   bash scripts/gpu_check.sh --no-build      # reuse build-gpu/ as it is
#   bash scripts/gpu_check.sh --build-dir D   # build (or reuse) D instead of build-gpu/
#   bash scripts/gpu_check.sh --rehearse      # without a GPU: every step anyway, to check the script
#                                             # (the CUDA tests skip, the GPU run is refused; exit 1)
#
# 1. Needs: python3 with torch (CUDA build) and a GPU it sees, cmake, a C++ compiler, nvcc (the CUDA
#    toolkit LibTorch's CMake files enable), pkg-config, SentencePiece, yaml-cpp and GoogleTest
#    development files. Missing packages are installed with apt-get when run as root; otherwise the
#    script stops with one line naming them.
# 2. Builds with CMAKE_PREFIX_PATH from torch.utils.cmake_prefix_path and the GPU's architecture, -j nproc.
# 3. The CUDA tests: frugal_tests --gtest_filter='Cuda*' (the AdamW kernel against the CPU kernel,
#    host- and file-placed state against state on the GPU, the tracker on the caching allocator,
#    CUDA RNG restore in checkpointed dropout, the allocator's peak counters).
# 4. The `llama2-7b` recipe on cuda (its own techniques: bf16, optimizer in backward, full
#    checkpointing, chunked loss, AdamW state in bf16 in host memory) for a few steps
#    (--stop-after, $FRUGAL_GPU_STEPS, default 3): the caching allocator's peak allocated and
#    reserved bytes against torchtune's published 13.99 GB / 15.97 GB for its Llama-2-7B full
#    fine-tune on one device, and the tracker's peak against frugal's own estimate.
set -euo pipefail
cd "$(dirname "$0")/.."
build=build-gpu
do_build=1
rehearse=0
while [ $# -gt 0 ]; do
  case "$1" in
    --no-build) do_build=0 ;;
    --rehearse) rehearse=1 ;;
    --build-dir) build="$2"; shift ;;
    *) echo "gpu_check.sh: unknown argument '$1' (allowed: --no-build, --build-dir DIR, --rehearse)" >&2; exit 2 ;;
  esac
  shift
done
out=out/gpu-check
mkdir -p "$out"
steps="${FRUGAL_GPU_STEPS:-3}"
t_start=$(date +%s)
stage() { echo "== [$(( $(date +%s) - t_start )) s] $*"; }
fail() { echo "gpu_check.sh: $*" >&2; exit 1; }

# --- 1. what it needs -------------------------------------------------------------------------
stage "checking the machine"
command -v python3 >/dev/null || fail "python3 is missing (it needs python3 with PyTorch 2.x, CUDA build)"
torch_info=$(python3 -c 'import torch, sys; print(torch.__version__, torch.version.cuda or "", torch.cuda.is_available(), torch.utils.cmake_prefix_path)' 2>/dev/null) ||
  fail "python3 -c 'import torch' fails: install PyTorch 2.x (a CUDA build) for this python3"
read -r torch_version torch_cuda gpu_seen torch_prefix <<<"$torch_info"
[ -n "$torch_cuda" ] || fail "PyTorch $torch_version is a CPU-only build; the check needs a CUDA build"
if [ "$gpu_seen" = True ]; then
  arch=$(python3 -c 'import torch; m, n = torch.cuda.get_device_capability(0); print(f"{m}{n}")')
  gpu_name=$(python3 -c 'import torch; print(torch.cuda.get_device_name(0))')
elif [ "$rehearse" = 1 ]; then
  arch=90 gpu_name="no GPU (rehearsal)"
else
  fail "PyTorch $torch_version (CUDA $torch_cuda) sees no GPU (torch.cuda.is_available() is False)"
fi
echo "PyTorch $torch_version (CUDA $torch_cuda) on $gpu_name (sm_$arch); LibTorch's CMake files in $torch_prefix"
if [ "$do_build" = 1 ]; then
  nvcc_bin=$(command -v nvcc || true)
  [ -n "$nvcc_bin" ] || { [ -x /usr/local/cuda/bin/nvcc ] && nvcc_bin=/usr/local/cuda/bin/nvcc; } || true
  missing=()
  command -v cmake >/dev/null || missing+=(cmake)
  command -v c++ >/dev/null || missing+=(g++)
  command -v pkg-config >/dev/null || missing+=(pkg-config)
  pkg-config --exists sentencepiece 2>/dev/null || missing+=(libsentencepiece-dev)
  pkg-config --exists yaml-cpp 2>/dev/null || missing+=(libyaml-cpp-dev)
  [ -f /usr/include/gtest/gtest.h ] || [ -f /usr/local/include/gtest/gtest.h ] || missing+=(libgtest-dev)
  if [ ${#missing[@]} -gt 0 ]; then
    if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null; then
      echo "installing ${missing[*]} with apt-get"
      { apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq "${missing[@]}"; } >"$out/apt.log" 2>&1 ||
        fail "apt-get could not install ${missing[*]} (see $out/apt.log); install them and run again"
    else
      fail "missing ${missing[*]}: install them (apt-get install ${missing[*]}) or run this as root, then run again"
    fi
  fi
  [ -n "$nvcc_bin" ] || fail "nvcc is missing: LibTorch's CMake files need the CUDA toolkit (CUDA $torch_cuda or close) to build CUDA code"
  export PATH="$(dirname "$nvcc_bin"):$PATH"

  # --- 2. build ---------------------------------------------------------------------------------
  stage "building frugal against PyTorch $torch_version into $build (-j $(nproc), sm_$arch)"
  cmake -S . -B "$build" -DCMAKE_BUILD_TYPE=Release -DCMAKE_PREFIX_PATH="$(dirname "$(dirname "$torch_prefix")");$torch_prefix" \
    -DCMAKE_CUDA_COMPILER="$nvcc_bin" -DCMAKE_CUDA_ARCHITECTURES="$arch" >"$out/configure.log" 2>&1 ||
    fail "configuring failed (the last lines of $out/configure.log: $(tail -3 "$out/configure.log" | tr '\n' ' '))"
  grep -q "CUDA build of LibTorch" "$out/configure.log" || fail "CMake did not find a CUDA build of LibTorch in $torch_prefix (see $out/configure.log)"
  cmake --build "$build" -j "$(nproc)" >"$out/build.log" 2>&1 ||
    fail "building failed (see $out/build.log: $(grep -m1 -E 'error|Error' "$out/build.log" || tail -1 "$out/build.log"))"
fi
[ -x "$build/frugal" ] && [ -x "$build/frugal_tests" ] || fail "$build has no frugal and frugal_tests (build it, or drop --no-build)"

# --- 3. the CUDA tests ----------------------------------------------------------------------------
stage "CUDA tests"
tests_rc=0
"$build/frugal_tests" --gtest_filter='Cuda*' --gtest_output="json:$out/cuda_tests.json" 2>&1 | tee "$out/cuda_tests.log" || tests_rc=$?
# a skip on a GPU machine is a failure here (a test found no GPU, or frugal was built without CUDA)
if [ "$tests_rc" = 0 ] && grep -q "\[  SKIPPED \]" "$out/cuda_tests.log"; then tests_rc=3; fi

# --- 4. the GPU benchmark -----------------------------------------------------------------------
stage "llama2-7b on cuda, $steps steps"
corpus=/usr/share/games/fortunes
if [ ! -e "$corpus" ]; then  # no fortunes here: text any python3 machine has (its standard library's sources)
  corpus="$out/corpus.txt"
  python3 - "$corpus" <<'PY'
import pathlib, sys, sysconfig
out, total = open(sys.argv[1], "w", encoding="utf-8"), 0
for p in sorted(pathlib.Path(sysconfig.get_paths()["stdlib"]).rglob("*.py")):
    if total > 4 << 20: break  # about the size of the fortunes corpus
    try: text = p.read_text(encoding="utf-8")
    except (UnicodeDecodeError, OSError): continue
    out.write(text + "\n"); total += len(text)
PY
  echo "corpus: $corpus ($(du -h "$corpus" | cut -f1), from python3's standard library, as this machine has no /usr/share/games/fortunes)"
fi
run_dir="$out/run"
rm -rf "$run_dir"
free_gib=$(df -Pk "$out" | awk 'NR==2 {print int($4 / 1048576)}')
[ "$free_gib" -ge 45 ] || [ "$rehearse" = 1 ] || fail "only $free_gib GiB free under $out: the run's checkpoint (weights and bf16 state of 7B parameters) needs about 40 GiB"
recipe=(llama2-7b train.out_dir="$run_dir" data.corpus="$corpus" train.eval_batches=1 train.sample_tokens=0 --progress lines)
"$build/frugal" train "${recipe[@]}" --dry-run --json-out "$out/dry-run.json" >"$out/dry-run.log" 2>&1 ||
  fail "the dry run refused the recipe: $(tail -1 "$out/dry-run.log")"
bench_rc=0
"$build/frugal" train "${recipe[@]}" --stop-after "$steps" --json-out "$out/llama2-7b.json" 2>&1 | tee "$out/llama2-7b.log" || bench_rc=$?
rm -rf "$run_dir"/step-* "$run_dir"/.step-*  # tens of GiB of checkpoint

# --- the summary ----------------------------------------------------------------------------------
stage "summary"
python3 - "$out" "$tests_rc" "$bench_rc" "$gpu_name" "$torch_version" "$(( $(date +%s) - t_start ))" <<'PY'
import json, os, sys
out, tests_rc, bench_rc, gpu, torch_version, seconds = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), sys.argv[4], sys.argv[5], int(sys.argv[6])
# torchtune's Llama-2-7B full fine-tune on one device, as published: 13.99 GB peak allocated,
# 15.97 GB peak reserved (torchtune divides bytes by 1024^3 for these).
published = {"allocated": 13.99 * 2**30, "reserved": 15.97 * 2**30}
tests = {"rc": tests_rc}
try:
    t = json.load(open(f"{out}/cuda_tests.json"))
    tests.update(tests=t["tests"], failures=t["failures"], disabled=t.get("disabled", 0))
except (OSError, ValueError, KeyError):
    pass
s = {"gpu": gpu, "torch": torch_version, "seconds": seconds, "cuda_tests": tests, "benchmark_rc": bench_rc, "published_torchtune_bytes": published}
try:
    r = json.load(open(f"{out}/llama2-7b.json"))
    s["llama2_7b"] = {k: r.get(k) for k in ("n_params", "first_step", "last_step", "losses", "step_time_s", "tokens_per_s",
                                             "peak_bytes", "cuda_peak_allocated_bytes", "cuda_peak_reserved_bytes")}
    s["llama2_7b"]["estimate_peak_bytes"] = r["estimate"]["peak_bytes"]
except (OSError, ValueError, KeyError):
    r = None
json.dump(s, open(f"{out}/summary.json", "w"), indent=1)
gib = lambda b: f"{b / 2**30:.2f} GiB" if b is not None else "n/a"
print(f"\nGPU check on {gpu}, PyTorch {torch_version}, {seconds} s")
print(f"CUDA tests: " + ("passed" if tests_rc == 0 else f"FAILED (rc {tests_rc}; a skip counts as a failure here)") +
      (f", {tests['tests']} tests" if "tests" in tests else ""))
if r is None:
    print(f"llama2-7b: no result (rc {bench_rc}; see {out}/llama2-7b.log)")
else:
    rows = [("peak allocated (caching allocator)", r.get("cuda_peak_allocated_bytes"), published["allocated"]),
            ("peak reserved (caching allocator)", r.get("cuda_peak_reserved_bytes"), published["reserved"])]
    print(f"llama2-7b, {r['n_params']:,} parameters, steps {r['first_step']}-{r['last_step'] - 1}, "
          f"step {r['step_time_s']:.1f} s (median), losses {', '.join(f'{l:.3f}' for l in r['losses'])}")
    print(f"  {'':36} {'frugal':>12} {'torchtune':>12} {'ratio':>7}")
    for name, got, ref in rows:
        print(f"  {name:36} {gib(got):>12} {gib(ref):>12} {got / ref if got else float('nan'):>7.3f}")
    print(f"  {'tracker peak / frugal estimate':36} {gib(r['peak_bytes']):>12} {gib(r['estimate']['peak_bytes']):>12} "
          f"{r['peak_bytes'] / max(r['estimate']['peak_bytes'], 1):>7.3f}")
print(f"wrote {out}/summary.json")
sys.exit(0 if tests_rc == 0 and bench_rc == 0 and r is not None else 1)
PY
