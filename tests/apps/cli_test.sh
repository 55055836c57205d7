#!/usr/bin/env bash
# The CLI's contract: help texts, exit code 2 with one clear line for user mistakes, and a small
# `frugal account` run whose JSON has exactly the documented keys.
set -u
# Each `frugal` below is forked from one server that loaded LibTorch once (tests/support/frugal_server.sh),
# with $tmp and a TMPDIR of this run's own (this test may run twice at once, in CI and beside it).
source "$(dirname "$0")/../support/frugal_server.sh"
start_frugal_test "$1" || exit 1
failed=0
pass=0

expect() {  # expect CODE PATTERN -- ARGS...
  local code=$1 pattern=$2
  shift 3
  "$frugal" "$@" >"$tmp/out" 2>"$tmp/err"
  local got=$?
  local lines
  lines=$(grep -c . "$tmp/err")
  if [ "$got" != "$code" ]; then
    echo "FAIL: frugal $* exited $got, expected $code"; cat "$tmp/err"; failed=$((failed + 1)); return
  fi
  if [ -n "$pattern" ] && ! grep -q -- "$pattern" "$tmp/out" "$tmp/err"; then
    echo "FAIL: frugal $* did not print '$pattern'"; cat "$tmp/out" "$tmp/err"; failed=$((failed + 1)); return
  fi
  if [ "$code" = 2 ] && [ "$lines" != 1 ]; then
    echo "FAIL: frugal $* printed $lines lines on stderr, expected one"; cat "$tmp/err"; failed=$((failed + 1)); return
  fi
  pass=$((pass + 1))
}

expect 0 "usage: frugal COMMAND" -- --help
expect 0 "--skip-timing" -- account --help
expect 0 "checkpoint" -- bench --help
expect 2 "unknown command 'frobnicate'" -- frobnicate
expect 2 "unknown flag --bogus" -- account --bogus
expect 2 "--layers must be an integer from 1 to 4096, not '0'" -- account --layers 0
expect 2 "--batch must be an integer from 1 to 16777216, not '-3'" -- account --batch -3
expect 2 "--width must be divisible by heads" -- account --width 130 --heads 4
expect 2 "--heads must be an integer from 1 to 2147483647, not 'four'" -- account --heads four
expect 2 "--seq needs a value" -- account --seq
expect 2 "unknown benchmark 'nope'" -- bench nope
expect 2 "--policy: unknown checkpointing policy 'most'" -- bench optim-in-backward --policy most
expect 2 "--device must be cpu, cuda or cuda:N, got 'tpu'" -- account --device tpu
expect 2 "unexpected argument 'extra'" -- account extra
expect 2 "device cuda:0 is not available" -- account --device cuda:0

# Nothing after the command: one line on stderr, exit 2; --help and --version exit 0.
expect 2 "a command is needed" --
expect 2 "tokenizer needs an action" -- tokenizer
expect 2 "bench needs a benchmark name" -- bench
expect 0 "usage: frugal tokenizer" -- tokenizer --help
if "$frugal" >"$tmp/out" 2>/dev/null; [ ! -s "$tmp/out" ]; then pass=$((pass + 1)); else echo "FAIL: bare frugal printed on stdout"; failed=$((failed + 1)); fi
expect 0 "LibTorch 1\.\|LibTorch 2\." -- --version
expect 0 "frugal [0-9]*\.[0-9]*\.[0-9]* (" -- --version

# CUDA is loaded only where it can run (memory/cuda_runtime.h): FRUGAL_CUDA is checked, and on a
# machine without an NVIDIA driver a CUDA build's CLI runs without LibTorch's CUDA half (ld.so's
# LD_DEBUG=files lists what each process loads: the program itself, not the test server's stand-in),
# loading it only when FRUGAL_CUDA=on asks.
FRUGAL_CUDA=maybe expect 2 "FRUGAL_CUDA=maybe: expected auto, on or off" -- train --help
FRUGAL_CUDA=off expect 2 "device cuda:0 is not available" -- account --device cuda:0
if [ -e "$(dirname "$frugal_exe")/libfrugal_cuda.so" ]; then
  if ! /sbin/ldconfig -p | grep -q "libcuda\.so\.1"; then
    loaded() { LD_DEBUG=files "$@" 2>&1 >/dev/null | grep -c "file=.*$LIB.*\[0\];  needed by\|file=.*$LIB.*\[0\];  dynamically loaded by"; }
    for lib in libtorch_cuda.so libfrugal_cuda.so; do
      n=$(LIB=$lib loaded "$frugal_exe" train --help)
      if [ "$n" = 0 ]; then pass=$((pass + 1)); else echo "FAIL: without an NVIDIA driver, frugal loaded $lib"; failed=$((failed + 1)); fi
      n=$(FRUGAL_CUDA=on LIB=$lib loaded "$frugal_exe" train --help)
      if [ "$n" != 0 ]; then pass=$((pass + 1)); else echo "FAIL: FRUGAL_CUDA=on did not load $lib"; failed=$((failed + 1)); fi
    done
    FRUGAL_CUDA=on expect 2 "device cuda:0 is not available" -- account --device cuda:0
  fi
else
  FRUGAL_CUDA=on expect 2 "FRUGAL_CUDA=on: this build of frugal has no CUDA" -- train --help
fi

# Output paths are checked before any work: a folder, a trailing '/', a parent that is a file.
mkdir -p "$tmp/adir" && touch "$tmp/afile"
expect 2 "--json-out $tmp/adir is a folder" -- account --json-out "$tmp/adir"
expect 2 "--trace-out $tmp/adir/ is a folder" -- account --trace-out "$tmp/adir/"
expect 2 "$tmp/afile is not a folder" -- account --json-out "$tmp/afile/x.json"
expect 2 "--json-out $tmp/adir is a folder" -- train tiny --json-out "$tmp/adir"
expect 2 "--trace-out $tmp/adir is a folder" -- train tiny --trace-out "$tmp/adir"
expect 2 "--json-out $tmp/adir is a folder" -- bench checkpoint --json-out "$tmp/adir"
expect 2 "--json-out $tmp/adir is a folder" -- bench optim-state --json-out "$tmp/adir"
expect 2 "--out $tmp/adir/ is a folder" -- tokenizer train /usr/share/games/fortunes --out "$tmp/adir/"
expect 2 "--out $tmp/adir is a folder" -- report "$tmp/nothing.json" -o "$tmp/adir"
# ... and a parent that does not exist yet is made.
expect 0 "wrote $tmp/new/sub/a.json" -- account --layers 1 --width 32 --heads 2 --batch 1 --seq 4 --skip-timing --json-out "$tmp/new/sub/a.json"
# account writes JSON only when asked.
(cd "$tmp/adir" && "$frugal" account --layers 1 --width 32 --heads 2 --batch 1 --seq 4 --skip-timing >/dev/null 2>&1)
if [ -z "$(ls "$tmp/adir")" ]; then pass=$((pass + 1)); else echo "FAIL: account wrote $(ls "$tmp/adir") unasked"; failed=$((failed + 1)); fi

# Bad recipe values and missing inputs, refused before any work with the culprit named.
printf 'a: &x\n  b: *x\n' > "$tmp/loop.yaml"
expect 2 "loop.yaml: an alias refers to the node that contains it" -- train "$tmp/loop.yaml"
python3 -c 'import sys
s = "l0: &l0 [x, x, x, x, x, x, x, x, x]\n"
for i in range(1, 9): s += "l%d: &l%d [%s]\n" % (i, i, ", ".join(["*l%d" % (i - 1)] * 9))
open(sys.argv[1], "w").write(s)' "$tmp/laughs.yaml"
expect 2 "laughs.yaml: expands to more than" -- train "$tmp/laughs.yaml"
expect 2 "model.vocab_size must be an integer from 0 to 2147483647" -- train tiny --dry-run model.vocab_size=9223372036854775807
expect 2 "model.vocab_size=2147483647, model.dim=4194304: too large" -- train tiny --dry-run model.vocab_size=2147483647 model.dim=4194304 model.n_heads=2 model.n_kv_heads=1
expect 2 "train.seq_len=16777216: too large" -- train tiny --dry-run model.max_seq_len=16777216 train.seq_len=16777216
# A budget no plan meets: the dry run refuses it as the run would, rather than estimate a fallback plan.
# Low-bit state that small tensors do not take is counted in the dry run (and the run's summary).
expect 0 "optimizer state: [0-9]* tensors ([0-9]* parameters) keep fp32 state instead of int8: under 4096 elements" -- train tiny --dry-run model.vocab_size=512 optimizer.state_precision=int8
expect 2 "memory.activation_budget 1 cannot be met: the smallest achievable activation peak is" -- train tiny --dry-run model.vocab_size=512 memory.activation_budget=1
expect 2 "train.steps=3 (from the command line)" -- train tiny train.steps=3
expect 2 "data.val_fraction=0 (from the command line): it must be above 0" -- train tiny data.val_fraction=0
expect 2 "train.out_dir must be set" -- train tiny train.out_dir=
expect 2 "--memory-limit must be a byte count from 1 to" -- train tiny --memory-limit 0
expect 2 "train.device must be cpu, cuda or cuda:N, got 'cuda:abc'" -- train tiny train.device=cuda:abc
if ! python3 -c 'import torch, sys; sys.exit(0 if torch.cuda.is_available() else 1)' 2>/dev/null; then
  expect 2 "train.device cuda is not available" -- train tiny train.device=cuda
  expect 0 "estimated peak" -- train tiny --dry-run train.device=cuda model.vocab_size=512
fi
expect 2 "data.corpus /nonexistent does not exist" -- train tiny data.corpus=/nonexistent train.out_dir="$tmp/nocorpus"
expect 2 "model.init_from /nonexistent is not a folder" -- train tiny model.init_from=/nonexistent
# The init_from folder's config.json defines the model: its sources shown, a contradiction or a
# field frugal cannot honour named.
mkdir -p "$tmp/hf"
cat > "$tmp/hf/config.json" <<'JSON'
{"model_type": "llama", "vocab_size": 512, "hidden_size": 64, "intermediate_size": 176, "num_hidden_layers": 2,
 "num_attention_heads": 4, "num_key_value_heads": 2, "max_position_embeddings": 64, "rms_norm_eps": 1e-05,
 "tie_word_embeddings": true, "head_dim": 8, "bos_token_id": 1}
JSON
expect 0 "dim=64 (file)" -- train tiny --dry-run model.init_from="$tmp/hf"
expect 2 "model.n_layers 3 (set in the recipe) contradicts model.init_from" -- train tiny --dry-run model.init_from="$tmp/hf" model.n_layers=3
sed -i 's/"bos_token_id": 1/"rope_scaling": {"rope_type": "yarn", "factor": 4.0}/' "$tmp/hf/config.json"
expect 2 "'yarn' is not supported" -- train tiny --dry-run model.init_from="$tmp/hf"
expect 2 "train.out_dir $tmp/afile exists and is not a folder" -- train tiny train.out_dir="$tmp/afile"
expect 2 "recipe '/nonexistent' is neither a file" -- bench optim-state --recipe /nonexistent
expect 2 "recipe 'nosuch' is neither a file" -- bench train --recipe nosuch
expect 2 "--bf16 must be auto, on or off, not 'maybe'" -- bench train --bf16 maybe
expect 0 "optimizer.algorithm  (one of sgd, adam, adamw; default adamw)" -- train --list-keys
[ -e "$tmp/nocorpus" ] && { echo "FAIL: a refused run left $tmp/nocorpus behind"; failed=$((failed + 1)); }

# An impossible activation budget: the last line says why and gives the smallest achievable one.
"$frugal" account --layers 2 --width 32 --heads 2 --batch 2 --seq 8 --skip-timing --budget 100 --json-out "$tmp/b.json" >"$tmp/out" 2>"$tmp/err"
got=$?
if [ "$got" = 2 ] && tail -n 1 "$tmp/err" | grep -q -- "--budget 100 (100 B) cannot be met: the smallest achievable activation peak for this stack is [0-9]* bytes"; then
  pass=$((pass + 1))
else
  echo "FAIL: impossible budget exited $got"; cat "$tmp/err"; failed=$((failed + 1))
fi
expect 2 "--budget must be a byte count from 0 to" -- account --budget lots
expect 0 "predicted peak" -- account --layers 4 --width 32 --heads 2 --batch 2 --seq 8 --skip-timing --budget 40KiB --json-out "$tmp/c.json"

# A small real run: the JSON keys are exactly the documented ones.
expect 0 "measured / predicted" -- account --layers 2 --width 32 --heads 2 --batch 2 --seq 8 --skip-timing --json-out "$tmp/a.json"
if [ -f "$tmp/a.json" ]; then
  keys=$(python3 -c 'import json,sys; print(",".join(json.load(open(sys.argv[1])).keys()))' "$tmp/a.json")
  want="config,n_params,param_bytes,grad_bytes,adamw_state_bytes,saved_bytes,saved_ratio_vs_none,time_s,max_grad_diff,predicted_saved_bytes_none,measured_over_predicted,saved_bytes_by_attention,predicted_saved_bytes_by_attention,measured_over_predicted_by_attention,time_s_by_attention,max_grad_diff_by_attention,optimizer"
  if [ "$keys" = "$want" ]; then pass=$((pass + 1)); else echo "FAIL: keys $keys"; failed=$((failed + 1)); fi
else
  echo "FAIL: no JSON written"; failed=$((failed + 1))
fi

# Attention kernels: explicit on every build, sdpa beside it on LibTorch 2.x (keeping fewer bytes,
# as its formula says); on 1.13 model.attention=sdpa is refused before any work.
if "$frugal" --version | grep -q "LibTorch 1\."; then
  kernels="explicit"
  expect 2 "model.attention=sdpa (from the command line) needs LibTorch 2.0 or later" -- train tiny model.attention=sdpa train.out_dir="$tmp/sdpa"
  if [ ! -e "$tmp/sdpa" ]; then pass=$((pass + 1)); else echo "FAIL: a refused sdpa run made $tmp/sdpa"; failed=$((failed + 1)); fi
else
  kernels="explicit,sdpa"
  expect 0 "estimated peak" -- train tiny model.attention=sdpa model.vocab_size=512 --dry-run
fi
if python3 - "$tmp/a.json" "$kernels" <<'PY'
import json, sys
d = json.load(open(sys.argv[1]))
kept, predicted = d["saved_bytes_by_attention"], d["predicted_saved_bytes_by_attention"]
assert ",".join(kept) == sys.argv[2], kept
assert kept["explicit"] == d["saved_bytes"]["none"] and predicted["explicit"] == d["predicted_saved_bytes_none"]
for k in kept:
    assert abs(d["measured_over_predicted_by_attention"][k] - kept[k] / predicted[k]) < 1e-9
if "sdpa" in kept:
    assert kept["sdpa"] < kept["explicit"] and d["max_grad_diff_by_attention"]["sdpa"] < 1e-5, d
PY
then pass=$((pass + 1)); else echo "FAIL: account's attention kernels"; failed=$((failed + 1)); fi

# ---- frugal train, generate, tokenizer ----
expect 2 "is neither a file nor a shipped recipe" -- train nosuchrecipe
expect 2 "unknown key 'train.stpes'" -- train tiny train.stpes=3
expect 2 "train.steps must be an integer from 1 to 1099511627776, got 'x'" -- train tiny train.steps=x
expect 2 "override 'oops' must look like section.key=value" -- train tiny oops
expect 0 "estimated peak with the recipe's techniques" -- train llama2-7b --dry-run --json-out "$tmp/7b.json"
if python3 -c 'import json,sys; d=json.load(open(sys.argv[1])); assert d["peak_bytes"] > 0 and sum(d["by_category"].values()) == d["peak_bytes"]' "$tmp/7b.json"; then
  pass=$((pass + 1))
else
  echo "FAIL: dry-run JSON"; failed=$((failed + 1))
fi

# Mixed precision: the key's values, the dry run's products, and the run's first line saying which and why.
expect 2 "model.compute_dtype must be one of fp32, bf16, auto, got 'fp16'" -- train tiny model.compute_dtype=fp16
expect 0 "parameters (fp32, bf16 products)" -- train tiny --dry-run model.vocab_size=512 model.compute_dtype=bf16
if "$frugal" train tiny data.tokenizer="$tmp/tok.model" data.tokens="$tmp/f.tokens" model.vocab_size=512 train.steps=4 \
     schedule.warmup_steps=1 train.eval_interval=0 train.sample_tokens=0 train.eval_batches=1 model.compute_dtype=auto \
     train.out_dir="$tmp/autocast" --progress lines --json-out "$tmp/autocast.json" >"$tmp/autocast.log" 2>&1 &&
   grep -Eq "^frugal train: compute: (bf16 matrix products \(autocast\) over fp32 parameters|fp32) \(model.compute_dtype auto: this CPU has" "$tmp/autocast.log" &&
   python3 -c 'import json,sys; d=json.load(open(sys.argv[1])); assert d["compute_dtype"] in ("bf16", "fp32"), d' "$tmp/autocast.json"; then
  pass=$((pass + 1))
else
  echo "FAIL: model.compute_dtype=auto's first line"; cat "$tmp/autocast.log"; failed=$((failed + 1))
fi

# The slow-BLAS warning follows the library loaded, not a timing (which a busy machine skews).
if "$frugal" account --layers 1 --width 32 --heads 2 --batch 2 --seq 8 --skip-timing 2>&1 | grep -q "reference BLAS"; then
  echo "FAIL: slow-BLAS warning with an optimised BLAS"; failed=$((failed + 1))
else
  pass=$((pass + 1))
fi
# Only where LibTorch takes its BLAS from libblas.so.3 (Debian's 1.13); the PyPI wheel's is MKL, built in.
if [ -e /usr/lib/x86_64-linux-gnu/blas/libblas.so.3 ] && ldd "$frugal" | grep -q 'libblas\.so'; then
  if LD_LIBRARY_PATH=/usr/lib/x86_64-linux-gnu/blas "$frugal" account --layers 1 --width 32 --heads 2 --batch 2 --seq 8 --skip-timing 2>&1 |
     grep -q "use the reference BLAS (/usr/lib/x86_64-linux-gnu/blas/libblas.so"; then
    pass=$((pass + 1))
  else
    echo "FAIL: no slow-BLAS warning with the reference BLAS loaded"; failed=$((failed + 1))
  fi
fi

# Kill a run with SIGKILL mid-training, resume it, and compare with an uninterrupted run.
common=(data.tokenizer="$tmp/tok.model" data.tokens="$tmp/f.tokens" model.vocab_size=512 train.steps=100
        train.checkpoint_interval=5 train.eval_interval=0 train.sample_tokens=0 --progress lines)
"$frugal" train tiny "${common[@]}" train.out_dir="$tmp/straight" >"$tmp/straight.log" 2>&1 || { echo "FAIL: uninterrupted run"; cat "$tmp/straight.log"; failed=$((failed + 1)); }
"$frugal_exe" train tiny "${common[@]}" train.out_dir="$tmp/killed" >"$tmp/killed.log" 2>&1 &
pid=$!
for _ in $(seq 1 600); do
  if [ -f "$tmp/killed/latest" ] && [ "$(sed 's/step-0*//' "$tmp/killed/latest")" -ge 20 ] 2>/dev/null; then break; fi
  sleep 0.05
done
kill -9 "$pid" 2>/dev/null
wait "$pid" 2>/dev/null
killed_at=$(cat "$tmp/killed/latest" 2>/dev/null)
"$frugal" train tiny "${common[@]}" train.out_dir="$tmp/killed" --resume >"$tmp/resumed.log" 2>&1 || { echo "FAIL: resumed run"; cat "$tmp/resumed.log"; failed=$((failed + 1)); }
if python3 - "$tmp/straight/metrics.jsonl" "$tmp/killed/metrics.jsonl" <<'PY'
import json, sys
def losses(path):
    out = {}
    for line in open(path):
        d = json.loads(line)
        if "loss" in d:
            out[d["step"]] = d["loss"]
    return out
a, b = losses(sys.argv[1]), losses(sys.argv[2])
assert sorted(a) == list(range(1, 101)), "uninterrupted run incomplete"
assert sorted(b) == sorted(a), f"resumed run has steps {min(b)}..{max(b)} ({len(b)})"
diff = [s for s in a if a[s] != b[s]]
assert not diff, f"losses differ from step {diff[0]}: {a[diff[0]]} vs {b[diff[0]]}"
PY
then
  pass=$((pass + 1))
  grep -q "resumed from" "$tmp/resumed.log" || { echo "FAIL: the run was not resumed ($killed_at)"; failed=$((failed + 1)); }
else
  echo "FAIL: killed at $killed_at and resumed, the loss trajectory differs"; failed=$((failed + 1))
fi

# --stop-after: a run stopped on purpose halfway and resumed gives the uninterrupted run's losses.
"$frugal" train tiny "${common[@]}" train.out_dir="$tmp/halves" --stop-after 50 >"$tmp/half1.log" 2>&1 || { echo "FAIL: --stop-after run"; cat "$tmp/half1.log"; failed=$((failed + 1)); }
# Resumed at 50 with --stop-after 30: nothing to do, and not "complete" (100 steps are asked for).
expect 0 "nothing to do: .*halves/step-00000050 is at step 50, at or past --stop-after 30 (train.steps 100)" -- train tiny "${common[@]}" train.out_dir="$tmp/halves" --resume --stop-after 30
"$frugal" train tiny "${common[@]}" train.out_dir="$tmp/halves" --resume >"$tmp/half2.log" 2>&1 || { echo "FAIL: --stop-after run resumed"; cat "$tmp/half2.log"; failed=$((failed + 1)); }
if grep -q "to step 50:" "$tmp/half1.log" && grep -q "resumed from .*step-00000050" "$tmp/half2.log" &&
   cmp -s <(grep '"loss"' "$tmp/straight/metrics.jsonl" | sed 's/"tokens_per_s[^,]*,//') \
          <(grep '"loss"' "$tmp/halves/metrics.jsonl" | sed 's/"tokens_per_s[^,]*,//'); then
  pass=$((pass + 1))
else
  echo "FAIL: --stop-after 50 then --resume does not continue the uninterrupted run"; failed=$((failed + 1))
fi

expect 0 "A fool" -- generate --checkpoint "$tmp/straight" --prompt "A fool" --tokens 5

# The bar fits the terminal (COLUMNS when stderr is no terminal), drops fields rather than wrap,
# shows the learning rate, and says what the run does after its last step.
bar_run=(data.tokenizer="$tmp/tok.model" data.tokens="$tmp/f.tokens" model.vocab_size=512 train.steps=6
         schedule.warmup_steps=1 train.checkpoint_interval=0 train.sample_tokens=4 --progress bar)
for cols in 80 44 20; do
  COLUMNS=$cols "$frugal" train tiny "${bar_run[@]}" train.out_dir="$tmp/bar$cols" >/dev/null 2>"$tmp/bar.err"
  if python3 - "$tmp/bar.err" "$cols" <<'PY'
import re, sys
text, cols = open(sys.argv[1], newline="").read(), int(sys.argv[2])  # keep the \r
bars = re.findall(r"\r([^\r\n]*)", text)
assert bars, "no bar drawn"
assert all(len(b) <= cols - 1 for b in bars), max(bars, key=len)
assert all(re.search(r"step \d+/6  loss \d", b) for b in bars), bars
if cols >= 80: assert all(" lr " in b and "ETA" in b and b.startswith("[") for b in bars), bars
assert "step 6/6" in bars[-1]
after = text[text.rindex("step 6/6"):]
for said in ("step 6 done: saving the checkpoint", "final evaluation on", 'sampling 4 tokens after "A fool"'):
    assert said in after, said
PY
  then pass=$((pass + 1)); else echo "FAIL: progress bar at $cols columns"; cat -A "$tmp/bar.err" | head -20; failed=$((failed + 1)); fi
done
expect 0 "stopped: \(token limit reached\|end-of-sequence token\)" -- generate --checkpoint "$tmp/straight" --prompt "A fool" --tokens 5
long_prompt=$(printf 'the cat sat on the mat %.0s' $(seq 40))
expect 0 "0 of 5 tokens; stopped: context full (max_seq_len 64" -- generate --checkpoint "$tmp/straight" --prompt "$long_prompt" --tokens 5
expect 2 "--checkpoint /nonexistent is not a folder" -- generate --checkpoint /nonexistent --prompt x
# generate: ids in and out, sampling options checked; eval: loss over windows, bad input exit 2.
expect 0 "of 4 tokens" -- generate --checkpoint "$tmp/straight" --prompt-ids 1,5,9 --max-new-tokens 4 --top-p 0.9 --seed 2 --json-out "$tmp/gen.json"
grep -q '"stop": "\(max_new_tokens\|eos\)"' "$tmp/gen.json" || { echo "FAIL: generate --json-out"; cat "$tmp/gen.json"; failed=$((failed + 1)); }
expect 2 "--temperature must be a number from 0 to 100, not 'inf'" -- generate --checkpoint "$tmp/straight" --prompt x --temperature inf
expect 2 "--top-p must be a number from 1e-06 to 1, not '0'" -- generate --checkpoint "$tmp/straight" --prompt x --top-p 0
expect 0 "" -- generate --checkpoint "$tmp/straight" --prompt-ids 1,5,9 --max-new-tokens 4 --temperature 1e-100  # as greedy: no NaN probabilities
expect 2 "--prompt and --prompt-ids exclude each other" -- generate --checkpoint "$tmp/straight" --prompt x --prompt-ids 1
printf 'A fool and his money are soon parted.\n' >"$tmp/eval.txt"
expect 0 "loss [0-9.]*  perplexity [0-9.]*  tokens [0-9]*" -- eval --checkpoint "$tmp/straight" --text "$tmp/eval.txt" --seq-len 8
expect 2 "give exactly one of --text, --tokens, --jsonl" -- eval --checkpoint "$tmp/straight"
echo 1 2 999999 >"$tmp/bad-ids.txt"
expect 2 "is outside the model.s vocabulary" -- eval --checkpoint "$tmp/straight" --tokens "$tmp/bad-ids.txt"
mkdir -p "$tmp/corpus" && printf 'one fortune\n%%\nanother fortune here\n%%\nand a third\n' > "$tmp/corpus/f"
for i in $(seq 1 50); do printf 'line %d of some text about cats and dogs\n%%\n' "$i" >> "$tmp/corpus/f"; done
expect 0 "pieces from" -- tokenizer train "$tmp/corpus" --out "$tmp/t2" --vocab-size 300
expect 0 "cats" -- tokenizer encode "$tmp/t2.model" "cats and dogs"
expect 2 "tokenizer $tmp/corpus/f is not a SentencePiece model (its bytes do not parse as one)" -- tokenizer encode "$tmp/corpus/f" "x"
# A folder is a model folder now (tokenizer.json or tokenizer.model): one without a tokenizer is named so.
expect 2 "model folder $tmp/corpus has no tokenizer (neither tokenizer.json nor tokenizer.model)" -- tokenizer encode "$tmp/corpus" "x"

# tokenizer encode: a tokenizer.json and a folder holding it give the `tokenizers` library's ids
# (tests/data/fixtures/expected_ids.json); --text-file reads the file's exact bytes (trailing
# newlines, CRLF); --json is one line; --add-special-tokens adds BOS; a checkpoint folder (tokenizer.json
# written beside tokenizer.model) gives the .model's ids; the user's mistakes are exit 2, one line.
fixtures="$(cd "$(dirname "$0")/../data/fixtures" && pwd)"
mkdir -p "$tmp/l2folder" && cp "$fixtures/llama2.json" "$tmp/l2folder/tokenizer.json"
if python3 - "$frugal" "$fixtures" "$tmp" <<'PY'
import json, subprocess, sys
frugal, fixtures, tmp = sys.argv[1:4]
def encode_all(tok, texts, *flags):
    """One process for many texts (--texts-jsonl), one --json line back for each."""
    path = f"{tmp}/texts.jsonl"
    with open(path, "w", encoding="utf-8") as f:
        for text in texts:
            f.write(json.dumps(text) + "\n")
    out = subprocess.run([frugal, "tokenizer", "encode", tok, "--texts-jsonl", path, *flags], capture_output=True, check=True).stdout
    lines = out.split(b"\n")
    assert lines[-1] == b"" and len(lines) == len(texts) + 1, out
    return [json.loads(line) for line in lines[:-1]]
def encode(tok, text, *flags):
    path = f"{tmp}/text.txt"
    open(path, "wb").write(text.encode("utf-8"))
    out = subprocess.run([frugal, "tokenizer", "encode", tok, "--text-file", path, "--json", *flags], capture_output=True, check=True).stdout
    assert out.count(b"\n") == 1 and out.endswith(b"\n"), out
    return json.loads(out)
expected = json.load(open(f"{fixtures}/expected_ids.json"))
n = 0
for name in ["gpt2", "llama3", "llama2", "mistral"]:
    cases = expected[name]["cases"]
    for tok in [f"{fixtures}/{name}.json"] + ([f"{tmp}/l2folder"] if name == "llama2" else []):
        texts = [case["text"] for case in cases]
        plain = encode_all(tok, texts)
        special = encode_all(tok, texts, "--add-special-tokens") if name in ("llama2", "llama3") else None
        for i, case in enumerate(cases):
            got = plain[i]
            assert got["ids"] == case["ids"], (tok, case["text"], got["ids"], case["ids"])
            # decoded as the library does it, where no special token is left out
            assert "<" in case["text"] or got["decoded"] == case["decoded"], (tok, case, got)
            if special is not None:
                assert special[i]["ids"] == case["ids_with_special"], (tok, case["text"])
            n += 1
        # --texts-jsonl gives what one text at a time (--text-file, the file's exact bytes) gives
        assert encode(tok, cases[-1]["text"]) == plain[-1], (tok, cases[-1]["text"])
# A checkpoint folder (tokenizer.json from the trained .model) and the .model itself: the same ids.
texts = ["", " leading", "a  b\t\tc", "new\nlines\n\n", "crlf\r\n", "A fool 😀 日本", "  "]
a = encode_all(f"{tmp}/straight/step-00000100", texts, "--add-special-tokens")
b = encode_all(f"{tmp}/tok.model", texts, "--add-special-tokens")
assert a == b, (texts, a, b)
n += len(texts)
print(f"  tokenizer encode --json: {n} texts as expected")
PY
then pass=$((pass + 1)); else echo "FAIL: tokenizer encode --json against the fixtures' ids"; failed=$((failed + 1)); fi
expect 0 "^{\"ids\": \[1, " -- tokenizer encode "$tmp/l2folder" --json --add-special-tokens "Hello world"
printf 'bad \xff byte' > "$tmp/bad-utf8.txt"
expect 2 "tokenizer: the text is not valid UTF-8 (at byte 4)" -- tokenizer encode "$fixtures/gpt2.json" --text-file "$tmp/bad-utf8.txt"
expect 2 "tokenizer: the text is not valid UTF-8 (at byte 4)" -- tokenizer encode "$tmp/t2.model" --text-file "$tmp/bad-utf8.txt" --json
expect 2 "tokenizer encode needs the text: one TEXT argument, --text-file or --texts-jsonl" -- tokenizer encode "$fixtures/gpt2.json"
expect 2 "tokenizer encode needs the text: one TEXT argument, --text-file or --texts-jsonl" -- tokenizer encode "$fixtures/gpt2.json" --text-file "$tmp/bad-utf8.txt" "x"
printf '"a"\n5\n' > "$tmp/texts-bad.jsonl"
expect 2 "--texts-jsonl $tmp/texts-bad.jsonl line 2 is not a JSON string" -- tokenizer encode "$fixtures/gpt2.json" --texts-jsonl "$tmp/texts-bad.jsonl"
expect 2 "--text-file $tmp/nonexistent.txt does not exist" -- tokenizer encode "$fixtures/gpt2.json" --text-file "$tmp/nonexistent.txt"
expect 2 "tokenizer $tmp/nonexistent.json does not exist" -- tokenizer encode "$tmp/nonexistent.json" "x"
cp "$tmp/corpus/f" "$tmp/notjson.json"
expect 2 "$tmp/notjson.json is not valid JSON" -- tokenizer encode "$tmp/notjson.json" "x"

# tokenizer examples: each example one JSON line with its ids and loss flags (the answer and EOS);
# a bad example is exit 2 naming file, line and field, or skipped and counted with --skip-bad.
printf '{"prompt": "a", "completion": " b"}\n{"prompt": "a", "completion": 5}\n' > "$tmp/pc.jsonl"
expect 2 "$tmp/pc.jsonl line 2: field 'completion': is not a string" -- tokenizer examples "$fixtures/gpt2.json" "$tmp/pc.jsonl" --format prompt_completion
expect 0 '"loss": \[0, 1, 1\]' -- tokenizer examples "$fixtures/gpt2.json" "$tmp/pc.jsonl" --format prompt_completion --skip-bad
expect 0 "1 examples, 3 tokens (2 with loss), 1 skipped" -- tokenizer examples "$fixtures/gpt2.json" "$tmp/pc.jsonl" --format prompt_completion --skip-bad
expect 2 "--template 'llama4' is not one of plain, alpaca, llama2, llama3, chatml" -- tokenizer examples "$fixtures/gpt2.json" "$tmp/pc.jsonl" --template llama4
expect 2 "$tmp/l2folder has no chat_template" -- tokenizer examples "$tmp/l2folder" "$tmp/pc.jsonl"
expect 2 "the chatml chat template writes the token '<|im_start|>'" -- tokenizer examples "$tmp/l2folder" "$tmp/pc.jsonl" --template chatml

# A tokenizer with no BOS piece (trained by the helper directly, with SentencePiece's bos_id=-1):
# training samples with it, and generate decodes the prompt and its continuation.
"$(dirname "$frugal_exe")/frugal-spm-train" "--input=$tmp/corpus/f --model_prefix=$tmp/nobos --vocab_size=300 --model_type=bpe --byte_fallback=true --bos_id=-1 --eos_id=1 --unk_id=0 --pad_id=-1 --hard_vocab_limit=false --minloglevel=2" >"$tmp/nobos.log" 2>&1 ||
  { echo "FAIL: training a tokenizer without BOS"; cat "$tmp/nobos.log"; failed=$((failed + 1)); }
nobos_run=(data.tokenizer="$tmp/nobos.model" data.tokens="$tmp/nobos.tokens" data.corpus="$tmp/corpus/f" train.steps=3
           schedule.warmup_steps=1 train.eval_interval=0 train.checkpoint_interval=0 train.batch_size=2 train.seq_len=16
           train.sample_tokens=4 --progress lines)
expect 0 'sample: A fool' -- train tiny "${nobos_run[@]}" train.out_dir="$tmp/nobos-run"
"$frugal" generate --checkpoint "$tmp/nobos-run" --prompt "A fool" --tokens 6 --temperature 0 >"$tmp/out" 2>"$tmp/err"
got=$?
if [ "$got" = 0 ] && [ "$(head -c 6 "$tmp/out")" = "A fool" ] && [ "$(wc -l <"$tmp/out")" = 1 ] &&
   grep -q "frugal generate: [0-6] of 6 tokens; stopped: " "$tmp/err" && ! grep -qi "error\|index out of range" "$tmp/err"; then
  pass=$((pass + 1))
else
  echo "FAIL: generate with a tokenizer without BOS (exit $got)"; cat "$tmp/out" "$tmp/err"; failed=$((failed + 1))
fi
expect 2 "adds no BOS, so the prompt must not be empty" -- generate --checkpoint "$tmp/nobos-run" --tokens 2

# Bad input found below the command line (std::invalid_argument from the library) is exit 2 with
# one line naming the file or value; internal failures stay exit 1.
printf 'FRUGALTK but not a token file at all\n' > "$tmp/junk.tokens"
expect 2 "token file $tmp/junk.tokens has an unsupported version" -- train tiny "${nobos_run[@]}" data.tokens="$tmp/junk.tokens" train.out_dir="$tmp/junk-run"
expect 2 "tokenizer $tmp/corpus/f is not a SentencePiece model (its bytes do not parse as one)" -- train tiny "${nobos_run[@]}" data.tokenizer="$tmp/corpus/f" train.out_dir="$tmp/junk-run"
printf '   \n%%\n\t\n' > "$tmp/blank.txt"
expect 2 "corpus $tmp/blank.txt holds no text" -- train tiny "${nobos_run[@]}" data.corpus="$tmp/blank.txt" data.tokens="$tmp/blank.tokens" train.out_dir="$tmp/junk-run"
[ -e "$tmp/blank.tokens" ] && { echo "FAIL: a corpus without text left $tmp/blank.tokens"; failed=$((failed + 1)); }

# ---- Checkpoints: damaged ones refused on --resume (exit 2, nothing changed), finished runs left alone ----
damaged() {  # damaged NAME PYTHON-EDIT PATTERN: a copy of the finished run with one file edited
  local d="$tmp/damaged-$1"
  rm -rf "$d" && cp -r "$tmp/straight" "$d"
  python3 - "$d/step-00000100" <<<"$2"
  (cd "$d" && find . -type f | sort | xargs md5sum) >"$tmp/before.md5"
  expect 2 "$3" -- train tiny "${common[@]}" train.out_dir="$d" --resume
  if (cd "$d" && find . -type f | sort | xargs md5sum) | cmp -s - "$tmp/before.md5"; then
    pass=$((pass + 1))
  else
    echo "FAIL: refusing $1 changed files on disk"; failed=$((failed + 1))
  fi
}
st='import json, sys; p = sys.argv[1] + "/trainer_state.json"; d = json.load(open(p)); '
put='; open(p, "w").write(json.dumps(d))'
damaged negative-step "$st"'d["step"] = -4'"$put" "trainer_state.json: 'step' is -4, outside \[0, train.steps = 100\]"
damaged absurd-step "$st"'d["step"] = 10**12'"$put" "'step' is 1000000000000"
damaged renamed-step "$st"'d["step"] = 95'"$put" "'step' is 95 but the folder is step-00000100"
damaged short-rng "$st"'d["rng_cpu"] = d["rng_cpu"][:100]'"$put" "'rng_cpu' has 100 hex digits"
damaged bad-schedule "$st"'d["schedule_step"] = 301'"$put" "'schedule_step' is 301"
# The optimizer's state: a moment relabelled as integers, a NaN in a moment, a negative step (each
# would turn the next update into NaN or garbage, then be committed as latest).
# The python below edits the first entry whose name ends with the suffix given first.
ost() { printf '%s' 'import json, struct, sys, math; p = sys.argv[1] + "/optimizer.safetensors"; b = bytearray(open(p, "rb").read()); n = struct.unpack("<Q", b[:8])[0]; h = json.loads(b[8:8 + n]); name = sorted(k for k in h if k.endswith("'"$1"'"))[0]; at = 8 + n + h[name]["data_offsets"][0]; '"$2"'; open(p, "wb").write(b)'; }
damaged relabelled-moment "$(ost .exp_avg 'h[name]["dtype"] = "I32"; j = json.dumps(h, separators=(",", ":")).encode(); assert len(j) <= n; j += b" " * (n - len(j)); b[8:8 + n] = j')" "exp_avg is Int; a moment must be floating point"
damaged nan-moment "$(ost .exp_avg_sq 'b[at:at + 4] = struct.pack("<f", math.nan)')" "exp_avg_sq holds a value that is not finite"
damaged negative-step-count "$(ost .step 'b[at:at + 8] = struct.pack("<q", -3)')" "step is -3; a step count must be from 1 to 2^53"
damaged empty-optimizer 'import sys, struct; h = b"{}      "; open(sys.argv[1] + "/optimizer.safetensors", "wb").write(struct.pack("<Q", len(h)) + h)' \
  "optimizer.safetensors holds no optimizer state"

# A finished run resumed: says so, names the checkpoint, writes nothing (twice in a row).
(cd "$tmp/straight" && find . -type f | sort | xargs md5sum) >"$tmp/before.md5"
expect 0 "run already complete: .*straight/step-00000100 is at step 100" -- train tiny "${common[@]}" train.out_dir="$tmp/straight" --resume
expect 0 "run already complete" -- train tiny "${common[@]}" train.out_dir="$tmp/straight" --resume
if (cd "$tmp/straight" && find . -type f | sort | xargs md5sum) | cmp -s - "$tmp/before.md5" && ! grep -q "last loss" "$tmp/out"; then
  pass=$((pass + 1))
else
  echo "FAIL: resuming a finished run changed it"; cat "$tmp/out"; failed=$((failed + 1))
fi

# A kill while a checkpoint is being written: FRUGAL_TEST_KILL_AFTER_WRITING makes the run SIGKILL
# itself right after the first file of step 20's temporary folder is in place. The next run removes
# that folder (a dead PID's), leaves a live process's alone, resumes from step 15 (the last complete
# checkpoint) and continues the uninterrupted trajectory.
# (In a subshell that waits for it, so the shell's own "Killed" line goes to /dev/null.)
# The optimizer state of these two runs lives in files streamed through a window of 4 KiB
# (state_placement file): the checkpoint copies it consistently, and the trajectory (step, loss,
# learning rate; not the memory figures, the state being out of memory) is the one of state in memory.
mkdir -p "$tmp/state-files"
in_files=(optimizer.state_placement=file optimizer.state_window=4096 optimizer.state_dir="$tmp/state-files")
(FRUGAL_TEST_KILL_AFTER_WRITING="/.step-00000020.tmp-" "$frugal" train tiny "${common[@]}" "${in_files[@]}" train.out_dir="$tmp/killed-save" >"$tmp/killed-save.log" 2>&1
 echo $? >"$tmp/killed-save.rc") 2>/dev/null
got=$(cat "$tmp/killed-save.rc")
half=$(ls -d "$tmp"/killed-save/.step-00000020.tmp-* 2>/dev/null)
if [ "$got" = 137 ] && [ -n "$half" ] && [ "$(ls "$half" | wc -l)" = 1 ] && [ "$(cat "$tmp/killed-save/latest")" = step-00000015 ] &&
   [ ! -e "$tmp/killed-save/step-00000020" ]; then
  pass=$((pass + 1))
else
  echo "FAIL: the kill mid-save (exit $got) left: $(ls -a "$tmp/killed-save" | tr '\n' ' ') / $(ls "$half" 2>/dev/null | tr '\n' ' ')"; failed=$((failed + 1))
fi
mkdir -p "$tmp/killed-save/.step-00000007.tmp-$$"  # this shell's: alive
"$frugal" train tiny "${common[@]}" "${in_files[@]}" train.out_dir="$tmp/killed-save" --resume >"$tmp/resumed-save.log" 2>&1 || { echo "FAIL: resume after a kill mid-save"; cat "$tmp/resumed-save.log"; failed=$((failed + 1)); }
if [ -n "$half" ] && [ ! -e "$half" ] && [ -d "$tmp/killed-save/.step-00000007.tmp-$$" ] &&
   grep -q "resumed from .*step-00000015" "$tmp/resumed-save.log" &&
   cmp -s <(grep '"loss"' "$tmp/straight/metrics.jsonl" | sed 's/, "tokens_per_s.*//') \
          <(grep '"loss"' "$tmp/killed-save/metrics.jsonl" | sed 's/, "tokens_per_s.*//'); then
  pass=$((pass + 1))
else
  echo "FAIL: after a kill mid-save: $(ls -a "$tmp/killed-save" | tr '\n' ' ')"; grep resumed "$tmp/resumed-save.log"; failed=$((failed + 1))
fi

# Optimizer state in files on a disk too small for it: refused before step 0 in one sentence (exit
# 2), not SIGBUS; a state_dir that is no folder likewise.
expect 2 "optimizer.state_dir: $tmp/no-such-folder cannot be used for the state files" -- train tiny "${common[@]}" \
  train.steps=8 train.out_dir="$tmp/nodir" optimizer.state_placement=file optimizer.state_dir="$tmp/no-such-folder"
if [ -d "$tmp/nodir/step-00000008" ]; then echo "FAIL: a run whose state_dir is no folder trained"; failed=$((failed + 1)); fi
mkdir -p "$tmp/full"
if mount -t tmpfs -o size=64k tmpfs "$tmp/full" 2>/dev/null; then
  expect 2 "optimizer.state_dir: $tmp/full has 64.0 KiB free; the optimizer state files need" -- train tiny "${common[@]}" train.steps=8 \
    train.out_dir="$tmp/fulldisk" optimizer.state_placement=mmap optimizer.state_dir="$tmp/full"
  umount "$tmp/full"
else
  echo "skipped: the full-disk check needs a tmpfs mount (root)"
fi

# A checkpoint whose config.json claims 10^8 layers: refused from the weights' headers at once.
rm -rf "$tmp/huge" && cp -r "$tmp/straight/step-00000100" "$tmp/huge"
sed -i 's/"num_hidden_layers": *[0-9]*/"num_hidden_layers": 100000000/' "$tmp/huge/config.json"
expect 2 "config.json implies [0-9]* tensors (100000000 layers) but the weights hold" -- generate --checkpoint "$tmp/huge" --prompt x --tokens 1

# Sizes this machine cannot hold: refused before the work where the need is known (exit 2), and an
# allocation that fails midway is named in our words, not the allocator's (exit 1).
expect 2 "--params 1000000000000 needs about .* more than this machine's" -- bench optim-state --params 1000000000000 --runs 1
expect 1 "frugal account: error: out of memory: allocating [0-9.]* GiB failed" -- account --layers 1 --width 4194304 --heads 2 --batch 1 --seq 1 --skip-timing
if grep -q "alloc_cpu\|enforce fail" "$tmp/err"; then echo "FAIL: the allocator's own message reached the user"; failed=$((failed + 1)); fi

# frugal bench optim-state removes its temporary run folders on every way out (here: a bad recipe).
ls -d /tmp/frugal-bench-state-* 2>/dev/null | sort >"$tmp/bench-before"
"$frugal" bench optim-state --params 4096 --runs 2 --steps 1 --recipe "$tmp/nosuch.yaml" --json-out "$tmp/bench.json" >/dev/null 2>&1
got=$?
if [ "$got" = 2 ] && ls -d /tmp/frugal-bench-state-* 2>/dev/null | sort | cmp -s - "$tmp/bench-before"; then pass=$((pass + 1)); else
  echo "FAIL: bench optim-state with a bad recipe exited $got and left $(ls -d /tmp/frugal-bench-state-* 2>/dev/null | tr "\n" " ")"; failed=$((failed + 1)); fi

# A kill during tokenizer training: the helper dies with frugal; the next run removes the corpus copy.
mkdir -p "$tmp/bigcorpus"
python3 -c 'import random; r = random.Random(1); w = [("".join(r.choice("abcdefghij") for _ in range(r.randint(2, 9)))) for _ in range(5000)]; open("'"$tmp"'/bigcorpus/c", "w").write("\n".join(" ".join(r.choice(w) for _ in range(12)) for _ in range(60000)))'
"$frugal_exe" tokenizer train "$tmp/bigcorpus" --out "$tmp/tbig" --vocab-size 4000 >/dev/null 2>&1 &
pid=$!
helper=
for _ in $(seq 1 400); do helper=$(pgrep -P "$pid" 2>/dev/null | head -n 1); [ -n "$helper" ] && break; sleep 0.05; done
kill -9 "$pid" 2>/dev/null
wait "$pid" 2>/dev/null
sleep 0.5
# Dead: gone, or a zombie nobody has reaped yet (PID 1 of a container may not reap).
if [ -n "$helper" ] && { [ ! -e "/proc/$helper" ] || grep -q '^State:.*Z' "/proc/$helper/status" 2>/dev/null; }; then
  pass=$((pass + 1))
else
  echo "FAIL: the tokenizer helper (${helper:-never seen}) outlived its parent: $(grep State "/proc/$helper/status" 2>/dev/null)"; [ -n "$helper" ] && kill -9 "$helper" 2>/dev/null
  failed=$((failed + 1))
fi
if compgen -G "${TMPDIR:-/tmp}/frugal-tokenizer-$pid-*/corpus.txt" >/dev/null; then
  pass=$((pass + 1))
else
  echo "FAIL: the killed run left no corpus copy in ${TMPDIR:-/tmp}/frugal-tokenizer-$pid-* (for the next run to remove)"
  failed=$((failed + 1))
fi
expect 0 "pieces from" -- tokenizer train "$tmp/corpus" --out "$tmp/t3" --vocab-size 300
if compgen -G "${TMPDIR:-/tmp}/frugal-tokenizer-$pid-*" >/dev/null; then echo "FAIL: a killed run's tokenizer files stayed"; failed=$((failed + 1)); else pass=$((pass + 1)); fi

# A memory limit: the run stops cleanly, says what holds the memory and which techniques fit.
"$frugal" train tiny "${common[@]}" train.steps=8 train.out_dir="$tmp/limited" --memory-limit 4MiB >"$tmp/out" 2>"$tmp/err"
got=$?
if [ "$got" = 1 ] && grep -q "the memory limit of 4.00 MiB was exceeded at step" "$tmp/err" && grep -q "activation" "$tmp/err" \
   && grep -q "memory.checkpointing=full: .*(fits)" "$tmp/err"; then
  pass=$((pass + 1))
else
  echo "FAIL: memory limit (exit $got)"; cat "$tmp/err"; failed=$((failed + 1))
fi

# Allocation trace -> PyTorch memory-viewer snapshot, read back with Python's pickle.
expect 0 "events" -- account --layers 2 --width 32 --heads 2 --batch 2 --seq 8 --skip-timing --json-out "$tmp/t.json" --trace-out "$tmp/trace.json"
expect 0 "wrote" -- report "$tmp/trace.json" --memory-viz "$tmp/snap.pickle"
if python3 - "$tmp/snap.pickle" <<'PY'
import pickle, pickletools, sys
raw = open(sys.argv[1], "rb").read()
allowed = {"PROTO", "MARK", "EMPTY_DICT", "SETITEMS", "EMPTY_LIST", "APPENDS", "BININT", "LONG1", "BINUNICODE",
           "BINFLOAT", "NONE", "NEWTRUE", "NEWFALSE", "TUPLE2", "STOP"}
used = {op.name for op, _, _ in pickletools.genops(raw)}
assert used <= allowed, used - allowed
snap = pickle.loads(raw)
assert set(snap) == {"segments", "device_traces"}
assert len(snap["device_traces"]) == 1, "a CPU-only trace is one device"
trace = snap["device_traces"][0]
assert trace and all({"action", "addr", "size", "stream", "time_us", "category", "frames"} <= set(e) for e in trace)
assert {e["category"] for e in trace} >= {"parameter", "activation", "gradient", "optimizer_state"}
# Microseconds since the epoch (the viewer prints dates): after 2020, before 2100.
assert all(1.58e15 < e["time_us"] < 4.1e15 for e in trace), trace[0]["time_us"]
# One frame naming frugal's category, phase and step.
for e in trace:
    (f,) = e["frames"]
    assert f["filename"] == "frugal" and f["name"].startswith("category=" + e["category"] + " phase=") and "step=" in f["name"], f
live = {}
for e in trace:
    if e["action"] == "alloc": live[e["addr"]] = e["size"]
    if e["action"] == "free_completed": del live[e["addr"]]
blocks = {b["address"]: b["size"] for s in snap["segments"] for b in s["blocks"] if b["state"] == "active_allocated"}
assert blocks == live, "segments disagree with the trace"
# Every block of the trace lies in a segment (else the viewer says "pool_id unknown"), and the blocks tile each segment.
segs = snap["segments"]
assert segs
for e in trace:
    assert any(s["address"] <= e["addr"] and e["addr"] + e["size"] <= s["address"] + s["total_size"] for s in segs), e
for s in segs:
    assert sum(b["size"] for b in s["blocks"]) == s["total_size"], s["address"]
PY
then pass=$((pass + 1)); else echo "FAIL: memory-viz snapshot"; failed=$((failed + 1)); fi
# A trace with CPU and cuda:0 memory: one device trace each, as torch numbers them (cuda:0 at 0, the CPU after).
cat > "$tmp/two_devices.json" <<'JSON'
{"format": "frugal-trace", "version": 4, "start_unix_us": 1700000000000000, "events": [
{"time_us": 1, "action": "alloc", "bytes": 64, "category": "parameter", "phase": "idle", "device": "cpu", "step": -1, "addr": 4096},
{"time_us": 2, "action": "alloc", "bytes": 32, "category": "activation", "phase": "forward", "device": "cuda:0", "step": 0, "addr": 4096},
{"time_us": 3, "action": "free", "bytes": 32, "category": "activation", "phase": "backward", "device": "cuda:0", "step": 0, "addr": 4096}]}
JSON
expect 0 "wrote" -- report "$tmp/two_devices.json" --memory-viz "$tmp/two_devices.pickle"
if python3 - "$tmp/two_devices.pickle" <<'PY'
import pickle, sys
snap = pickle.load(open(sys.argv[1], "rb"))
cuda, cpu = snap["device_traces"]
assert [e["action"] for e in cuda] == ["alloc", "free_requested", "free_completed"] and cuda[0]["size"] == 32
assert [e["action"] for e in cpu] == ["alloc"] and cpu[0]["size"] == 64 and cpu[0]["time_us"] == 1700000000000001
assert sorted((s["device"], s["total_size"]) for s in snap["segments"]) == [(0, 32), (1, 64)]
PY
then pass=$((pass + 1)); else echo "FAIL: memory-viz snapshot of two devices"; failed=$((failed + 1)); fi
expect 2 "nothing to write" -- report "$tmp/trace.json"
expect 0 "events" -- train tiny "${common[@]}" train.steps=8 train.out_dir="$tmp/traced" --trace-out "$tmp/train_trace.json" --trace-steps 2,3
if python3 -c 'import json,sys; d=json.load(open(sys.argv[1])); assert len(d["steps"]) == 8 and {e["step"] for e in d["events"] if e["action"] == "alloc"} <= {2, 3}' "$tmp/train_trace.json"; then
  pass=$((pass + 1))
else
  echo "FAIL: bounded capture"; failed=$((failed + 1))
fi
expect 0 "wrote" -- report "$tmp/train_trace.json" --memory-viz "$tmp/train_snap.pickle"

# One number, one meaning: the same run with and without --trace-out reports the same peak and
# breakdown; the trace's step summaries and the HTML page built from it say the same.
expect 0 "measured peak over steps 0-5" -- train tiny "${common[@]}" train.steps=6 train.out_dir="$tmp/plain6" --json-out "$tmp/plain6.json"
expect 0 "events" -- train tiny "${common[@]}" train.steps=6 train.out_dir="$tmp/traced6" --json-out "$tmp/traced6.json" --trace-out "$tmp/traced6_trace.json"
expect 0 "wrote" -- report "$tmp/traced6_trace.json" -o "$tmp/traced6.html"
if python3 - "$tmp/plain6.json" "$tmp/traced6.json" "$tmp/traced6_trace.json" "$tmp/traced6.html" <<'PY'
import json, re, sys
plain, traced, trace = (json.load(open(p)) for p in sys.argv[1:4])
assert plain["by_category"] == traced["by_category"], (plain["by_category"], traced["by_category"])
assert plain["peak_bytes"] == traced["peak_bytes"] == sum(traced["by_category"].values())
assert traced["peak_covers"] == {"first_step": 0, "last_step": 5}
best = max(trace["steps"], key=lambda s: s["peak_bytes"])
assert best["peak_bytes"] == traced["peak_bytes"] and best["breakdown"] == traced["by_category"], best
assert best["step"] == traced["peak_step"] and best["phase"] == traced["peak_phase"]
page = open(sys.argv[4]).read()
data = json.loads(re.search(r'<script type="application/json" id="frugal-data">(.*?)</script>', page, re.S).group(1))
view = data["traces"][0]
assert view["steps_peak"]["bytes"] == traced["peak_bytes"] and view["steps_peak"]["covers"] == "steps 0-5", view["steps_peak"]
PY
then pass=$((pass + 1)); else echo "FAIL: with and without --trace-out, the trace and the page disagree"; failed=$((failed + 1)); fi
printf '{"events": [{"time_us": 1}]}' > "$tmp/bad_trace.json"
expect 2 "missing key 'action'" -- report "$tmp/bad_trace.json" --memory-viz "$tmp/x.pickle"

# bench optim-state: the documented keys; FRUGAL_CPU_KERNELS=portable switches the quantized and dense kernels.
libtorch_version=$("$frugal" --version | sed -n 's/.*LibTorch \([0-9.]*\).*/\1/p')
for kernel in portable automatic; do
  FRUGAL_CPU_KERNELS=$kernel expect 0 "" -- bench optim-state --params 16384 --runs 1 --json-out "$tmp/state_$kernel.json"
  if python3 - "$tmp/state_$kernel.json" "$kernel" "$libtorch_version" <<'PY'
import json, sys
d = json.load(open(sys.argv[1]))
assert d["benchmark"] == "optim-state" and d["params_timed"] == 16384
flags = set(open("/proc/cpuinfo").read().split())
automatic = sys.argv[2] == "automatic"
widest = ("avx512" if {"avx512f", "avx512bw", "avx512vbmi", "avx2"} <= flags else "avx2" if "avx2" in flags else "portable")
expected = widest if automatic else "portable"
assert d["quantized_kernel"] == expected, (d["quantized_kernel"], expected)
dense = "avx512" if "avx512f" in flags and "avx2" in flags and "fma" in flags else "avx2" if "avx2" in flags and "fma" in flags else "portable"
assert d["dense_kernel"] == (dense if automatic else "portable"), d["dense_kernel"]
assert isinstance(d["adam_dense_kernel"], bool) and isinstance(d["sgd_dense_kernel"], bool), d
assert d["threads"] >= 1 and d["copy_bytes"] == 256 << 20 and d["copy_bandwidth_gbs"] > 0, d
p = d["precisions"]
assert set(p) == {"fp32", "bf16", "int8", "int4"}
bounds = {"fp32": (8, 8), "bf16": (4, 4), "int8": (2, 2.05), "int4": (1, 1.1)}
for name, (lo, hi) in bounds.items():
    r = p[name]
    assert lo <= r["bytes_per_param"] <= hi, (name, r["bytes_per_param"])
    assert r["step_time_ratio_vs_fp32"] > 0
    # fp32 parameter read and written, fp32 gradient read, both moments' state read and written
    assert abs(r["bytes_moved_per_param"] - (12 + 2 * r["bytes_per_param"])) < 1e-9, (name, r)
    assert abs(r["ns_per_param"] - r["step_time_s"] * 1e9 / d["params_timed"]) < 1e-6 * r["ns_per_param"], (name, r)
    assert abs(r["achieved_gbs"] - r["bytes_moved_per_param"] / r["ns_per_param"]) < 1e-6 * r["achieved_gbs"], (name, r)
    # relative: the JSON keeps 10 significant digits, and 16K parameters fit in cache (several times a copy's GB/s)
    assert abs(r["fraction_of_copy_bandwidth"] - r["achieved_gbs"] / d["copy_bandwidth_gbs"]) < 1e-8 * r["fraction_of_copy_bandwidth"], (name, r)
# SGD with momentum: one fp32 buffer, read and written beside the parameter and its gradient
s = d["sgd_momentum"]
assert s["momentum"] == 0.9 and s["bytes_per_param"] == 4 and s["bytes_moved_per_param"] == 20, s
assert abs(s["ns_per_param"] - s["step_time_s"] * 1e9 / d["params_timed"]) < 1e-6 * s["ns_per_param"], s
assert abs(s["achieved_gbs"] - 20 / s["ns_per_param"]) < 1e-6 * s["achieved_gbs"], s
assert abs(s["fraction_of_copy_bandwidth"] - s["achieved_gbs"] / d["copy_bandwidth_gbs"]) < 1e-8 * s["fraction_of_copy_bandwidth"], s
# against LibTorch's own fused kernels (2.4 and later): the same update on both sides, within a few
# fp32 roundings of values near 1 after two steps of lr 1e-3
f = d["against_libtorch_fused"]
assert (f is not None) == (tuple(map(int, sys.argv[3].split(".")[:2])) >= (2, 4)), (f, sys.argv[3])
for name in ([] if f is None else ["adamw_fp32", "sgd_momentum"]):
    r = f[name]
    assert r["frugal_ns_per_param"] > 0 and r["fused_ns_per_param"] > 0 and r["ratio"] > 0, (name, r)
    assert r["max_param_diff"] < 2e-6, (name, r)
PY
  then pass=$((pass + 1)); else echo "FAIL: bench optim-state JSON ($kernel kernel)"; failed=$((failed + 1)); fi
done

# bench train: techniques on and off in fp32 and bf16, and each alone off, with the median step's tokens/s of each.
if "$frugal" bench train --recipe tiny --steps 3 --rounds 2 --bf16 on memory.checkpointing=full memory.chunked_loss=true optimizer.in_backward=true \
     train.out_dir="$tmp/bt" --json-out "$tmp/bt.json" >"$tmp/bt.out" 2>"$tmp/bt.err" && python3 - "$tmp/bt.json" <<'PY'
import json, sys
j = json.load(open(sys.argv[1]))
assert j["rounds"] == 2, j["rounds"]  # each corner its fastest of two interleaved runs
assert j["bf16_corners"] is True, j  # --bf16 on: run even where bf16 products are emulated
for k in ["tokens_per_s_all_on", "tokens_per_s_all_off", "all_on_over_all_off", "peak_bytes_all_on", "peak_bytes_all_off",
          "tokens_per_s_all_on_bf16", "tokens_per_s_all_off_bf16", "peak_bytes_all_on_bf16", "peak_bytes_all_off_bf16",
          "matmul_gflops", "matmul_gflops_bf16", "achieved_gflops", "achieved_gflops_bf16", "model_gflops_bf16"]:
    assert j[k] > 0, k
# achieved against the matmul of the same precision; recompute counted in achieved, not in model
# (the JSON's numbers carry 10 significant digits: ratios of them agree to a relative 1e-6)
def close(a, b): return abs(a - b) <= 1e-6 * max(abs(a), abs(b))
assert close(j["achieved_over_matmul_bf16"], j["achieved_gflops_bf16"] / j["matmul_gflops_bf16"]), j
assert j["achieved_gflops"] > j["model_gflops"], j
t = j["targets"]
assert close(t["bf16_all_on_speed"]["value"], j["tokens_per_s_all_on_bf16"] / j["tokens_per_s_all_off"]), t
assert close(t["bf16_all_on_peak"]["value"], j["peak_bytes_all_on_bf16"] / j["peak_bytes_all_off"]), t
assert t["fp32_all_on_speed"]["met"] == (t["fp32_all_on_speed"]["value"] >= 0.85), t
# bf16 activations: with every technique off the bf16 run's activations are smaller, but the tiny
# model's peak is its plain loss's backward, where bf16 products add a bf16 copy of the logits'
# fp32 gradient (N x V x 2 bytes, 256 x 4096 x 2 here) to the fp32 logits and gradient both runs
# hold: the bf16 run peaks at most that much above the fp32 one (on the tiny model, with
# checkpointing, the weights' bf16 copies outweigh what the activations save)
assert j["peak_bytes_all_off_bf16"] < j["peak_bytes_all_off"] + 256 * 4096 * 2, j
assert sorted(j["without"]) == ["checkpointing", "chunked_loss", "in_backward"], j["without"]
for name, w in j["without"].items():
    assert w["tokens_per_s"] > 0 and w["peak_bytes"] > 0, name
    assert close(w["all_on_over_this"], j["tokens_per_s_all_on"] / w["tokens_per_s"]), name
# memory: every technique off costs the most; without checkpointing more than with everything on
assert j["peak_bytes_all_off"] > j["without"]["checkpointing"]["peak_bytes"] > j["peak_bytes_all_on"], j
PY
then pass=$((pass + 1)); else echo "FAIL: bench train's per-technique figures"; cat "$tmp/bt.err"; failed=$((failed + 1)); fi

echo "$pass passed, $failed failed"
[ "$failed" = 0 ]
