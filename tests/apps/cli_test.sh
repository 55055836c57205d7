#!/usr/bin/env bash
# The CLI's contract: help texts, exit code 2 with one clear line for user mistakes, and a small
# `frugal account` run whose JSON has exactly the documented keys.
set -u
frugal="$1"
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
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

echo "$pass passed, $failed failed"
[ "$failed" = 0 ]
