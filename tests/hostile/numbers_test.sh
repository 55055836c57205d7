#!/usr/bin/env bash
# Hostile numbers (CTest `hostile_numbers`): every numeric flag of every command, every numeric
# environment variable, and the network's failures, tried as a hostile user would.
#
# The flags are found, not listed: every command and subcommand named by the help texts
# (`frugal --help`'s commands, `frugal bench --help`'s benchmarks, `frugal tokenizer --help`'s
# actions), and in each one's --help every flag whose metavar is numeric (N, X, P, SECONDS, BYTES),
# with the range its help states. So the next numeric flag is tried without editing this file.
# Each gets the integers just outside its stated range and one of the junk values ("abc", "1x",
# blanks, hex, inf, nan, 1e300, numbers past int64_t; dealt round the flags so that each value
# meets several; HOSTILE_FULL=1 gives every value to every flag, about 15 minutes on 2 cores);
# each must end within seconds with exit code 2, exactly one line on stderr naming the flag and
# stating that range, nothing on stdout, and no file made (each runs in an empty folder, train's
# out_dir inside it). Recipe values and the flags that hold lists of numbers get a few of their own.
# The environment variables are listed (getenv has no help text), and the list is checked against
# every getenv in the sources, so a new variable fails here until it is classed numeric or text.
# Then the network: a port in use and a GLOO_SOCKET_IFNAME that names no interface (one line each,
# none of c10d's or Gloo's own text), and a listener that is not a c10d store (bounded by
# --dist-timeout 3: done within 10 s with one line).
#   tests/hostile/numbers_test.sh build/frugal
set -u
src=$(cd "$(dirname "$0")/../.." && pwd)
server_dir=$(mktemp -d)
trap 'stop_frugal_server; rm -rf "$server_dir"' EXIT
# Each `frugal` below is forked from one server that loaded LibTorch once (tests/support/frugal_server.sh).
source "$src/tests/support/frugal_server.sh"
start_frugal_server "$(readlink -f "$1")" "$server_dir" || exit 1
python3 - "$frugal" "$src" <<'PY'
import atexit, os, re, shutil, socket, subprocess, sys, tempfile, threading, time
from concurrent.futures import ThreadPoolExecutor

frugal, src = sys.argv[1], sys.argv[2]
tmp = tempfile.mkdtemp(prefix="frugal-hostile-numbers-")
atexit.register(shutil.rmtree, tmp, True)
failures, passes = [], [0]
lock = threading.Lock()

def fail(msg):
    with lock:
        failures.append(msg)
        print("FAIL: " + msg, flush=True)

def ok():
    with lock:
        passes[0] += 1

def run(args, env=None, cwd=None, limit=20):
    e = dict(os.environ)
    e.pop("WORLD_SIZE", None)
    e.update(env or {})
    start = time.monotonic()
    try:
        p = subprocess.run(["timeout", "-k", "5", str(limit), frugal] + args, env=e, cwd=cwd, capture_output=True, text=True,
                           errors="replace")
        return p.returncode, p.stdout, p.stderr, time.monotonic() - start
    except Exception as ex:  # noqa
        return -1, "", str(ex), time.monotonic() - start

def help_text(cmd):
    code, out, err, _ = run(cmd + ["--help"])
    if code != 0:
        fail(f"frugal {' '.join(cmd)} --help exited {code}: {err.strip()[:200]}")
    return out

# 1. Every command and subcommand the help texts name.
def section(text, title):
    names, inside = [], False
    for line in text.splitlines():
        if line.strip() == title:
            inside = True
            continue
        if inside:
            if not line.strip():
                break
            m = re.match(r"^  ([a-z][a-z-]*)\s", line)
            if m:
                names.append(m.group(1))
    return names

commands = []
for c in section(help_text([]), "commands:"):
    text = help_text([c])
    subs = section(text, "benchmarks:")
    subs += [s for s in dict.fromkeys(re.findall(rf"^(?:usage: |\s+)frugal {c} ([a-z][a-z-]*)\b", text, re.M)) if s not in subs]
    commands += [[c, s] for s in subs] if subs else [[c]]
if len(commands) < 12:
    fail(f"only {len(commands)} commands found in the help texts: {commands}")

# 2. Their numeric flags, with the ranges the help states.
NUMERIC = {"N", "X", "P", "SECONDS", "BYTES"}
RANGE = re.compile(r"\((an integer|a number|a byte count) from (\S+) to ([0-9.e+-]+)")
flags = []  # (command, flag, kind, lo, hi)
for cmd in commands:
    lines = help_text(cmd).splitlines()
    for i, line in enumerate(lines):
        m = re.match(r"^  (?:-\w, )?--([a-z0-9-]+)(?: (\S+))?$", line)
        if not m:
            continue
        name, metavar = m.group(1), m.group(2)
        described = lines[i + 1] if i + 1 < len(lines) else ""
        r = RANGE.search(described)
        if (metavar in NUMERIC) != bool(r):
            fail(f"frugal {' '.join(cmd)} --{name} {metavar}: a numeric metavar and a stated range go together: {described.strip()}")
            continue
        if r:
            flags.append((cmd, name, r.group(1), r.group(2), r.group(3)))
print(f"hostile numbers: {len(commands)} commands, {len(flags)} numeric flags", flush=True)
if len(flags) < 30:
    fail(f"only {len(flags)} numeric flags found: the help texts' format changed?")

JUNK = ["abc", "1x", "x1", "", " 1", "1 ", "0x10", "inf", "-inf", "nan", "1e300", "-1e300", "9223372036854775807",
        "-9223372036854775809", "99999999999999999999"]

def outside(kind, lo, hi):
    """Values just outside [lo, hi] as the help states it."""
    vals = []
    if kind == "an integer":
        lo, hi = int(lo), int(hi)
        vals += [str(lo - 1), str(hi + 1)]
    elif kind == "a number":
        lo, hi = float(lo), float(hi)
        vals += [repr(lo - max(1.0, abs(lo))), repr(hi * 2 + 1)]
    else:
        vals += [str(int(hi) + 1)] + ([str(int(lo) - 1)] if int(lo) > 0 else [])
    return vals

def in_range(kind, lo, hi, v):
    """Whether v is a canonical number inside [lo, hi] (anything else must be refused)."""
    if re.fullmatch(r"-?[0-9]+", v):
        x = int(v)
    elif kind == "a number" and re.fullmatch(r"-?[0-9]*\.?[0-9]+(e[-+]?[0-9]+)?", v):
        x = float(v)
        if x in (float("inf"), float("-inf")):
            return False
    else:
        return False
    return (int(lo) <= x <= int(hi)) if kind != "a number" else (float(lo) <= x <= float(hi))

def base_args(cmd, folder):
    # train reads a real recipe, so a value let through would start work that shows.
    return ["tiny", "train.out_dir=" + os.path.join(folder, "out")] if cmd == ["train"] else []

def check_refusal(label, args, name, range_text, env=None):
    folder = tempfile.mkdtemp(dir=tmp)
    code, out, err, took = run(args(folder) if callable(args) else args, env=env, cwd=folder)
    lines = [l for l in err.splitlines() if l.strip()]
    problems = []
    if code != 2:
        problems.append(f"exit {code}")
    if len(lines) != 1:
        problems.append(f"{len(lines)} lines on stderr")
    elif name not in lines[0] or (range_text and range_text not in lines[0]):
        problems.append("the line does not name " + name + (" and state '" + range_text + "'" if range_text else ""))
    if out.strip():
        problems.append("output on stdout")
    if os.listdir(folder):
        problems.append("made " + ", ".join(os.listdir(folder)))
    if took > 15:
        problems.append(f"took {took:.0f} s")
    if problems:
        fail(f"{label}: " + "; ".join(problems) + " | " + err.strip()[:300])
    else:
        ok()

# Every flag gets the integers just outside its range; the junk values (numbers past int64_t and
# double among them) are dealt round the flags, one each, so each value meets three flags
# (HOSTILE_FULL=1: every value on every flag, about 15 minutes on 2 cores).
full = os.environ.get("HOSTILE_FULL") == "1"
cases = []
for i, (cmd, name, kind, lo, hi) in enumerate(flags):
    range_text = f"{kind} from {lo} to {hi}"
    values = JUNK if full else [JUNK[i % len(JUNK)]]
    for v in dict.fromkeys(values + outside(kind, lo, hi)):
        if in_range(kind, lo, hi, v):
            continue
        label = f"frugal {' '.join(cmd)} --{name} {v!r}"
        cases.append((label, lambda f, cmd=cmd, name=name, v=v: cmd + base_args(cmd, f) + [f"--{name}={v}"], f"--{name}", range_text, None))

# Flags that carry numbers in a text of their own.
for v in ["1,x", "1,,2", "-1", "1,", "99999999999999999999", "1e3"]:
    cases.append((f"frugal train --trace-steps {v!r}", lambda f, v=v: ["train", "tiny", "train.out_dir=" + f + "/out", "--trace-steps", v],
                  "--trace-steps", "an integer from 0 to", None))
for v in ["1,x", "99999999999", "-1", "1e3"]:
    cases.append((f"frugal generate --prompt-ids {v!r}", ["generate", "--checkpoint", "/nonexistent", "--prompt-ids", v], "--prompt-ids", "",
                  None))
# Recipe values: the same parser, the range in the message.
for key, v in [("train.steps", "1x"), ("train.steps", "99999999999999999999"), ("optimizer.lr", "inf"), ("optimizer.lr", "nan"),
               ("optimizer.lr", "1e300"), ("model.dim", "0x10"), ("memory.activation_budget", "0x10"),
               ("memory.checkpointing", "every_99999999999999999999"), ("train.device", "cuda:99999999999")]:
    cases.append((f"frugal train tiny {key}={v}", lambda f, key=key, v=v: ["train", "tiny", "train.out_dir=" + f + "/out", f"{key}={v}"], key,
                  "" if key in ("memory.checkpointing", "train.device") else " from ", None))

# 3. Numeric environment variables, on the commands that read them. Every getenv in the sources
#    must be classed here.
NUMERIC_ENV = {"MASTER_PORT", "WORLD_SIZE", "RANK", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "FRUGAL_NUM_THREADS", "COLUMNS"}
TEXT_ENV = {"MASTER_ADDR", "GLOO_SOCKET_IFNAME", "TMPDIR", "FRUGAL_CPU_KERNELS", "FRUGAL_CUDA", "FRUGAL_SPM_PARENT",
            "FRUGAL_TEST_KILL_AFTER_WRITING",
            # glibc's own (it parses them at start); frugal only asks whether they are set, to leave
            # the heap settings they make as they are (memory::keep_freed_heap)
            "GLIBC_TUNABLES", "MALLOC_MMAP_THRESHOLD_", "MALLOC_TRIM_THRESHOLD_"}
read = set()
for root in ("src", "apps"):
    for d, _, files in os.walk(os.path.join(src, root)):
        for f in files:
            if f.endswith((".cpp", ".h")):
                text = open(os.path.join(d, f), errors="replace").read()
                read |= set(re.findall(r'getenv\("([A-Za-z_0-9]+)"\)', text))
                # getenv(env) over a list: the tokenizer's HF_HOME-like lookups name them in strings nearby
for v in sorted(read - NUMERIC_ENV - TEXT_ENV):
    fail(f"getenv(\"{v}\") is read but not classed in tests/hostile/numbers_test.sh (numeric: add its bad values; text: TEXT_ENV)")

dist = {"WORLD_SIZE": "2", "RANK": "0", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "29999"}
BAD = ["abc", "1x", "", " 1", "-1", "1e300", "inf", "nan", "9223372036854775807", "99999999999999999999"]
env_cases = {
    "WORLD_SIZE": (["5000", "0"], "from 1 to 4096"),
    "RANK": (["2"], "from 0 to 1"),
    "LOCAL_RANK": (["2"], "from 0 to 1"),
    "LOCAL_WORLD_SIZE": (["3", "0"], "from 1 to 2"),
    "MASTER_PORT": (["0", "65536", "70000"], "from 1 to 65535"),
}
for j, (var, (extra, range_text)) in enumerate(env_cases.items()):
    values = BAD if full else [BAD[(3 * j + k) % len(BAD)] for k in range(3)]
    for v in dict.fromkeys(values + extra):
        if v == "" and var in ("WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE"):
            continue  # unset or empty: WORLD_SIZE means one process; the locals default from RANK
        env = dict(dist, **{var: v})
        range_text_here = "must be set" if v == "" else range_text
        cases.append((f"{var}={v!r} frugal train tiny", lambda f: ["train", "tiny", "train.out_dir=" + f + "/out"], var, range_text_here, env))
# MASTER_PORT where a launcher reads it (--nproc, bench data-parallel), FRUGAL_NUM_THREADS (read by
# any command's bf16 products, and a rank's threads) on a few commands.
for k, v in enumerate([x for x in BAD if x] + ["0", "65536"]):
    if full or k % 3 == 0:
        cases.append((f"MASTER_PORT={v!r} frugal train tiny --nproc 2",
                      lambda f: ["train", "tiny", "train.out_dir=" + f + "/out", "--nproc", "2"], "MASTER_PORT", "from 1 to 65535",
                      {"MASTER_PORT": v}))
    if full or k % 3 == 1:
        cases.append((f"MASTER_PORT={v!r} frugal bench data-parallel", lambda f: ["bench", "data-parallel", "train.out_dir=" + f + "/out"],
                      "MASTER_PORT", "from 1 to 65535", {"MASTER_PORT": v}))
for k, v in enumerate([x for x in BAD if x] + ["0", "5000"]):
    for m, args in enumerate((["train", "tiny"], ["account"], ["bench", "chunked-loss"])):
        if not (full or m == 0 or k % 3 == m):
            continue
        a = list(args)
        cases.append((f"FRUGAL_NUM_THREADS={v!r} frugal {' '.join(a)}",
                      lambda f, a=a: a + (["train.out_dir=" + f + "/out"] if a[0] == "train" else []),
                      "FRUGAL_NUM_THREADS", "from 1 to 4096", {"FRUGAL_NUM_THREADS": v}))

with ThreadPoolExecutor(max_workers=4) as pool:
    list(pool.map(lambda c: check_refusal(*c), cases))
print(f"hostile numbers: {len(cases)} refusals tried", flush=True)

# COLUMNS is a terminal's hint, read by the training bar: a bad one is ignored, as terminals do
# (train_progress.cpp reads it with the same parser, so "80x" is not 80); nothing to refuse here.

# 4. The network: one frugal line, no library text, bounded by --dist-timeout.
LIBRARY = re.compile(r"socket\.cpp|Logging before InitGoogleLogging|ifa != nullptr|enforce fail|\[c10d\]|^[WEIF]\d{4} |^\[[WEI] ", re.M)

def listener(answer):
    s = socket.socket()
    s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    s.bind(("127.0.0.1", 0))
    s.listen(16)
    held = []
    def serve():
        while True:
            try:
                c, _ = s.accept()
            except OSError:
                return
            held.append(c)  # accepts, never answers
    if answer:
        threading.Thread(target=serve, daemon=True).start()
    return s, s.getsockname()[1]

def network_case(label, env, args, code_expected, pattern, limit):
    folder = tempfile.mkdtemp(dir=tmp)
    code, out, err, took = run(["train", "tiny", "train.out_dir=" + folder + "/out", "--progress", "lines"] + args, env=env, cwd=folder,
                               limit=limit + 10)
    lines = [l for l in err.splitlines() if l.strip()]
    problems = []
    if code != code_expected:
        problems.append(f"exit {code}, expected {code_expected}")
    if len(lines) != 1:
        problems.append(f"{len(lines)} lines on stderr")
    if not re.search(pattern, err):
        problems.append(f"no '{pattern}'")
    if LIBRARY.search(err):
        problems.append("the libraries' own text reached stderr")
    if took > limit:
        problems.append(f"took {took:.1f} s (limit {limit})")
    if problems:
        fail(f"{label}: " + "; ".join(problems) + " | " + err.strip()[:500])
    else:
        ok()
    print(f"  {label}: exit {code} after {took:.1f} s: {err.strip()[:200]}", flush=True)

busy, port = listener(answer=False)  # bound and listening: rank 0 cannot host the store there
network_case("port in use", dict(dist, MASTER_PORT=str(port)), ["--dist-timeout", "3"], 2, f"MASTER_PORT {port} is already in use", 15)
busy.close()
network_case("GLOO_SOCKET_IFNAME=nosuchif0", dict(dist, GLOO_SOCKET_IFNAME="nosuchif0"), ["--dist-timeout", "3"], 2,
             "GLOO_SOCKET_IFNAME names 'nosuchif0', which is not a network interface", 10)
s = socket.socket(); s.bind(("127.0.0.1", 0)); free = s.getsockname()[1]; s.close()
network_case("no store listening", dict(dist, RANK="1", MASTER_PORT=str(free)), ["--dist-timeout", "3"], 1,
             f"could not reach the rendezvous store at 127.0.0.1:{free}", 12)
foreign, port = listener(answer=True)
network_case("a listener that is not a store", dict(dist, RANK="1", MASTER_PORT=str(port)), ["--dist-timeout", "3"], 1,
             f"127.0.0.1:{port}.*not rank 0's c10d store", 10)
foreign.close()

print(f"hostile numbers: {passes[0]} passed, {len(failures)} failed", flush=True)
sys.exit(1 if failures else 0)
PY
