#!/usr/bin/env bash
# Instruction fine-tuning from the command line: alpaca-tiny fine-tunes a model frugal trained
# (model.init_from a run folder), reports its examples, and its validation loss equals what
# `frugal eval --examples` computes on the same checkpoint; bad examples exit 2 naming file, line and
# field, or are skipped and counted; `frugal bench packing` prints its figures; example keys on text
# data and a chat template the tokenizer cannot write are refused.
#   bash tests/apps/examples_test.sh build/frugal
set -u
repo=$(cd "$(dirname "$0")/../.." && pwd)
# Each `frugal` below is forked from one server that loaded LibTorch once (tests/support/frugal_server.sh);
# frugal's own temporary folders (bench packing's) go under $tmp, not the /tmp that hostile_files watches.
source "$(dirname "$0")/../support/frugal_server.sh"
start_frugal_test "$1" || exit 1
failed=0
pass=0
ok() { pass=$((pass + 1)); }
fail() { echo "FAIL: $*"; failed=$((failed + 1)); }

expect() {  # expect CODE PATTERN -- ARGS...
  local code=$1 pattern=$2
  shift 3
  "$frugal" "$@" >"$tmp/out" 2>"$tmp/err"
  local got=$?
  if [ "$got" != "$code" ]; then fail "frugal $* exited $got, expected $code"; cat "$tmp/err"; return; fi
  if [ -n "$pattern" ] && ! grep -q -- "$pattern" "$tmp/out" "$tmp/err"; then
    fail "frugal $* did not print '$pattern'"; cat "$tmp/out" "$tmp/err"; return
  fi
  if [ "$code" = 2 ] && [ "$(grep -c . "$tmp/err")" != 1 ]; then fail "frugal $* printed more than one line on stderr"; cat "$tmp/err"; return; fi
  ok
}

cd "$repo" || exit 1
# A small base model with room for 512 positions (its 512-piece tokenizer, trained on the fortunes,
# makes Alpaca's examples about 150 tokens long: rows of 512 hold three).
base=(data.tokenizer="$tmp/tok.model" data.tokens="$tmp/f.tokens" model.vocab_size=512 model.max_seq_len=512
      train.steps=4 schedule.warmup_steps=1 train.eval_interval=0 train.sample_tokens=0 train.out_dir="$tmp/base")
"$frugal" train tiny "${base[@]}" >"$tmp/base.log" 2>&1 || { fail "the base model's training"; cat "$tmp/base.log"; }

# alpaca-tiny on it: one epoch, fp32 products so the validation loss can be compared with eval's.
ft=(model.init_from="$tmp/base" model.compute_dtype=fp32 train.out_dir="$tmp/ft" train.epochs=1 train.eval_interval=0 train.seq_len=512)
expect 0 "examples: 800 training, 80 validation" -- train alpaca-tiny "${ft[@]}" --json-out "$tmp/ft.json"
expect 0 "loss .* answer tokens .* examples 80" -- eval --checkpoint "$tmp/ft" --examples recipes/data/alpaca-tiny.val.jsonl \
  --format alpaca --seq-len 512 --batch-size 8 --json-out "$tmp/eval.json"
if python3 - "$tmp/ft.json" "$tmp/eval.json" <<'PY'
import json, sys
run, ev = json.load(open(sys.argv[1])), json.load(open(sys.argv[2]))
e = run["examples"]
assert e["train"] == 800 and e["validation"] == 80 and e["packing"] is True, e
assert run["total_steps"] == e["steps_per_epoch"] == len(run["losses"]), (run["total_steps"], e)
assert 0 < e["padding_share"] < 0.5 and e["label_tokens"] < e["real_tokens"] <= e["processed_tokens"], e
assert sum(run["losses"][-5:]) < sum(run["losses"][:5]), run["losses"]
# The run's last validation (packed rows) and eval's (one example a row): the same answer tokens, the same loss.
rel = abs(run["val_loss"] - ev["loss"]) / ev["loss"]
assert rel < 1e-4, (run["val_loss"], ev["loss"], rel)
assert run["sample"].startswith('"') and "(expected" in run["sample"], run["sample"]
PY
then ok; else fail "alpaca-tiny's report and its validation loss against frugal eval --examples"; fi

# Bad examples: named by file, line and field; or skipped and counted.
printf '%s\n' '{"instruction": "a", "output": "b"}' '{"instruction": "a", "output": 3}' >"$tmp/bad.jsonl"
expect 2 "bad.jsonl line 2: field 'output'" -- train alpaca-tiny "${ft[@]}" train.out_dir="$tmp/bad" data.corpus="$tmp/bad.jsonl" data.validation=
printf '%s\n' '{"instruction": "a", "output": "b"}' '{"instruction": "a"' '{"instruction": "c", "output": "d"}' >"$tmp/broken.jsonl"
expect 2 "broken.jsonl line 2" -- train alpaca-tiny "${ft[@]}" train.out_dir="$tmp/broken" data.corpus="$tmp/broken.jsonl" data.validation=
expect 0 "skipped 1 bad" -- train alpaca-tiny "${ft[@]}" train.out_dir="$tmp/skip" data.corpus="$tmp/broken.jsonl" data.validation= \
  data.bad_examples=skip data.val_fraction=0.5 train.batch_size=1 schedule.warmup_steps=0
# Example keys need examples; a chat template needs its special tokens in the tokenizer.
expect 2 "applies to examples only" -- train tiny data.packing=true
expect 2 "both say how long to train" -- train alpaca-tiny "${ft[@]}" train.steps=3 train.epochs=1
expect 2 "<|im_start|>" -- train alpaca-tiny "${ft[@]}" train.out_dir="$tmp/chatml" data.format=messages data.template=chatml \
  data.corpus=recipes/data/chat-tiny.jsonl data.validation=

# frugal bench packing: both ways from the same model, a few steps each.
expect 0 "packed / one a row" -- bench packing model.init_from="$tmp/base" train.seq_len=512 --steps 3 --json-out "$tmp/bench.json"
if python3 - "$tmp/bench.json" <<'PY'
import json, sys
j = json.load(open(sys.argv[1]))
rows, packed = j["one_a_row"], j["packed"]
assert rows["steps"] == packed["steps"] == 3, j
assert packed["padding_share"] < rows["padding_share"], j
assert packed["steps_per_epoch"] < rows["steps_per_epoch"], j
assert rows["tokens_per_s"] > 0 and packed["tokens_per_s"] > 0 and j["tokens_per_s_ratio"] > 0, j
PY
then ok; else fail "bench packing's figures"; cat "$tmp/bench.json"; fi

echo "$pass passed, $failed failed"
[ "$failed" = 0 ]
