# Sourced by the test scripts that run frugal many times (each start of a `frugal` process loads
# LibTorch: 0.47 s on Debian's 1.13, 0.24 s on the wheel's; cli_test.sh alone starts 169).
#
#   start_frugal_server FRUGAL DIR   sets $frugal to a stand-in for FRUGAL: DIR/bin/frugal, a link to
#                                    frugal_test_client, whose every run is forked from one
#                                    frugal_test_server started here (tests/support/frugal_server.cpp);
#                                    the same arguments, folder, environment, streams and exit status
#   stop_frugal_server               ends it (the server also ends when the script does)
#
# $frugal_exe is FRUGAL itself (absolute): for what needs the program's folder (its helpers) or the
# command's own pid (a kill -9, a folder named by pid), a client and its worker being two processes.
#
# The server is one of the script's background jobs: wait for a command of yours by its pid, never
# with a bare `wait` (it would wait for the server).
#
# FRUGAL_TEST_NO_SERVER=1 (or a build without the two programs) runs FRUGAL itself each time.
#
#   start_frugal_test FRUGAL         the usual start of such a script: $tmp, a folder of its own
#                                    (removed at exit unless KEEP_TMP is set, the server stopped),
#                                    TMPDIR=$tmp/tmpdir (frugal's own temporary folders: a tokenizer
#                                    training removes the folders of dead runs in $TMPDIR, which must
#                                    not be another test's), then start_frugal_server FRUGAL $tmp
start_frugal_test() {
  tmp=$(mktemp -d) || return 1
  trap 'stop_frugal_server; [ -n "${KEEP_TMP:-}" ] || rm -rf "$tmp"' EXIT
  export TMPDIR="$tmp/tmpdir"
  mkdir -p "$TMPDIR" || return 1
  start_frugal_server "$1" "$tmp"
}

start_frugal_server() {
  local real=$1 dir=$2 bin
  bin=$(cd "$(dirname "$real")" && pwd)
  frugal_exe=$bin/$(basename "$real")
  frugal=$frugal_exe
  if [ -n "${FRUGAL_TEST_NO_SERVER:-}" ] || [ ! -x "$bin/frugal_test_server" ] || [ ! -x "$bin/frugal_test_client" ]; then
    return 0
  fi
  mkdir -p "$dir/bin" || return 1
  ln -sf "$bin/frugal_test_client" "$dir/bin/frugal" || return 1
  "$bin/frugal_test_server" --serve "$dir/bin/frugal.sock" </dev/null >"$dir/bin/server.log" 2>&1 &
  frugal_server_pid=$!
  local i
  for ((i = 0; i < 600; ++i)); do  # the socket appears once it listens (up to a minute on a loaded machine)
    if [ -S "$dir/bin/frugal.sock" ]; then
      frugal="$dir/bin/frugal"
      return 0
    fi
    kill -0 "$frugal_server_pid" 2>/dev/null || break
    sleep 0.1
  done
  echo "frugal_test_server did not start: $(cat "$dir/bin/server.log")" >&2
  return 1
}

stop_frugal_server() {
  if [ -n "${frugal_server_pid:-}" ]; then
    kill "$frugal_server_pid" 2>/dev/null
    wait "$frugal_server_pid" 2>/dev/null
    frugal_server_pid=""
  fi
  return 0
}
