#!/usr/bin/env bash
# The HTML report in a real browser: two traces from `frugal account` become one page that headless
# Chromium loads with no console output and no script errors, draws both charts (the page marks
# body[data-rendered]), shows as a screenshot that is not blank, and shows values on hover. Chromium is a required test
# dependency (scripts/setup.sh installs it), so a missing one fails the test.
set -u
frugal="$1"
tmp=$(mktemp -d)
trap '[ -n "${KEEP_TMP:-}" ] || rm -rf "$tmp"' EXIT
failed=0
pass=0

check() {  # check DESCRIPTION COMMAND...: counts a pass or prints the failure
  local what=$1
  shift
  if "$@"; then pass=$((pass + 1)); else echo "FAIL: $what"; failed=$((failed + 1)); fi
}

chromium_bin=$(command -v chromium || command -v chromium-browser || true)
if [ -z "$chromium_bin" ]; then
  echo "FAIL: chromium is not installed (scripts/setup.sh installs it: apt-get install chromium)"
  echo "0 passed, 1 failed"
  exit 1
fi

# Two small traces: a plain account run, and one that also plans and measures an activation budget.
sizes=(--layers 2 --width 32 --heads 2 --batch 2 --seq 8 --skip-timing)
"$frugal" account "${sizes[@]}" --json-out "$tmp/a_account.json" --trace-out "$tmp/a.json" >"$tmp/a.log" 2>&1
check "frugal account --trace-out a.json" test $? = 0
"$frugal" account "${sizes[@]}" --budget 40KiB --json-out "$tmp/b_account.json" --trace-out "$tmp/b.json" >"$tmp/b.log" 2>&1
check "frugal account --budget 40KiB --trace-out b.json" test $? = 0

"$frugal" report "$tmp/a.json" "$tmp/b.json" -o "$tmp/r.html" >"$tmp/report.log" 2>&1
check "frugal report a.json b.json -o r.html" grep -q "wrote $tmp/r.html (2 traces, [0-9]* events)" "$tmp/report.log"
[ "$failed" = 0 ] || { cat "$tmp"/*.log; echo "$pass passed, $failed failed"; exit 1; }

# The command line's mistakes: one line, exit code 2.
"$frugal" report "$tmp/a.json" "$tmp/b.json" --memory-viz "$tmp/x.pickle" >/dev/null 2>"$tmp/err"
check "--memory-viz with two traces is a usage error" test $? = 2
check "--memory-viz with two traces says why" grep -q "memory-viz takes exactly one trace, got 2" "$tmp/err"
"$frugal" report "$tmp/a.json" "$tmp/nonexistent.json" -o "$tmp/y.html" >/dev/null 2>"$tmp/err"
check "a missing trace is a usage error naming it" grep -q "trace $tmp/nonexistent.json cannot be read" "$tmp/err"

browser=("$chromium_bin" --headless --no-sandbox --disable-gpu --disable-dev-shm-usage --disable-background-networking
         --no-first-run --user-data-dir="$tmp/profile" --virtual-time-budget=5000 --enable-logging=stderr --v=0)
url="file://$tmp/r.html"

timeout 120 "${browser[@]}" --dump-dom "$url" >"$tmp/dom.html" 2>"$tmp/browser.log"
check "chromium --dump-dom exits 0" test $? = 0
rendered=$(grep -o 'data-rendered="[0-9]*"' "$tmp/dom.html" | head -n 1)
check "both charts drawn (got '${rendered:-no data-rendered}')" test "$rendered" = 'data-rendered="2"'
errors=$(python3 -c 'import re,sys; m = re.search(r"<div id=\"errors\"[^>]*>(.*?)</div>", open(sys.argv[1]).read(), re.S); print(m.group(1) if m else "no errors element")' "$tmp/dom.html")
check "no script errors on the page (got '$errors')" test -z "$errors"
# The page writes nothing to the console, so any console line is an error or a warning.
if grep -E "CONSOLE|Uncaught" "$tmp/browser.log"; then check "no console output" false; else pass=$((pass + 1)); fi

timeout 120 "${browser[@]}" --screenshot="$tmp/shot.png" --window-size=1400,1000 "$url" >/dev/null 2>"$tmp/shot.log"
check "chromium --screenshot exits 0" test $? = 0
check "the screenshot shows the charts" python3 - "$tmp/shot.png" <<'PY'
# Decodes the PNG with the standard library only (zlib + struct) and checks it is not blank: enough
# pixels differ from the most common colour, there are several colours, and the parameter layer's
# blue (every training trace has parameters) covers a visible area.
import collections, struct, sys, zlib

def read_png(path):
    data = open(path, "rb").read()
    assert data[:8] == b"\x89PNG\r\n\x1a\n", "not a PNG"
    pos, idat, header = 8, b"", None
    while pos < len(data):
        length, kind = struct.unpack(">I4s", data[pos:pos + 8])
        body = data[pos + 8:pos + 8 + length]
        if kind == b"IHDR":
            header = struct.unpack(">IIBBBBB", body)
        elif kind == b"IDAT":
            idat += body
        pos += 12 + length
    width, height, depth, colour, _, _, interlace = header
    assert depth == 8 and colour in (2, 6) and interlace == 0, f"unexpected PNG format {header}"
    channels = 3 if colour == 2 else 4
    raw, stride = zlib.decompress(idat), width * channels
    rows, prev = [], bytearray(stride)
    for y in range(height):
        start = y * (stride + 1)
        kind, line = raw[start], bytearray(raw[start + 1:start + 1 + stride])
        for i in range(stride):
            a = line[i - channels] if i >= channels else 0
            b = prev[i]
            c = prev[i - channels] if i >= channels else 0
            if kind == 1: line[i] = (line[i] + a) & 255
            elif kind == 2: line[i] = (line[i] + b) & 255
            elif kind == 3: line[i] = (line[i] + (a + b) // 2) & 255
            elif kind == 4:
                p = a + b - c
                pa, pb, pc = abs(p - a), abs(p - b), abs(p - c)
                line[i] = (line[i] + (a if pa <= pb and pa <= pc else b if pb <= pc else c)) & 255
        rows.append(bytes(line))
        prev = line
    return width, height, channels, rows

width, height, channels, rows = read_png(sys.argv[1])
counts = collections.Counter()
for row in rows:
    for x in range(0, len(row), channels):
        counts[row[x:x + 3]] += 1
total = width * height
background, background_count = counts.most_common(1)[0]
other = 1 - background_count / total
colours = sum(1 for n in counts.values() if n >= 100)
parameter_blue = counts[bytes((0x4e, 0x79, 0xa7))] / total
print(f"screenshot {width}x{height}: {other:.1%} not background, {colours} colours, parameter blue {parameter_blue:.1%}")
ok = other > 0.02 and colours >= 6 and parameter_blue > 0.005
sys.exit(0 if ok else 1)
PY

# Hover: a page that holds the report in a frame moves the mouse over the first chart and reads the
# readout back (file pages may read each other only with --allow-file-access-from-files).
cat >"$tmp/hover.html" <<'HTML'
<!DOCTYPE html>
<html><body>
<iframe id="report" src="r.html" style="width: 1400px; height: 1000px"></iframe>
<pre id="result">not run</pre>
<script>
document.getElementById('report').addEventListener('load', function () {
  var out = document.getElementById('result');
  try {
    var page = this.contentDocument, canvas = page.querySelector('canvas'), r = canvas.getBoundingClientRect();
    canvas.dispatchEvent(new MouseEvent('mousemove', { clientX: r.left + r.width * 0.6, clientY: r.top + r.height / 2 }));
    var tip = page.querySelector('.tip');
    out.textContent = 'display=' + tip.style.display + ' text=' + tip.textContent;
  } catch (e) {
    out.textContent = 'error: ' + e;
  }
});
</script>
</body></html>
HTML
timeout 120 "${browser[@]}" --allow-file-access-from-files --dump-dom "file://$tmp/hover.html" >"$tmp/hover_dom.html" 2>/dev/null
hover=$(python3 -c 'import html,re,sys; m = re.search(r"<pre id=\"result\">(.*?)</pre>", open(sys.argv[1]).read(), re.S); print(html.unescape(m.group(1)) if m else "no result")' "$tmp/hover_dom.html")
# the readout: time, step and phase, the total and each category's bytes at that moment
check "hovering a chart shows its values (got '$hover')" python3 -c '
import re, sys
text = sys.argv[1]
ok = text.startswith("display=block") and re.search(r"[0-9.]+ ms . step (none|[0-9]+) . \w+", text) \
     and re.search(r"total[0-9.]+ (B|KiB|MiB)", text) and re.search(r"parameter[0-9.]+ (B|KiB|MiB)", text)
sys.exit(0 if ok else 1)' "$hover"

if [ "$failed" != 0 ]; then
  echo "--- chromium's log"; grep -v -E "dbus|bluez|vaapi|sandbox_linux|idle_linux|property.cc" "$tmp/browser.log" | tail -n 20
fi
echo "$pass passed, $failed failed"
[ "$failed" = 0 ]
