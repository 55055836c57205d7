#!/usr/bin/env bash
# The 7B benchmark: full fine-tunes of the Llama-2-7B-shaped recipes on this CPU, measured. Heavy
# runs (13-15 GiB resident, 2-3 minutes a step on 2 cores, ~15 minutes a recipe, up to 45 GB of
# disk): run it alone on the machine, not beside a build or the tests. It is not part of the test
# suite, which runs the same path at the 7B width with two layers.
#
#   bash scripts/bench_7b.sh              # both recipes, after scripts/build.sh; out/bench-7b*/*.json
#   bash scripts/bench_7b.sh 8bit         # llama2-7b-cpu-8bit only (4bit: llama2-7b-cpu only)
#   bash scripts/bench_7b.sh 8bit-resume  # llama2-7b-cpu-8bit stopped after a step and resumed (72 GB of disk)
#   bash scripts/bench_7b.sh --from-hf    # llama2-7b-cpu started from a Hugging Face folder
#   bash scripts/bench_7b.sh ratio        # the 8-bit recipe's step against 4-bit state in memory
#   bash scripts/bench_7b.sh ratio train.seq_len=2   # KEY=VALUE: overrides for every run
#
# ratio: the issue's "no worse than 1.1x the in-memory 4-bit step". llama2-7b-cpu-8bit (state in a
# file through the window) and llama2-7b-cpu with optimizer.state_placement=device (4-bit state in
# memory, 19.7 GiB resident), 3 steps each, alternating, RATIO_PAIRS pairs (default 2), one after
# the other so a noisy neighbour slows both alike; it prints each run's median step and its parts,
# the ratio of each pair and of the medians, in out/bench-7b-ratio/summary.json. On a CPU without
# bf16 instructions (bf16 products emulated at ~5 GFLOP/s) pass train.seq_len=2: the optimizer
# and the state file cost the same at any sequence length.
#
# llama2-7b-cpu (4-bit state in a file through a window): 1. --dry-run: the estimate, without
# allocating the model. 2. steps 0-1, then stop with a checkpoint (--stop-after 2). 3. --resume:
# steps 2-3 from that checkpoint, to the recipe's 4 steps.
# llama2-7b-cpu-8bit (8-bit state, the seed's headline: under 16 GB): the dry run, then its 3 steps
# in one run (a second checkpoint beside the first and the 13.6 GB state file would not fit a 64 GB
# disk).
# 8bit-resume: llama2-7b-cpu-8bit for 2 steps, stopped with a checkpoint after the first
# (--stop-after 1) and resumed (--resume): the resumed run's peak, its load of the 8-bit state
# included, against the same 14.9 GiB, and its loss against the uninterrupted run's second
# (11.0446 at 256 tokens). Its checkpoint at step 2 is written beside step 1's, so it needs 72 GB free.
#
# --from-hf: `transformers` (the pinned one in .venv-torch2) first writes a Llama-2-7B-shaped
# checkpoint with random weights, bf16, sharded in 2 GB files (out/hf-llama2-7b, kept for the next
# run), as a user's downloaded folder would be; the recipe then fine-tunes it with
# model.init_from (the file defines the model; its sizes equal the recipe's) for 2 steps and
# stops, and the figures include the peak resident memory while loading it (a random folder has
# no tokenizer of its own, so data.train_tokenizer=true trains one on the corpus).
#
# Then it prints the figures of each run: parameters, the process's peak resident memory (VmHWM)
# against the recipe's target, the tracker's peak against the estimate (target: within 10%), what
# the tracker does not see, the step time and its parts (forward, backward with recompute,
# optimizer, of it the wait for the state file), the optimizer's ns a parameter, and the step's
# FLOP/s against this machine's bf16 matmul.
set -euo pipefail
cd "$(dirname "$0")/.."
from_hf=0 resume8=0
which=(4bit 8bit)
case "${1:-}" in
  --from-hf) from_hf=1 which=(4bit) ;;
  4bit | 8bit | ratio) which=("$1") ;;
  8bit-resume) resume8=1 which=(8bit) ;;
  "" | *=*) ;;
  *) echo "usage: bash scripts/bench_7b.sh [4bit | 8bit | 8bit-resume | ratio | --from-hf] [KEY=VALUE...]" >&2; exit 2 ;;
esac
[ $# -gt 0 ] && [[ "$1" != *=* ]] && shift
overrides=("$@")
for o in "${overrides[@]}"; do
  [[ "$o" == *=* ]] || { echo "bench_7b.sh: '$o' is not a KEY=VALUE override" >&2; exit 2; }
done
[ -x build/frugal ] || bash scripts/build.sh
# The 8-bit recipe's state file (13.6 GB) and its checkpoint (27 GB) live in out/ at once: refused
# now rather than when the checkpoint is written, minutes in.
mkdir -p out
free_gb=$(($(df -Pk out | awk 'NR == 2 { print $4 }') / 1000000))
need_gb=45
((resume8)) && need_gb=72
if ((free_gb < need_gb)); then
  echo "bench_7b.sh: out/ has ${free_gb} GB free; the 7B runs need ${need_gb} GB (the 8-bit state file and $( ((resume8)) && echo two checkpoints || echo a checkpoint))" >&2
  exit 2
fi
run_recipe() {  # NAME TARGET_GIB
name=$1 target=$2
out=out/bench-7b${name#llama2-7b-cpu}
recipe=("$name" train.out_dir="$out/run" "${overrides[@]}" --progress lines)
if ((resume8)); then
  out=out/bench-7b-8bit-resume
  recipe=("$name" train.out_dir="$out/run" train.steps=2 "${overrides[@]}" --progress lines)
fi
if ((from_hf)); then
  out=out/bench-7b-from-hf
  hf=out/hf-llama2-7b
  if [ ! -f "$hf/model.safetensors.index.json" ]; then
    bash scripts/setup_torch2.sh >/dev/null && python=.venv-torch2/bin/python
    rm -rf "$hf" && mkdir -p "$hf"
    "$python" - "$hf" <<'PY'
import sys, time, torch, transformers
t0 = time.time()
torch.manual_seed(0)
torch.set_default_dtype(torch.bfloat16)
cfg = transformers.LlamaConfig(vocab_size=32000, hidden_size=4096, intermediate_size=11008, num_hidden_layers=32,
                               num_attention_heads=32, num_key_value_heads=32, max_position_embeddings=4096,
                               rms_norm_eps=1e-5, tie_word_embeddings=False, dtype=torch.bfloat16)
with torch.no_grad():
    model = transformers.LlamaForCausalLM(cfg)
model.save_pretrained(sys.argv[1], max_shard_size="2GB")
print(f"bench_7b: transformers {transformers.__version__} wrote a {sum(p.numel() for p in model.parameters()):,}-parameter"
      f" Llama-2-7B-shaped folder to {sys.argv[1]} in {time.time() - t0:.0f} s")
PY
  fi
  recipe=(llama2-7b-cpu train.out_dir="$out/run" model.init_from="$hf" data.train_tokenizer=true train.steps=2 "${overrides[@]}" --progress lines)
fi
rm -rf "$out" && mkdir -p "$out"
./build/frugal train "${recipe[@]}" --dry-run --json-out "$out/dry-run.json" > "$out/dry-run.log"
names=(first)
if ((from_hf)) || { [ "$name" = llama2-7b-cpu-8bit ] && ((!resume8)); }; then
  ./build/frugal train "${recipe[@]}" --json-out "$out/first.json" 2>&1 | tee "$out/first.log"
else
  ./build/frugal train "${recipe[@]}" --stop-after $((resume8 ? 1 : 2)) --json-out "$out/first.json" 2>&1 | tee "$out/first.log"
  ./build/frugal train "${recipe[@]}" --resume --json-out "$out/resumed.json" 2>&1 | tee "$out/resumed.log"
  names+=(resumed)
fi
python3 - "$out" "$target" "${names[@]}" <<'PY'
import json, sys
out, target = sys.argv[1], float(sys.argv[2])
dry = json.load(open(f"{out}/dry-run.json"))
runs = [json.load(open(f"{out}/{n}.json")) for n in sys.argv[3:]]
gib = lambda b: b / 2**30
est = dry["peak_bytes"]  # the dry run's estimate, as `frugal train --dry-run --json-out` writes it
summary = {"n_params": runs[0]["n_params"], "estimate_peak_bytes": est, "runs": []}
print(f"\n7B benchmark, {runs[0]['recipe']}: {runs[0]['n_params']:,} parameters; dry-run estimate {gib(est):.2f} GiB"
      f" (of it the state file's window {gib(dry['estimate']['state_window_bytes']):.2f} GiB;"
      f" {gib(dry['estimate']['state_in_files_bytes']):.2f} GiB of state in the file)")
for r in runs:
    name = f"steps {r['first_step']}-{r['last_step'] - 1}" + (" (resumed)" if r["first_step"] > 0 else "")
    b = r["step_time_breakdown_s"]
    row = {"steps": [r["first_step"], r["last_step"]], "losses": r["losses"], "peak_rss_bytes": r["peak_rss_bytes"],
           "peak_bytes": r["peak_bytes"], "tracker_vs_estimate": r["peak_bytes"] / est,
           "untracked_bytes": r["peak_rss_bytes"] - r["peak_bytes"], "step_time_s": r["step_time_s"],
           "step_time_breakdown_s": b, "achieved_gflops": r["achieved_gflops"], "matmul_gflops": r["matmul_gflops"],
           "optimizer_ns_per_param": b["optimizer"] * 1e9 / r["n_params"], "state_io_s": b["state_io"]}
    summary["runs"].append(row)
    print(f"{name}: losses {', '.join(f'{l:.4f}' for l in r['losses'])}")
    print(f"  peak resident {gib(r['peak_rss_bytes']):.2f} GiB (target <= {target:g} GiB: {'met' if r['peak_rss_bytes'] <= target * 2**30 else 'MISSED'});"
          f" tracker's peak {gib(r['peak_bytes']):.2f} GiB = {100 * r['peak_bytes'] / est:.1f}% of the estimate"
          f" (target 90-110%: {'met' if abs(r['peak_bytes'] / est - 1) <= 0.10 else 'MISSED'});"
          f" untracked {gib(r['peak_rss_bytes'] - r['peak_bytes']):.2f} GiB")
    if b.get("updates_overlapped"):  # optimizer.update_threads: the updates ran beside backward
        parts = (f" {b['backward_with_recompute']:.1f} (beside it on the update thread: optimizer {b['optimizer']:.1f}, of it waiting"
                 f" for the state file {b['state_io']:.1f}; backward waited {b['update_wait']:.1f} for the updates) s")
    else:
        parts = (f" {b['backward_with_recompute']:.1f} + optimizer {b['optimizer']:.1f} (of it waiting for the state file"
                 f" {b['state_io']:.1f}) s")
    print(f"  step {r['step_time_s']:.1f} s (median) = forward {b['forward']:.1f} + backward with recompute{parts},"
          f" {b['optimizer'] * 1e9 / r['n_params']:.2f} ns a parameter;"
          f" {r['achieved_gflops']:.1f} GFLOP/s = {100 * r['achieved_gflops'] / max(r['matmul_gflops'], 1e-9):.0f}%"
          f" of bf16 matmul ({r['matmul_gflops']:.1f} GFLOP/s)")
json.dump(summary, open(f"{out}/summary.json", "w"), indent=1)
print(f"wrote {out}/summary.json")
PY
}

# The ratio: alternating runs of the two, each its own process, state and checkpoint removed after.
run_ratio() {
  local out=out/bench-7b-ratio pairs=${RATIO_PAIRS:-2}
  rm -rf "$out" && mkdir -p "$out"
  local runs=()
  for ((i = 0; i < pairs; ++i)); do
    for kind in 8bit 4bit-memory; do
      local args=(llama2-7b-cpu-8bit)
      [ "$kind" = 4bit-memory ] && args=(llama2-7b-cpu optimizer.state_placement=device)
      args+=(train.steps=3 train.out_dir="$out/run" "${overrides[@]}" --progress lines --json-out "$out/$kind-$i.json")
      echo "bench_7b: pair $((i + 1))/$pairs, $kind: frugal train ${args[*]}"
      ./build/frugal train "${args[@]}" > "$out/$kind-$i.log" 2>&1 || { tail -5 "$out/$kind-$i.log" >&2; exit 1; }
      rm -rf "$out/run"
      runs+=("$kind-$i")
    done
  done
  python3 - "$out" "${runs[@]}" <<'PY'
import json, statistics, sys
out, names = sys.argv[1], sys.argv[2:]
runs = {n: json.load(open(f"{out}/{n}.json")) for n in names}
pairs = sorted({int(n.rsplit("-", 1)[1]) for n in names})
for n, r in runs.items():
    b = r["step_time_breakdown_s"]
    beside = b.get("updates_overlapped")  # optimizer.update_threads: the updates ran beside backward
    print(f"{n}: step {r['step_time_s']:.1f} s (median of 3) = forward {b['forward']:.1f} + backward with recompute"
          f" {b['backward_with_recompute']:.1f}" + (" (beside it: " if beside else " + ") + f"optimizer {b['optimizer']:.1f}"
          f" (waiting for the state file {b['state_io']:.2f}" + (f"; backward waited {b['update_wait']:.2f}))" if beside else ")") + " s,"
          f" {b['optimizer'] * 1e9 / r['n_params']:.2f} ns a parameter; peak resident {r['peak_rss_bytes'] / 2**30:.2f} GiB")
ratios = [runs[f"8bit-{i}"]["step_time_s"] / runs[f"4bit-memory-{i}"]["step_time_s"] for i in pairs]
eight = statistics.median(runs[f"8bit-{i}"]["step_time_s"] for i in pairs)
four = statistics.median(runs[f"4bit-memory-{i}"]["step_time_s"] for i in pairs)
print(f"8-bit through the state file against 4-bit in memory: {eight / four:.3f}x the medians ({eight:.1f} / {four:.1f} s);"
      f" pair by pair {', '.join(f'{x:.3f}' for x in ratios)} (target <= 1.1x: {'met' if eight / four <= 1.1 else 'MISSED'})")
json.dump({"runs": {n: {"step_time_s": r["step_time_s"], "step_time_breakdown_s": r["step_time_breakdown_s"],
                        "peak_rss_bytes": r["peak_rss_bytes"], "losses": r["losses"]} for n, r in runs.items()},
           "pair_ratios": ratios, "ratio_of_medians": eight / four}, open(f"{out}/summary.json", "w"), indent=1)
print(f"wrote {out}/summary.json")
PY
}

if [ "${which[0]}" = ratio ]; then
  run_ratio
  exit 0
fi
for w in "${which[@]}"; do
  # 14.9 GiB is 16 GB, the seed's headline; the 4-bit recipe keeps well under 18 GiB.
  if [ "$w" = 8bit ]; then run_recipe llama2-7b-cpu-8bit 14.9; else run_recipe llama2-7b-cpu 18; fi
done
