#!/usr/bin/env bash
# Hostile files: every file a command reads is replaced in turn by a FIFO, a symbolic link to
# /dev/zero, a folder, an empty file and a file of random bytes. Each time the command must end
# within seconds (never wait on a FIFO, never read a device to the end), exit 2, and print exactly
# one line on stderr, frugal's (it starts "frugal"), naming the file, with no NUL or other control
# byte in it. The table below has one row per reader: the next file a command reads is one row.
# Then the leftovers: `bench train`, a failed `bench data-parallel` and a SIGTERM'd `tokenizer
# train` leave nothing in the temporary folder.
#   bash tests/hostile/files_test.sh build/frugal
set -u
repo=$(cd "$(dirname "$0")/../.." && pwd)
tmp=$(mktemp -d)
trap 'stop_frugal_server; [ -n "${KEEP_TMP:-}" ] || rm -rf "$tmp"' EXIT
# Each `frugal` below is forked from one server that loaded LibTorch once (tests/support/frugal_server.sh).
source "$repo/tests/support/frugal_server.sh"
start_frugal_server "$1" "$tmp" || exit 1
failed=0
pass=0
ok() { pass=$((pass + 1)); }
fail() { echo "FAIL: $*"; failed=$((failed + 1)); }
limit=20  # seconds a refusal may take on a busy 2-core machine (a FIFO would wait forever)

# ---- One valid setup, made once; each case copies what its row needs.
fx="$tmp/fixture"
mkdir -p "$fx"
cd "$repo" || exit 1
"$frugal" train tiny data.tokenizer="$fx/tok.model" data.tokens="$fx/f.tokens" model.vocab_size=512 train.steps=2 \
  schedule.warmup_steps=1 train.eval_interval=0 train.sample_tokens=0 train.checkpoint_interval=2 train.out_dir="$fx/run" \
  >"$tmp/fixture.log" 2>&1 || { fail "the fixture's training run"; cat "$tmp/fixture.log"; exit 1; }
step="$fx/run/step-00000002"
# The same checkpoint with its weights as a sharded model (an index and one shard), and a run whose
# optimizer state is sharded (optimizer_index.json listing its file).
cp -r "$step" "$fx/sharded"
mv "$fx/sharded/model.safetensors" "$fx/sharded/model-00001-of-00001.safetensors"
python3 - "$fx/sharded" <<'PY'
import json, struct, sys
d = sys.argv[1]
with open(d + "/model-00001-of-00001.safetensors", "rb") as f:
    n = struct.unpack("<Q", f.read(8))[0]
    names = [k for k in json.loads(f.read(n)) if k != "__metadata__"]
json.dump({"metadata": {}, "weight_map": {k: "model-00001-of-00001.safetensors" for k in names}}, open(d + "/model.safetensors.index.json", "w"))
PY
cp -r "$fx/run" "$fx/run-sharded"
mv "$fx/run-sharded/step-00000002/optimizer.safetensors" "$fx/run-sharded/step-00000002/optimizer-00000.safetensors"
echo '{"files": ["optimizer-00000.safetensors"]}' >"$fx/run-sharded/step-00000002/optimizer_index.json"
"$frugal" account --layers 1 --width 32 --heads 2 --batch 1 --seq 4 --skip-timing --trace-out "$fx/trace.json" >/dev/null 2>&1 ||
  fail "the fixture's trace"
cp recipes/tiny.yaml "$fx/recipe.yaml"
cp tests/data/fixtures/gpt2.json "$fx/tokenizer.json"
cp /usr/share/games/fortunes/computers "$fx/corpus.txt"
printf '1 2 3 4 5 6 7 8 9 10\n' >"$fx/ids.txt"
printf 'A fool and his money are soon parted.\n' >"$fx/text.txt"
printf '{"text": "A fool and his money."}\n{"text": "Are soon parted."}\n' >"$fx/docs.jsonl"
printf '%s\n' '{"prompt": "Say hi.", "completion": " Hi."}' '{"prompt": "Say no.", "completion": " No."}' >"$fx/ex.jsonl"
# Random bytes with a NUL and an escape sequence among them, the same every run.
python3 -c 'import random, sys; r = random.Random(26); sys.stdout.buffer.write(b"\x00\x1b[2J" + bytes(r.randrange(256) for _ in range(4096)))' >"$fx/random.bin"

# The run flags every training row shares: the fixture's tokenizer and sizes, one short step.
run="model.vocab_size=512 schedule.warmup_steps=1 train.eval_interval=0 train.sample_tokens=0 train.checkpoint_interval=0"
gen="--prompt A --tokens 1"

# ---- The table. ROLE | FILE (in the case folder $c) | SETUP (a valid setup in $c) | ARGUMENTS (frugal's) | KINDS
# KINDS: the substitutes the row takes; "all" is fifo devzero folder empty random. A row leaves out
# a kind only where that content is valid input (an empty text is a text).
table=$(cat <<'ROWS'
recipe                 | r.yaml                                           | cp $fx/recipe.yaml $c/r.yaml           | train $c/r.yaml data.tokenizer=$fx/tok.model data.tokens=$fx/f.tokens $run train.steps=2 train.out_dir=$c/out | fifo devzero folder random
data.tokens            | f.tokens                                         | cp $fx/f.tokens $c/                    | train tiny data.tokenizer=$fx/tok.model data.tokens=$c/f.tokens $run train.steps=2 train.out_dir=$c/out | all
corpus text            | corpus.txt                                       | cp $fx/corpus.txt $c/                  | train tiny data.corpus=$c/corpus.txt data.tokenizer=$fx/tok.model data.tokens=$c/new.tokens $run train.steps=2 train.out_dir=$c/out | all
tokenizer.model        | tok.model                                        | cp $fx/tok.model $c/                   | tokenizer encode $c/tok.model hello | fifo devzero empty random
tokenizer.json         | tokenizer.json                                   | cp $fx/tokenizer.json $c/              | tokenizer encode $c/tokenizer.json hello | fifo devzero empty random
tokenizer_config.json  | ckpt/tokenizer_config.json                       | cp -r $step $c/ckpt                    | generate --checkpoint $c/ckpt $gen | all
config.json            | ckpt/config.json                                 | cp -r $step $c/ckpt                    | generate --checkpoint $c/ckpt $gen | all
generation_config.json | ckpt/generation_config.json                      | cp -r $step $c/ckpt                    | generate --checkpoint $c/ckpt $gen | all
model.safetensors      | ckpt/model.safetensors                           | cp -r $step $c/ckpt                    | generate --checkpoint $c/ckpt $gen | all
model index            | ckpt/model.safetensors.index.json                | cp -r $fx/sharded $c/ckpt              | generate --checkpoint $c/ckpt $gen | all
model shard            | ckpt/model-00001-of-00001.safetensors            | cp -r $fx/sharded $c/ckpt              | generate --checkpoint $c/ckpt $gen | all
latest                 | run/latest                                       | cp -r $fx/run $c/run                   | generate --checkpoint $c/run $gen | all
latest on resume       | run/latest                                       | cp -r $fx/run $c/run                   | train tiny data.tokenizer=$fx/tok.model data.tokens=$fx/f.tokens $run train.steps=3 train.out_dir=$c/run --resume | all
trainer_state.json     | run/step-00000002/trainer_state.json             | cp -r $fx/run $c/run                   | train tiny data.tokenizer=$fx/tok.model data.tokens=$fx/f.tokens $run train.steps=3 train.out_dir=$c/run --resume | all
optimizer.safetensors  | run/step-00000002/optimizer.safetensors          | cp -r $fx/run $c/run                   | train tiny data.tokenizer=$fx/tok.model data.tokens=$fx/f.tokens $run train.steps=3 train.out_dir=$c/run --resume | all
optimizer_index.json   | run/step-00000002/optimizer_index.json           | cp -r $fx/run-sharded $c/run           | train tiny data.tokenizer=$fx/tok.model data.tokens=$fx/f.tokens $run train.steps=3 train.out_dir=$c/run --resume | all
optimizer shard        | run/step-00000002/optimizer-00000.safetensors    | cp -r $fx/run-sharded $c/run           | train tiny data.tokenizer=$fx/tok.model data.tokens=$fx/f.tokens $run train.steps=3 train.out_dir=$c/run --resume | all
metrics.jsonl          | run/metrics.jsonl                                | cp -r $fx/run $c/run                   | train tiny data.tokenizer=$fx/tok.model data.tokens=$fx/f.tokens $run train.steps=3 train.out_dir=$c/run --resume | fifo devzero folder
examples jsonl         | ex.jsonl                                         | cp $fx/ex.jsonl $c/                    | tokenizer examples $fx/tok.model --format prompt_completion $c/ex.jsonl | all
eval --tokens          | ids.txt                                          | cp $fx/ids.txt $c/                     | eval --checkpoint $step --tokens $c/ids.txt | all
eval --text            | text.txt                                         | cp $fx/text.txt $c/                    | eval --checkpoint $step --text $c/text.txt | fifo devzero folder empty
eval --jsonl           | docs.jsonl                                       | cp $fx/docs.jsonl $c/                  | eval --checkpoint $step --jsonl $c/docs.jsonl | all
eval --examples        | ex.jsonl                                         | cp $fx/ex.jsonl $c/                    | eval --checkpoint $step --examples $c/ex.jsonl --format prompt_completion | all
encode --text-file     | text.txt                                         | cp $fx/text.txt $c/                    | tokenizer encode $fx/tok.model --text-file $c/text.txt | fifo devzero folder
report's trace         | trace.json                                       | cp $fx/trace.json $c/                  | report $c/trace.json -o $c/report.html | all
ROWS
)

substitute() {  # substitute KIND PATH
  rm -rf "$2"
  case "$1" in
    fifo) mkfifo "$2" ;;
    devzero) ln -s /dev/zero "$2" ;;
    folder) mkdir "$2" ;;
    empty) : >"$2" ;;
    random) cp "$fx/random.bin" "$2" ;;
  esac
}

trim() { local s="$1"; s="${s#"${s%%[![:space:]]*}"}"; printf '%s' "${s%"${s##*[![:space:]]}"}"; }

n=0
while IFS='|' read -r role file setup arguments kinds; do
  role=$(trim "$role"); file=$(trim "$file"); setup=$(trim "$setup"); arguments=$(trim "$arguments"); kinds=$(trim "$kinds")
  [ -z "$role" ] && continue
  [ "$kinds" = all ] && kinds="fifo devzero folder empty random"
  n=$((n + 1))
  # The valid setup first: the command succeeds, so each refusal below is the substitute's.
  c="$tmp/case-$n-valid"
  mkdir -p "$c"
  eval "$setup"
  eval "args=($arguments)"
  timeout -k 5 120 "$frugal" "${args[@]}" >"$c.out" 2>"$c.err"
  got=$?
  if [ "$got" != 0 ]; then fail "$role: the valid setup exited $got: frugal ${args[*]}"; head -n 5 "$c.err"; continue; fi
  rm -rf "$c"
  for kind in $kinds; do
    c="$tmp/case-$n-$kind"
    mkdir -p "$c"
    eval "$setup"
    substitute "$kind" "$c/$file"
    eval "args=($arguments)"
    start=$SECONDS
    timeout -k 5 "$limit" "$frugal" "${args[@]}" >"$c.out" 2>"$c.err" </dev/null
    got=$?
    what="$role as $kind ($((SECONDS - start)) s): frugal ${args[*]}"
    lines=$(wc -l <"$c.err")
    first=$(head -c 300 "$c.err" | LC_ALL=C tr -d '\000-\011\013-\037\177')
    if [ "$got" = 124 ] || [ "$got" = 137 ]; then
      fail "$what did not end within $limit s"
    elif [ "$got" != 2 ]; then
      fail "$what exited $got, expected 2"; head -c 600 "$c.err" | cat -v; echo
    elif [ "$lines" != 1 ]; then
      fail "$what printed $lines lines on stderr, expected one"; head -c 600 "$c.err" | cat -v; echo
    elif [ "$(LC_ALL=C tr -d '\000-\011\013-\037\177' <"$c.err" | wc -c)" != "$(wc -c <"$c.err")" ]; then
      fail "$what printed a control byte: $(cat -v "$c.err")"
    elif [[ "$first" != frugal* ]]; then
      fail "$what printed something other than frugal's error: $first"
    elif ! grep -qF -- "$(basename "$file")" "$c.err"; then
      fail "$what does not name $(basename "$file"): $first"
    else
      ok
    fi
    rm -rf "$c"
  done
done <<<"$table"

# ---- Leftovers: a private TMPDIR stays empty, and no frugal-bench-* or frugal-tokenizer-* folder
# appears in /tmp (where older builds put theirs whatever TMPDIR said).
priv="$tmp/tmpdir"
mkdir -p "$priv"
snapshot() { ls -d /tmp/frugal-bench-* /tmp/frugal-tokenizer-* 2>/dev/null | sort; }
# A folder in /tmp is left over once the process named in it (PREFIX-PID-XXXXXX) has ended: one of a
# live process is another test's, running beside this one.
ended() { local f pid; while read -r f; do pid=${f%-*}; pid=${pid##*-}; [ -e "/proc/$pid" ] || echo "$f"; done; }
left_nothing() {  # left_nothing WHAT BEFORE-FILE
  local now
  now=$(snapshot | comm -13 "$2" - | ended)
  if [ -z "$(ls -A "$priv")" ] && [ -z "$now" ]; then ok; else fail "$1 left $(ls -A "$priv" | tr '\n' ' ')$now"; fi
  rm -rf "${priv:?}"/*
}
snapshot >"$tmp/before"
TMPDIR="$priv" "$frugal" bench train --recipe tiny --steps 2 --rounds 1 data.tokenizer="$fx/tok.model" data.tokens="$fx/f.tokens" \
  model.vocab_size=512 --json-out "$tmp/bench.json" >"$tmp/bench.out" 2>"$tmp/bench.err" ||
  { fail "bench train exited $?"; tail -n 3 "$tmp/bench.err"; }
left_nothing "bench train" "$tmp/before"
TMPDIR="$priv" "$frugal" bench train --recipe tiny data.corpus="$tmp/nosuch" data.tokenizer="$tmp/nosuch.model" data.tokens="$tmp/nosuch.tokens" >/dev/null 2>"$tmp/bench.err"
got=$?
if [ "$got" = 2 ]; then ok; else fail "bench train with a missing corpus exited $got"; fi
left_nothing "bench train refusing a missing corpus" "$tmp/before"
# bench data-parallel whose runs fail (a token file that is not one): the runs' folder goes too.
head -c 100 "$fx/random.bin" >"$tmp/bad.tokens"
TMPDIR="$priv" timeout -k 5 120 "$frugal" bench data-parallel --recipe tiny --steps 2 data.tokenizer="$fx/tok.model" \
  data.tokens="$tmp/bad.tokens" model.vocab_size=512 >/dev/null 2>"$tmp/dp.err"
got=$?
if [ "$got" != 0 ] && [ "$got" != 124 ]; then ok; else fail "bench data-parallel with a bad token file exited $got"; fi
left_nothing "a failed bench data-parallel" "$tmp/before"
# tokenizer train ended by SIGTERM while it trains: its temporary folder goes with it.
python3 -c 'import random; r = random.Random(1); w = ["".join(r.choice("abcdefghij") for _ in range(r.randint(2, 9))) for _ in range(5000)]; open("'"$tmp"'/big.txt", "w").write("\n".join(" ".join(r.choice(w) for _ in range(12)) for _ in range(60000)))'
for sig in TERM HUP; do  # (a background job of a script ignores SIGINT, so its handler is never installed)
  TMPDIR="$priv" "$frugal_exe" tokenizer train "$tmp/big.txt" --out "$tmp/tbig" --vocab-size 4000 >/dev/null 2>&1 &
  pid=$!
  for _ in $(seq 1 200); do compgen -G "$priv/frugal-tokenizer-$pid-*/corpus.txt" >/dev/null && break; sleep 0.05; done
  if compgen -G "$priv/frugal-tokenizer-$pid-*/corpus.txt" >/dev/null; then ok; else fail "tokenizer train made no folder in TMPDIR"; fi
  sleep 0.3
  kill -"$sig" "$pid"
  { wait "$pid"; } 2>/dev/null  # (bash would print the job's "Hangup")
  got=$?
  sleep 0.3
  if [ "$got" -gt 128 ]; then ok; else fail "tokenizer train after SIG$sig exited $got"; fi
  left_nothing "tokenizer train ended by SIG$sig" "$tmp/before"
done

echo "hostile files: $pass passed, $failed failed"
[ "$failed" = 0 ]
