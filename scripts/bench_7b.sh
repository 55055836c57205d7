#!/usr/bin/env bash
# The 7B benchmark: a full fine-tune of the Llama-2-7B-shaped recipe `llama2-7b-cpu` on this CPU,
# measured. A heavy run (about 20 GiB resident, 2-3 minutes a step on 2 cores, ~15 minutes in all):
# run it alone on the machine, not beside a build or the tests. It is not part of the test suite,
# which runs the same path at the 7B width with two layers.
#
#   bash scripts/bench_7b.sh              # after scripts/build.sh; writes out/bench-7b/*.json
#   bash scripts/bench_7b.sh --from-hf    # the same fine-tune started from a Hugging Face folder
#
# --from-hf: `transformers` (the pinned one in .venv-torch2) first writes a Llama-2-7B-shaped
# checkpoint with random weights, bf16, sharded in 2 GB files (out/hf-llama2-7b, kept for the next
# run), as a user's downloaded folder would be; the recipe then fine-tunes it with
# model.init_from (the file defines the model; its sizes equal the recipe's) for 2 steps and
# stops, and the figures include the peak resident memory while loading it (a random folder has
# no tokenizer of its own, so data.train_tokenizer=true trains one on the corpus).
#
# 1. --dry-run: the estimate, without allocating the model.
# 2. steps 0-1, then stop with a checkpoint (--stop-after 2).
# 3. --resume: steps 2-3 from that checkpoint, to the recipe's 4 steps.
# Then it prints the figures: parameters, the process's peak resident memory (VmHWM) against the
# 20 GiB target, the tracker's peak against the estimate (target: within 10%), what the tracker
# does not see, the step time and its parts, and the step's FLOP/s against this machine's bf16 matmul.
set -euo pipefail
cd "$(dirname "$0")/.."
from_hf=0
[ "${1:-}" = --from-hf ] && from_hf=1
[ -x build/frugal ] || bash scripts/build.sh
out=out/bench-7b
recipe=(llama2-7b-cpu train.out_dir="$out/run" --progress lines)
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
  recipe=(llama2-7b-cpu train.out_dir="$out/run" model.init_from="$hf" data.train_tokenizer=true train.steps=2 --progress lines)
fi
rm -rf "$out" && mkdir -p "$out"
./build/frugal train "${recipe[@]}" --dry-run --json-out "$out/dry-run.json" > "$out/dry-run.log"
names=(first)
if ((from_hf)); then
  ./build/frugal train "${recipe[@]}" --json-out "$out/first.json" 2>&1 | tee "$out/first.log"
else
  ./build/frugal train "${recipe[@]}" --stop-after 2 --json-out "$out/first.json" 2>&1 | tee "$out/first.log"
  ./build/frugal train "${recipe[@]}" --resume --json-out "$out/resumed.json" 2>&1 | tee "$out/resumed.log"
  names+=(resumed)
fi
python3 - "$out" "${names[@]}" <<'PY'
import json, sys
out = sys.argv[1]
dry = json.load(open(f"{out}/dry-run.json"))
runs = [json.load(open(f"{out}/{n}.json")) for n in sys.argv[2:]]
gib = lambda b: b / 2**30
est = dry["peak_bytes"]  # the dry run's estimate, as `frugal train --dry-run --json-out` writes it
summary = {"n_params": runs[0]["n_params"], "estimate_peak_bytes": est, "runs": []}
print(f"\n7B benchmark: {runs[0]['n_params']:,} parameters; dry-run estimate {gib(est):.2f} GiB")
for name, r in zip(("steps 0-1", "steps 2-3 (resumed)"), runs):
    b = r["step_time_breakdown_s"]
    row = {"steps": [r["first_step"], r["last_step"]], "losses": r["losses"], "peak_rss_bytes": r["peak_rss_bytes"],
           "peak_bytes": r["peak_bytes"], "tracker_vs_estimate": r["peak_bytes"] / est,
           "untracked_bytes": r["peak_rss_bytes"] - r["peak_bytes"], "step_time_s": r["step_time_s"],
           "step_time_breakdown_s": b, "achieved_gflops": r["achieved_gflops"], "matmul_gflops": r["matmul_gflops"]}
    summary["runs"].append(row)
    print(f"{name}: losses {', '.join(f'{l:.4f}' for l in r['losses'])}")
    print(f"  peak resident {gib(r['peak_rss_bytes']):.2f} GiB (target <= 20 GiB: {'met' if r['peak_rss_bytes'] <= 20 * 2**30 else 'MISSED'});"
          f" tracker's peak {gib(r['peak_bytes']):.2f} GiB = {100 * r['peak_bytes'] / est:.1f}% of the estimate"
          f" (target 90-110%: {'met' if abs(r['peak_bytes'] / est - 1) <= 0.10 else 'MISSED'});"
          f" untracked {gib(r['peak_rss_bytes'] - r['peak_bytes']):.2f} GiB")
    print(f"  step {r['step_time_s']:.1f} s (median) = forward {b['forward']:.1f} + backward with recompute"
          f" {b['backward_with_recompute']:.1f} + optimizer {b['optimizer']:.1f} (moving state {b['state_io']:.1f}) s;"
          f" {r['achieved_gflops']:.1f} GFLOP/s = {100 * r['achieved_gflops'] / max(r['matmul_gflops'], 1e-9):.0f}%"
          f" of bf16 matmul ({r['matmul_gflops']:.1f} GFLOP/s)")
json.dump(summary, open(f"{out}/summary.json", "w"), indent=1)
print(f"wrote {out}/summary.json")
PY
