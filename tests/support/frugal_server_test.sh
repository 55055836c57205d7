#!/usr/bin/env bash
# The test scripts' stand-in for frugal (tests/support/frugal_server.sh) against the program itself:
# the same output, exit code and files for a command run in another folder, with another
# environment, umask and standard input; a signal to the stand-in ends the command as it ends the
# program (SIGTERM: the same exit status), and a stand-in killed with -9 takes its command along.
#   bash tests/support/frugal_server_test.sh build/frugal
set -u
source "$(dirname "$0")/frugal_server.sh"
start_frugal_test "$1" || exit 1
if [ "$frugal" = "$frugal_exe" ]; then echo "no test server in this build (or FRUGAL_TEST_NO_SERVER set): nothing to compare"; exit 0; fi
failed=0 pass=0
ok() { pass=$((pass + 1)); }
fail() { echo "FAIL: $*"; failed=$((failed + 1)); }

# Output, exit code, folder, environment, umask and stdin: each run of `account` writes its JSON to a
# relative path (its folder made under umask 077); a bad FRUGAL_NUM_THREADS it must see; a bad command with input.
for who in exe stand-in; do
  prog=$frugal_exe; [ "$who" = stand-in ] && prog=$frugal
  mkdir -p "$tmp/$who"
  (cd "$tmp/$who" && umask 077 && "$prog" account --layers 1 --width 64 --heads 2 --batch 2 --seq 8 --skip-timing --json-out made/out.json \
    </dev/null >stdout 2>stderr; echo $? >code)
  (cd "$tmp/$who" && FRUGAL_NUM_THREADS=abc "$prog" account --layers 1 >/dev/null 2>bad-env; echo $? >bad-env-code)
  (cd "$tmp/$who" && printf 'x' | "$prog" frobnicate >/dev/null 2>bad-command; echo $? >bad-command-code)
done
for f in code stdout bad-env bad-env-code bad-command bad-command-code; do
  if cmp -s "$tmp/exe/$f" "$tmp/stand-in/$f"; then ok; else fail "$f differs: $(head -c 200 "$tmp/exe/$f") / $(head -c 200 "$tmp/stand-in/$f")"; fi
done
[ "$(cat "$tmp/stand-in/bad-env-code")" = 2 ] && ok || fail "a bad FRUGAL_NUM_THREADS was not seen by the command"
# the folder the JSON's path names, made by the command in its own folder under its umask
if [ -f "$tmp/stand-in/made/out.json" ] && [ "$(stat -c %a "$tmp/stand-in/made")" = 700 ] && [ "$(stat -c %a "$tmp/exe/made")" = 700 ]; then ok
else fail "the folder made in the command's folder with its umask: $(stat -c %a "$tmp"/*/made 2>&1 | tr '\n' ' ')"; fi

# A long run: SIGTERM to the stand-in ends it with the program's own status; -9 to the stand-in
# leaves no command running.
long=(train tiny train.steps=100000 train.eval_interval=0 train.checkpoint_interval=0 train.sample_tokens=0 --progress lines)
"$frugal_exe" train tiny train.steps=6 train.sample_tokens=0 train.out_dir="$tmp/data" >"$tmp/data.log" 2>&1 || { cat "$tmp/data.log"; exit 1; }
long+=(data.tokenizer="$tmp/data/tokenizer.model" data.tokens="$tmp/data/corpus.tokens")
for who in exe stand-in; do
  prog=$frugal_exe; [ "$who" = stand-in ] && prog=$frugal
  "$prog" "${long[@]}" train.out_dir="$tmp/term-$who" >"$tmp/term-$who.log" 2>&1 &
  pid=$!
  for _ in $(seq 1 600); do grep -q "step 10/" "$tmp/term-$who.log" 2>/dev/null && break; sleep 0.1; done
  kill -TERM "$pid"
  wait "$pid"
  echo $? >"$tmp/term-$who.code"
done
if cmp -s "$tmp/term-exe.code" "$tmp/term-stand-in.code"; then ok; else fail "after SIGTERM: the program exited $(cat "$tmp/term-exe.code"), the stand-in $(cat "$tmp/term-stand-in.code")"; fi
"$frugal" "${long[@]}" train.out_dir="$tmp/killed" >"$tmp/killed.log" 2>&1 &
pid=$!
for _ in $(seq 1 600); do grep -q "step 10/" "$tmp/killed.log" 2>/dev/null && break; sleep 0.1; done
kill -9 "$pid"
wait "$pid" 2>/dev/null
for _ in $(seq 1 50); do pgrep -f "train.out_dir=$tmp/killed" >/dev/null || break; sleep 0.1; done
if pgrep -f "train.out_dir=$tmp/killed" >/dev/null; then fail "the command outlived its killed stand-in"; pkill -9 -f "train.out_dir=$tmp/killed"; else ok; fi

echo "test server: $pass passed, $failed failed"
[ "$failed" = 0 ]
