#!/usr/bin/env bash
# The CLI's contract: help texts, exit code 2 with one clear line for user mistakes, and a small
# `frugal account` run whose JSON has exactly the documented keys.
set -u
frugal="$1"
tmp=$(mktemp -d)
trap '[ -n "${KEEP_TMP:-}" ] || rm -rf "$tmp"' EXIT
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
expect 2 "--layers must be at least 1, got 0" -- account --layers 0
expect 2 "--batch must be at least 1, got -3" -- account --batch -3
expect 2 "--width must be divisible by heads" -- account --width 130 --heads 4
expect 2 "--heads takes an integer, got 'four'" -- account --heads four
expect 2 "--seq needs a value" -- account --seq
expect 2 "unknown benchmark 'nope'" -- bench nope
expect 2 "--policy: unknown checkpointing policy 'most'" -- bench optim-in-backward --policy most
expect 2 "--device must be cpu, cuda or cuda:N, got 'tpu'" -- account --device tpu
expect 2 "unexpected argument 'extra'" -- account extra
expect 2 "device cuda:0 is not available" -- account --device cuda:0

# An impossible activation budget: the last line says why and gives the smallest achievable one.
"$frugal" account --layers 2 --width 32 --heads 2 --batch 2 --seq 8 --skip-timing --budget 100 --json-out "$tmp/b.json" >"$tmp/out" 2>"$tmp/err"
got=$?
if [ "$got" = 2 ] && tail -n 1 "$tmp/err" | grep -q -- "--budget 100 (100 B) cannot be met: the smallest achievable activation peak for this stack is [0-9]* bytes"; then
  pass=$((pass + 1))
else
  echo "FAIL: impossible budget exited $got"; cat "$tmp/err"; failed=$((failed + 1))
fi
expect 2 "--budget takes a byte count" -- account --budget lots
expect 0 "predicted peak" -- account --layers 4 --width 32 --heads 2 --batch 2 --seq 8 --skip-timing --budget 40KiB --json-out "$tmp/c.json"

# A small real run: the JSON keys are exactly the documented ones.
expect 0 "measured / predicted" -- account --layers 2 --width 32 --heads 2 --batch 2 --seq 8 --skip-timing --json-out "$tmp/a.json"
if [ -f "$tmp/a.json" ]; then
  keys=$(python3 -c 'import json,sys; print(",".join(json.load(open(sys.argv[1])).keys()))' "$tmp/a.json")
  want="config,n_params,param_bytes,grad_bytes,adamw_state_bytes,saved_bytes,saved_ratio_vs_none,time_s,max_grad_diff,predicted_saved_bytes_none,measured_over_predicted,optimizer"
  if [ "$keys" = "$want" ]; then pass=$((pass + 1)); else echo "FAIL: keys $keys"; failed=$((failed + 1)); fi
else
  echo "FAIL: no JSON written"; failed=$((failed + 1))
fi

# ---- frugal train, generate, tokenizer ----
expect 2 "is neither a file nor a shipped recipe" -- train nosuchrecipe
expect 2 "unknown key 'train.stpes'" -- train tiny train.stpes=3
expect 2 "train.steps must be an integer, got 'x'" -- train tiny train.steps=x
expect 2 "override 'oops' must look like section.key=value" -- train tiny oops
expect 0 "estimated peak with the recipe's techniques" -- train llama2-7b --dry-run --json-out "$tmp/7b.json"
if python3 -c 'import json,sys; d=json.load(open(sys.argv[1])); assert d["peak_bytes"] > 0 and sum(d["by_category"].values()) == d["peak_bytes"]' "$tmp/7b.json"; then
  pass=$((pass + 1))
else
  echo "FAIL: dry-run JSON"; failed=$((failed + 1))
fi

# Kill a run with SIGKILL mid-training, resume it, and compare with an uninterrupted run.
common=(data.tokenizer="$tmp/tok.model" data.tokens="$tmp/f.tokens" model.vocab_size=512 train.steps=300
        train.checkpoint_interval=5 train.eval_interval=0 train.sample_tokens=0 --progress lines)
"$frugal" train tiny "${common[@]}" train.out_dir="$tmp/straight" >"$tmp/straight.log" 2>&1 || { echo "FAIL: uninterrupted run"; cat "$tmp/straight.log"; failed=$((failed + 1)); }
"$frugal" train tiny "${common[@]}" train.out_dir="$tmp/killed" >"$tmp/killed.log" 2>&1 &
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
assert sorted(a) == list(range(1, 301)), "uninterrupted run incomplete"
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
"$frugal" train tiny "${common[@]}" train.out_dir="$tmp/halves" --stop-after 150 >"$tmp/half1.log" 2>&1 &&
  "$frugal" train tiny "${common[@]}" train.out_dir="$tmp/halves" --resume >"$tmp/half2.log" 2>&1 || { echo "FAIL: --stop-after run"; cat "$tmp/half1.log" "$tmp/half2.log"; failed=$((failed + 1)); }
if grep -q "to step 150:" "$tmp/half1.log" && grep -q "resumed from .*step-00000150" "$tmp/half2.log" &&
   cmp -s <(grep '"loss"' "$tmp/straight/metrics.jsonl" | sed 's/"tokens_per_s[^,]*,//') \
          <(grep '"loss"' "$tmp/halves/metrics.jsonl" | sed 's/"tokens_per_s[^,]*,//'); then
  pass=$((pass + 1))
else
  echo "FAIL: --stop-after 150 then --resume does not continue the uninterrupted run"; failed=$((failed + 1))
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
mkdir -p "$tmp/corpus" && printf 'one fortune\n%%\nanother fortune here\n%%\nand a third\n' > "$tmp/corpus/f"
for i in $(seq 1 50); do printf 'line %d of some text about cats and dogs\n%%\n' "$i" >> "$tmp/corpus/f"; done
expect 0 "pieces from" -- tokenizer train "$tmp/corpus" --out "$tmp/t2" --vocab-size 300
expect 0 "cats" -- tokenizer encode "$tmp/t2.model" "cats and dogs"
expect 2 "cannot be loaded" -- tokenizer encode "$tmp/corpus/f" "x"

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
trace = snap["device_traces"][0]
assert trace and all({"action", "addr", "size", "stream", "time_us", "category"} <= set(e) for e in trace)
assert any(e["category"] == "unknown" for e in trace)
assert {e["category"] for e in trace} >= {"parameter", "activation", "gradient", "optimizer_state"}
live = {}
for e in trace:
    if e["action"] == "alloc": live[e["addr"]] = e["size"]
    if e["action"] == "free_completed": del live[e["addr"]]
blocks = {b["address"]: b["size"] for s in snap["segments"] for b in s["blocks"] if b["state"] == "active_allocated"}
assert blocks == live, "segments disagree with the trace"
PY
then pass=$((pass + 1)); else echo "FAIL: memory-viz snapshot"; failed=$((failed + 1)); fi
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

# bench optim-state: the documented keys; FRUGAL_CPU_KERNELS=portable switches the quantized kernel.
for kernel in portable automatic; do
  FRUGAL_CPU_KERNELS=$kernel expect 0 "" -- bench optim-state --params 16384 --runs 1 --json-out "$tmp/state_$kernel.json"
  if python3 - "$tmp/state_$kernel.json" "$kernel" <<'PY'
import json, sys
d = json.load(open(sys.argv[1]))
assert d["benchmark"] == "optim-state" and d["params_timed"] == 16384
has_avx2 = " avx2 " in open("/proc/cpuinfo").read().replace("\n", " ")
expected = "avx2" if sys.argv[2] == "automatic" and has_avx2 else "portable"
assert d["quantized_kernel"] == expected, (d["quantized_kernel"], expected)
p = d["precisions"]
assert set(p) == {"fp32", "bf16", "int8", "int4"}
bounds = {"fp32": (8, 8), "bf16": (4, 4), "int8": (2, 2.05), "int4": (1, 1.1)}
for name, (lo, hi) in bounds.items():
    assert lo <= p[name]["bytes_per_param"] <= hi, (name, p[name]["bytes_per_param"])
    assert p[name]["step_time_ratio_vs_fp32"] > 0
PY
  then pass=$((pass + 1)); else echo "FAIL: bench optim-state JSON ($kernel kernel)"; failed=$((failed + 1)); fi
done

echo "$pass passed, $failed failed"
[ "$failed" = 0 ]
