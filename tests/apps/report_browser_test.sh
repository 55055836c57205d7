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
check "a missing trace is a usage error naming it" grep -q "trace $tmp/nonexistent.json does not exist" "$tmp/err"

browser=("$chromium_bin" --headless --no-sandbox --disable-gpu --disable-dev-shm-usage --disable-background-networking
         --no-first-run --user-data-dir="$tmp/profile" --virtual-time-budget=5000 --enable-logging=stderr --v=0)
url="file://$tmp/r.html"

timeout 120 "${browser[@]}" --dump-dom "$url" >"$tmp/dom.html" 2>"$tmp/browser.log"
check "chromium --dump-dom exits 0" test $? = 0
rendered=$(grep -o 'data-rendered="[0-9]*"' "$tmp/dom.html" | head -n 1)
check "both charts drawn (got '${rendered:-no data-rendered}')" test "$rendered" = 'data-rendered="2"'
errors=$(python3 -c 'import re,sys; m = re.search(r"<div id=\"errors\"[^>]*>(.*?)</div>", open(sys.argv[1]).read(), re.S); print(m.group(1) if m else "no errors element")' "$tmp/dom.html")
check "no script errors on the page (got '$errors')" test -z "$errors"
# Each hump of frugal account's chart is named after its experiment, in the order they ran.
labels=$(python3 -c 'import html,re,sys; print(";".join(html.unescape(m) for m in re.findall(r"<canvas[^>]*data-labels=\"([^\"]*)\"", open(sys.argv[1]).read())))' "$tmp/dom.html")
check "the account's experiments are labelled on the charts (got '$labels')" python3 -c '
import sys
a, b = sys.argv[1].split(";")
# On LibTorch 2.x the account also runs attention through sdpa, after the policies.
sys.exit(0 if a in ("set-up,none,full,every_2,selective", "set-up,none,full,every_2,selective,attention sdpa")
         and "budget 40.0 KiB" in b.split(",") else 1)' "$labels"
# A training run's final evaluation and sample are named on its chart too.
"$frugal" train tiny data.tokenizer="$tmp/tok.model" data.tokens="$tmp/f.tokens" model.vocab_size=512 train.steps=4 \
  schedule.warmup_steps=1 train.eval_interval=2 train.eval_batches=1 train.sample_tokens=4 train.checkpoint_interval=0 \
  train.out_dir="$tmp/run" --progress lines --trace-out "$tmp/train.json" >"$tmp/train.log" 2>&1
check "frugal train --trace-out train.json" test $? = 0
"$frugal" report "$tmp/train.json" -o "$tmp/train.html" >>"$tmp/train.log" 2>&1
timeout 120 "${browser[@]}" --window-size=1400,1000 --dump-dom "file://$tmp/train.html" >"$tmp/train_dom.html" 2>/dev/null
train_labels=$(grep -o 'data-labels="[^"]*"' "$tmp/train_dom.html" | head -n 1)
check "evaluation and sampling are labelled on a training run's chart (got '${train_labels:-none}')" \
  test "$train_labels" = 'data-labels="evaluation,evaluation,sampling"'
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
<pre id="widths">not run</pre>
<script>
document.getElementById('report').addEventListener('load', function () {
  var out = document.getElementById('result');
  try {
    var page = this.contentDocument, canvas = page.querySelector('canvas'), r = canvas.getBoundingClientRect();
    canvas.dispatchEvent(new MouseEvent('mousemove', { clientX: r.left + r.width * 0.6, clientY: r.top + r.height / 2 }));
    var tip = page.querySelector('.tip');
    out.textContent = 'display=' + tip.style.display + ' text=' + tip.textContent;
    // At 1400 px, with both traces side by side, every table fits inside its panel: nothing cut
    // off or needing a sideways scroll.
    var widths = [];
    Array.prototype.forEach.call(page.querySelectorAll('section.trace'), function (section, i) {
      var box = section.getBoundingClientRect();
      Array.prototype.forEach.call(section.querySelectorAll('table'), function (t, j) {
        var r = t.getBoundingClientRect(), scroller = t.parentNode;
        var cut = r.right > box.right - 1 || scroller.scrollWidth > scroller.clientWidth + 1;
        widths.push('trace ' + i + ' table ' + j + (cut ? ' CUT ' : ' fits ') + Math.round(r.width) + '/' +
                    Math.round(box.width) + ' px');
      });
    });
    var sections = page.querySelectorAll('section.trace'), first = sections[0].getBoundingClientRect();
    var side = sections.length === 2 && Math.abs(sections[1].getBoundingClientRect().top - first.top) < 1;
    document.getElementById('widths').textContent = (side ? 'side by side; ' : 'stacked; ') + widths.join('; ');
  } catch (e) {
    out.textContent = 'error: ' + e;
  }
});
</script>
</body></html>
HTML
timeout 120 "${browser[@]}" --allow-file-access-from-files --dump-dom "file://$tmp/hover.html" >"$tmp/hover_dom.html" 2>/dev/null
# Table widths on the widest tables: a training run (all seven categories) beside an account.
"$frugal" report "$tmp/train.json" "$tmp/b.json" -o "$tmp/cmp.html" >>"$tmp/train.log" 2>&1
sed 's/src="r.html"/src="cmp.html"/' "$tmp/hover.html" >"$tmp/widths.html"
timeout 120 "${browser[@]}" --allow-file-access-from-files --dump-dom "file://$tmp/widths.html" >"$tmp/widths_dom.html" 2>/dev/null
hover=$(python3 -c 'import html,re,sys; m = re.search(r"<pre id=\"result\">(.*?)</pre>", open(sys.argv[1]).read(), re.S); print(html.unescape(m.group(1)) if m else "no result")' "$tmp/hover_dom.html")
# the readout: time, step and phase, the total and each category's bytes at that moment
check "hovering a chart shows its values (got '$hover')" python3 -c '
import re, sys
text = sys.argv[1]
ok = text.startswith("display=block") and re.search(r"[0-9.]+ ms . step (none|[0-9]+) . \w+", text) \
     and re.search(r"total[0-9.]+ (B|KiB|MiB)", text) and re.search(r"parameter[0-9.]+ (B|KiB|MiB)", text)
sys.exit(0 if ok else 1)' "$hover"

widths=$(python3 -c 'import html,re,sys; m = re.search(r"<pre id=\"widths\">(.*?)</pre>", open(sys.argv[1]).read(), re.S); print(html.unescape(m.group(1)) if m else "no result")' "$tmp/widths_dom.html")
check "at 1400 px both traces sit side by side and every table fits its panel (got '$widths')" python3 -c '
import sys
text = sys.argv[1]
sys.exit(0 if text.startswith("side by side; ") and text.count(" fits ") == 4 and " CUT " not in text else 1)' "$widths"

if [ "$failed" != 0 ]; then
  echo "--- chromium's log"; grep -v -E "dbus|bluez|vaapi|sandbox_linux|idle_linux|property.cc" "$tmp/browser.log" | tail -n 20
fi
echo "$pass passed, $failed failed"
[ "$failed" = 0 ]
