#!/usr/bin/env bash
# Data-parallel training end to end (CTest `dist`): 2 ranks on this machine against one process —
# equal losses in each mode, sharded optimizer state, checkpoints across world sizes, the torchrun
# environment contract started by hand, a rank killed with -9, and the rendezvous errors.
set -u
tmp=$(mktemp -d)
trap 'stop_frugal_server; [ -n "${KEEP_TMP:-}" ] || rm -rf "$tmp"; jobs -p | xargs -r kill -9 2>/dev/null' EXIT
# Each `frugal` below is forked from one server that loaded LibTorch once (tests/support/frugal_server.sh);
# a launcher's ranks are programs of their own (it re-executes itself), and so are the ranks started
# by hand here: their OMP_NUM_THREADS=1 must be read as LibTorch loads.
source "$(dirname "$0")/../support/frugal_server.sh"
start_frugal_server "$1" "$tmp" || exit 1
failed=0
pass=0
fail() { echo "FAIL: $*"; failed=$((failed + 1)); }
ok() { pass=$((pass + 1)); }

# The data (tokenizer and tokens) once; each run gets a folder with copies.
"$frugal" train tiny train.steps=6 train.sample_tokens=0 train.out_dir="$tmp/data" --progress lines >"$tmp/data.log" 2>&1 || { cat "$tmp/data.log"; exit 1; }
# corpus.tokens.tokenizer is the token file's tokenizer fingerprint: without it each run would make the tokens again.
newdir() { rm -rf "$1"; mkdir -p "$1"; cp "$tmp/data/tokenizer.model" "$tmp/data/corpus.tokens" "$tmp/data/corpus.tokens.tokenizer" "$1/"; }
common="train.steps=12 train.eval_interval=0 train.sample_tokens=0 train.checkpoint_interval=6"

# same_losses A.json B.json TOL: the losses agree to TOL relative; prints the largest difference.
same_losses() {
  python3 - "$1" "$2" "$3" <<'PY'
import json, sys
a, b = (json.load(open(p))["losses"] for p in sys.argv[1:3])
tol = float(sys.argv[3])
assert len(a) == len(b) and a, (len(a), len(b))
worst = max(abs(x - y) / abs(x) for x, y in zip(a, b))
print(f"  {len(a)} losses, largest relative difference {worst:.2e} (tolerance {tol:g})")
sys.exit(0 if worst <= tol else 1)
PY
}

# 1. One process and two ranks, batch 8, in each mode: the same losses.
configs=(
  "optimizer.in_backward=false"
  "optimizer.in_backward=true"
  "optimizer.in_backward=false optimizer.state_precision=int8"
  "optimizer.in_backward=true optimizer.state_precision=int8"
  "optimizer.in_backward=true memory.checkpointing=full memory.chunked_loss=true"
  "optimizer.in_backward=false memory.checkpointing=every_2 optimizer.clip=global_norm optimizer.max_grad_norm=0.5"
  "optimizer.in_backward=true optimizer.clip=global_norm_two_pass optimizer.max_grad_norm=0.5"
  "optimizer.in_backward=true optimizer.clip=per_param_norm optimizer.max_grad_norm=0.1"
  "optimizer.in_backward=false train.gradient_accumulation_steps=2"
  "optimizer.in_backward=true optimizer.state_precision=int4 optimizer.state_placement=mmap optimizer.state_dir=$tmp/mapped"
)
mkdir -p "$tmp/mapped"
i=0
for cfg in "${configs[@]}"; do
  i=$((i + 1))
  newdir "$tmp/one$i"; newdir "$tmp/two$i"
  # shellcheck disable=SC2086
  "$frugal" train tiny $common $cfg train.out_dir="$tmp/one$i" --progress lines --json-out "$tmp/one$i.json" >"$tmp/one$i.log" 2>&1 \
    || { fail "one process, $cfg"; cat "$tmp/one$i.log"; continue; }
  # shellcheck disable=SC2086
  "$frugal" train tiny $common $cfg train.out_dir="$tmp/two$i" --progress lines --nproc 2 --json-out "$tmp/two$i.json" >"$tmp/two$i.log" 2>&1 \
    || { fail "two ranks, $cfg"; cat "$tmp/two$i.log" "$tmp/two$i/logs/rank-1.log"; continue; }
  echo "$cfg:"
  if same_losses "$tmp/one$i.json" "$tmp/two$i.json" 1e-4; then ok; else fail "losses differ: $cfg"; fi
done

# The copied token file was used as it is, not made again.
if grep -l "remaking it\|tokenized [0-9]* documents" "$tmp"/one*.log "$tmp"/two*.log; then fail "a run made the copied token file again"; else ok; fi

# 2. The state is sharded: the ranks' optimizer state adds up to one process's, each is its
#    estimate, and the JSON says how many ranks there were.
python3 - "$tmp/one1.json" "$tmp/two1.json" "$tmp/one3.json" "$tmp/two3.json" <<'PY' && ok || fail "sharded state bytes"
import json, sys
for one_path, two_path in [(sys.argv[1], sys.argv[2]), (sys.argv[3], sys.argv[4])]:
    one, two = json.load(open(one_path)), json.load(open(two_path))
    assert two["world_size"] == 2, two.get("world_size")
    ranks = [r["optimizer_state"] for r in two["by_category_by_rank"]]
    single = one["by_category"]["optimizer_state"]
    assert sum(ranks) == single, (ranks, single)
    assert all(0 < r < single for r in ranks), ranks
    assert two["by_category"]["optimizer_state"] == ranks[0]
    assert two["estimate"]["by_category"]["optimizer_state"] == ranks[0], (two["estimate"]["by_category"], ranks)
    # half the batch per rank: half the activations
    assert abs(two["by_category"]["activation"] / (one["by_category"]["activation"] / 2) - 1) < 0.01, (two["by_category"], one["by_category"])
    print(f"  optimizer state per rank {ranks} of one process's {single}; rank 0's estimate equal")
PY

# 2b. Rank 0's estimate (its share of the batch, its state, the gradients queued for their
#     averages) against its measured peak, in every configuration.
python3 - "$tmp"/two*.json <<'PY' && ok || fail "rank 0's estimate"
import json, sys
worst = 0
for p in sys.argv[1:]:
    j = json.load(open(p))
    ratio = j["peak_bytes"] / j["estimate"]["peak_bytes"]
    worst = max(worst, abs(ratio - 1))
    assert abs(ratio - 1) < 0.1, (p, ratio, j["by_category"], j["estimate"]["by_category"])
print(f"  rank 0's measured peak within {100 * worst:.1f}% of its estimate in {len(sys.argv) - 1} configurations")
PY

# 3. Checkpoints across world sizes: 2 ranks stop at 6, one process resumes to 12 (and 1 -> 2),
#    on the uninterrupted trajectory; with fp32 state and with int8 state (whose blocks are cut
#    and joined where the slices of a split parameter differ).
for prec in fp32 int8; do
  ref="$tmp/one1.json"; [ "$prec" = int8 ] && ref="$tmp/one3.json"
  p="optimizer.state_precision=$prec"
  newdir "$tmp/r21$prec"
  "$frugal" train tiny $common $p train.out_dir="$tmp/r21$prec" --progress lines --nproc 2 --stop-after 6 >"$tmp/r21a.log" 2>&1 || { fail "2 ranks to step 6"; cat "$tmp/r21a.log"; }
  [ -f "$tmp/r21$prec/step-00000006/optimizer_index.json" ] && [ -f "$tmp/r21$prec/step-00000006/optimizer.rank-00001-of-00002.safetensors" ] && ok \
    || fail "a 2-rank checkpoint has its index and per-rank files"
  "$frugal" train tiny $common $p train.out_dir="$tmp/r21$prec" --progress lines --resume --json-out "$tmp/r21$prec.json" >"$tmp/r21b.log" 2>&1 \
    || { fail "resume 2 -> 1 ($prec)"; cat "$tmp/r21b.log"; }
  newdir "$tmp/r12$prec"
  "$frugal" train tiny $common $p train.out_dir="$tmp/r12$prec" --progress lines --stop-after 6 >"$tmp/r12a.log" 2>&1 || fail "1 process to step 6"
  "$frugal" train tiny $common $p train.out_dir="$tmp/r12$prec" --progress lines --resume --nproc 2 --json-out "$tmp/r12$prec.json" >"$tmp/r12b.log" 2>&1 \
    || { fail "resume 1 -> 2 ($prec)"; cat "$tmp/r12b.log" "$tmp/r12$prec/logs/rank-1.log"; }
  python3 - "$ref" "$tmp/r21$prec.json" "$tmp/r12$prec.json" <<'PY' && ok || fail "resumed runs leave the trajectory ($prec)"
import json, sys
full = json.load(open(sys.argv[1]))["losses"]
for p in sys.argv[2:]:
    j = json.load(open(p))
    assert j["first_step"] == 6, j["first_step"]
    worst = max(abs(x - y) / x for x, y in zip(full[6:], j["losses"]))
    assert len(j["losses"]) == 6 and worst < 1e-4, (j["losses"], full[6:])
    print(f"  {p.split('/')[-1]}: steps 7-12 within {worst:.1e} of the uninterrupted run")
PY
done

# 4. The environment contract, ranks started by hand (as torchrun would): the --nproc run's losses.
newdir "$tmp/hand"
hand=()
port=$(python3 -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])')
for rank in 1 0; do
  RANK=$rank WORLD_SIZE=2 LOCAL_RANK=$rank LOCAL_WORLD_SIZE=2 MASTER_ADDR=127.0.0.1 MASTER_PORT=$port OMP_NUM_THREADS=1 \
    "$frugal_exe" train tiny $common train.out_dir="$tmp/hand" --progress lines --json-out "$tmp/hand$rank.json" >"$tmp/hand$rank.log" 2>&1 &
  hand+=($!)
done
wait "${hand[@]}"  # (not a bare wait: the test server is a job too)
if [ -f "$tmp/hand0.json" ] && [ ! -f "$tmp/hand1.json" ] && same_losses "$tmp/two1.json" "$tmp/hand0.json" 1e-6; then ok; else fail "ranks started by hand"; cat "$tmp/hand0.log" "$tmp/hand1.log"; fi

# 5. A rank killed with -9: the launcher stops the other one promptly, names the rank, and the
#    checkpoint already saved resumes.
newdir "$tmp/kill"
"$frugal" train tiny train.steps=100000 train.checkpoint_interval=5 train.eval_interval=0 train.out_dir="$tmp/kill" --progress lines --nproc 2 \
  >"$tmp/kill.log" 2>"$tmp/kill.err" &
launcher=$!
for _ in $(seq 600); do [ -f "$tmp/kill/latest" ] && break; sleep 0.1; done
victim=$(sed -n 's/.*(pids [0-9]*, \([0-9]*\)).*/\1/p' "$tmp/kill.err" | head -1)
if [ -n "$victim" ] && [ -f "$tmp/kill/latest" ]; then
  start=$(date +%s)
  kill -9 "$victim"
  wait "$launcher"; code=$?
  took=$(( $(date +%s) - start ))
  if [ "$code" != 0 ] && [ "$took" -le 30 ] && grep -q "rank 1 was killed by signal 9" "$tmp/kill.err"; then ok
  else fail "killed rank: exit $code after ${took}s"; cat "$tmp/kill.err"; fi
  echo "  rank 1 killed: the launcher stopped rank 0 and exited $code after ${took}s"
  latest=$(cat "$tmp/kill/latest")
  "$frugal" train tiny train.steps=$(( 10#${latest#step-} + 2 )) train.checkpoint_interval=5 train.eval_interval=0 train.sample_tokens=0 \
    train.out_dir="$tmp/kill" --progress lines --resume >"$tmp/kill2.log" 2>&1 && grep -q "resumed from .*$latest" "$tmp/kill2.log" && ok \
    || { fail "resume after the killed rank"; cat "$tmp/kill2.log"; }
else
  fail "the killed-rank run did not start"; cat "$tmp/kill.err"; kill -9 "$launcher" 2>/dev/null
fi

# 6. Under a launcher of another kind (no supervisor), rank 0 itself ends with one clear line
#    naming rank 1 once rank 1 is killed.
newdir "$tmp/kill0"
port=$(python3 -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])')
env RANK=0 WORLD_SIZE=2 MASTER_ADDR=127.0.0.1 MASTER_PORT=$port OMP_NUM_THREADS=1 "$frugal_exe" train tiny train.steps=100000 train.eval_interval=0 \
  train.checkpoint_interval=0 train.out_dir="$tmp/kill0" --progress lines --dist-timeout 20 >"$tmp/k0.log" 2>"$tmp/k0.err" &
r0=$!
env RANK=1 WORLD_SIZE=2 MASTER_ADDR=127.0.0.1 MASTER_PORT=$port OMP_NUM_THREADS=1 "$frugal_exe" train tiny train.steps=100000 train.eval_interval=0 \
  train.checkpoint_interval=0 train.out_dir="$tmp/kill0" --progress lines --dist-timeout 20 >"$tmp/k1.log" 2>&1 &
r1=$!
for _ in $(seq 600); do grep -q "step 3/" "$tmp/k0.err" 2>/dev/null && break; sleep 0.1; done
start=$(date +%s)
kill -9 $r1
wait $r0; code=$?
wait $r1 2>/dev/null
took=$(( $(date +%s) - start ))
if [ "$code" = 1 ] && [ "$took" -le 25 ] && tail -1 "$tmp/k0.err" | grep -q "rank 1 has probably died"; then ok; else fail "rank 0 after rank 1 died: exit $code after ${took}s"; tail -3 "$tmp/k0.err"; fi
echo "  without a supervisor: rank 0 exited $code after ${took}s: $(tail -1 "$tmp/k0.err" | cut -c1-160)"

# 7. Rendezvous mistakes: a port in use (exit 2), a store nobody hosts (exit 1, within the timeout),
#    a bad variable, and a batch that does not split.
python3 -c 'import socket,time,sys; s=socket.socket(); s.bind(("127.0.0.1", 0)); s.listen(); print(s.getsockname()[1], flush=True); time.sleep(60)' >"$tmp/busy" &
busy=$!
for _ in $(seq 50); do [ -s "$tmp/busy" ] && break; sleep 0.1; done
newdir "$tmp/err"
expect_error() {  # expect_error CODE PATTERN SECONDS -- env... frugal args
  local code=$1 pattern=$2 limit=$3; shift 4
  local start; start=$(date +%s)
  "$@" >"$tmp/e.out" 2>"$tmp/e.err"; local got=$?
  local took=$(( $(date +%s) - start ))
  if [ "$got" = "$code" ] && grep -q -- "$pattern" "$tmp/e.err" && [ "$took" -le "$limit" ]; then ok
  else fail "$* exited $got after ${took}s, expected $code with '$pattern'"; cat "$tmp/e.err"; fi
}
expect_error 2 "MASTER_PORT $(cat "$tmp/busy") is already in use" 30 -- env RANK=0 WORLD_SIZE=2 MASTER_ADDR=127.0.0.1 MASTER_PORT="$(cat "$tmp/busy")" \
  "$frugal" train tiny train.out_dir="$tmp/err" --progress lines
kill $busy 2>/dev/null
port=$(python3 -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])')
expect_error 1 "could not reach the rendezvous store at 127.0.0.1:$port within 3 s" 20 -- env RANK=1 WORLD_SIZE=2 MASTER_ADDR=127.0.0.1 MASTER_PORT="$port" \
  "$frugal" train tiny train.out_dir="$tmp/err" --progress lines --dist-timeout 3
expect_error 2 "the environment variable RANK must be an integer from 0 to 1, not .5." 10 -- env RANK=5 WORLD_SIZE=2 MASTER_ADDR=127.0.0.1 MASTER_PORT=1234 \
  "$frugal" train tiny train.out_dir="$tmp/err"
expect_error 2 "MASTER_ADDR must be set" 10 -- env -u MASTER_ADDR RANK=0 WORLD_SIZE=2 MASTER_PORT=1234 "$frugal" train tiny train.out_dir="$tmp/err"
expect_error 2 "train.batch_size 8 does not split evenly over 3 ranks" 10 -- "$frugal" train tiny train.out_dir="$tmp/err" --nproc 3
expect_error 2 "leave it out when a launcher" 10 -- env RANK=0 WORLD_SIZE=1 "$frugal" train tiny train.out_dir="$tmp/err" --nproc 2

echo "dist test: $pass passed, $failed failed"
[ "$failed" = 0 ]
