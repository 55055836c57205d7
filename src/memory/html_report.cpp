#include "frugal/memory/html_report.h"

#include <algorithm>
#include <set>
#include <sstream>
#include <string>

#include "frugal/io/json.h"

namespace frugal {
namespace memory {

namespace {

// Appends the samples of one bucket [begin, end): its largest and smallest totals, in time order.
void keep_extremes(const std::vector<LiveSample>& samples, size_t begin, size_t end, std::vector<LiveSample>& out) {
  size_t hi = begin, lo = begin;
  for (size_t i = begin + 1; i < end; ++i) {
    const int64_t total = samples[i].total();
    if (total > samples[hi].total()) hi = i;  // strict: the first of equal maxima, so the exact peak survives
    if (total < samples[lo].total()) lo = i;
  }
  out.push_back(samples[std::min(hi, lo)]);
  if (hi != lo) out.push_back(samples[std::max(hi, lo)]);
}

}  // namespace

std::vector<LiveSample> downsample_keep_peaks(const std::vector<LiveSample>& samples, size_t buckets) {
  if (samples.size() <= 2 * buckets + 1 || buckets == 0) return samples;
  const double start = static_cast<double>(samples.front().time_us);
  const double span = static_cast<double>(samples.back().time_us - samples.front().time_us) + 1.0;
  auto bucket_of = [&](const LiveSample& s) {
    const auto b = static_cast<size_t>((static_cast<double>(s.time_us) - start) / span * static_cast<double>(buckets));
    return std::min(b, buckets - 1);
  };
  std::vector<LiveSample> out;
  size_t begin = 0;
  for (size_t i = 1; i <= samples.size(); ++i) {
    if (i < samples.size() && bucket_of(samples[i]) == bucket_of(samples[begin])) continue;
    keep_extremes(samples, begin, i, out);
    begin = i;
  }
  // The state at the end of the trace, so the chart ends where the run did.
  if (out.back().time_us != samples.back().time_us || out.back().total() != samples.back().total()) {
    out.push_back(samples.back());
  }
  return out;
}

namespace {

std::vector<std::pair<int64_t, int64_t>> step_starts(const std::vector<MemoryEvent>& events) {
  std::vector<std::pair<int64_t, int64_t>> out;
  int64_t step = -1;  // before the first mark_step
  for (const MemoryEvent& e : events) {
    if (e.step == step) continue;
    step = e.step;
    out.emplace_back(step, e.time_us);
  }
  return out;
}

// Spans of the innermost open phase; phases nest (an optimizer scope can open inside backward).
std::vector<PhaseSpan> phase_spans(const std::vector<MemoryEvent>& events, int64_t end_us) {
  std::vector<PhaseSpan> out;
  std::vector<Phase> open;
  int64_t since = 0;
  auto close_current = [&](int64_t t) {
    if (!open.empty() && t > since) out.push_back({open.back(), since, t});
    since = t;
  };
  for (const MemoryEvent& e : events) {
    if (e.action == Action::phase_begin) {
      close_current(e.time_us);
      open.push_back(e.phase);
    } else if (e.action == Action::phase_end && !open.empty() && open.back() == e.phase) {
      close_current(e.time_us);
      open.pop_back();
    }
  }
  close_current(end_us);  // a phase still open when the trace was written
  return out;
}

std::string list_steps(const std::vector<int64_t>& steps) {
  if (steps.size() > 8) return std::to_string(steps.size()) + " steps";
  std::string out = steps.size() == 1 ? "step " : "steps ";
  for (size_t i = 0; i < steps.size(); ++i) out += (i ? ", " : "") + std::to_string(steps[i]);
  return out;
}

// With bounded capture (--trace-steps) the summaries cover every step but the events only some:
// say so, and that memory live when a kept step began is drawn as allocated then.
std::string capture_note(const Trace& t) {
  std::set<int64_t> kept;
  for (const MemoryEvent& e : t.events) {
    if (e.action == Action::alloc) kept.insert(e.step);
  }
  std::vector<int64_t> kept_steps;
  for (int64_t s : kept) {
    if (s >= 0) kept_steps.push_back(s);
  }
  const bool all_kept = std::all_of(t.steps.begin(), t.steps.end(), [&](const Tracker::StepSummary& s) { return kept.count(s.step) > 0; });
  if (all_kept) return "";
  if (kept_steps.empty()) return "The trace has summaries of " + std::to_string(t.steps.size()) + " steps but no events of any.";
  return "Events were kept for " + list_steps(kept_steps) + " of " + std::to_string(t.steps.size()) +
         ": the chart shows those steps (memory live when one began is drawn as allocated at its start); the "
         "table has every step.";
}

std::vector<std::string> alloc_devices(const std::vector<MemoryEvent>& events) {
  std::vector<std::string> out;
  for (const MemoryEvent& e : events) {
    if (e.action != Action::alloc) continue;
    const std::string d = e.device.str();
    if (std::find(out.begin(), out.end(), d) == out.end()) out.push_back(d);
  }
  return out;
}

}  // namespace

TraceView view_trace(const Trace& trace, size_t buckets) {
  const std::vector<MemoryEvent>& events = trace.events;
  TraceView v;
  v.n_events = events.size();
  if (!events.empty()) {
    const auto [lo, hi] =
        std::minmax_element(events.begin(), events.end(), [](const MemoryEvent& a, const MemoryEvent& b) { return a.time_us < b.time_us; });
    v.start_us = lo->time_us;
    v.end_us = hi->time_us;
  }
  const std::vector<LiveSample> full = replay_live_bytes(events);
  v.peak = peak_sample(full);
  if (full.empty()) v.peak.time_us = v.start_us;
  v.series = downsample_keep_peaks(full, buckets);
  v.step_starts = step_starts(events);
  v.phases = phase_spans(events, v.end_us);
  v.devices = alloc_devices(events);
  v.note = capture_note(trace);
  v.steps = trace.steps;
  v.labels = trace.labels;
  v.steps_from_events = v.steps.empty();
  if (v.steps_from_events) v.steps = step_peaks(full);
  v.steps_peak = peak_over_steps(v.steps);
  return v;
}

// ---- the page ----

namespace {

void write_breakdown(io::JsonWriter& w, const CategoryBytes& b) {
  w.begin_array();
  for (int64_t bytes : b) w.value(bytes);
  w.end_array();
}

// Times relative to the trace's start, and one column per category (null when always zero, which
// keeps the page small: most traces use only a few categories).
void write_series(io::JsonWriter& w, const TraceView& v) {
  w.key("t").begin_array();
  for (const LiveSample& s : v.series) w.value(s.time_us - v.start_us);
  w.end_array().key("series").begin_array();
  for (int c = 0; c < kNumCategories; ++c) {
    const bool used = std::any_of(v.series.begin(), v.series.end(), [&](const LiveSample& s) { return s.bytes[c] != 0; });
    if (!used) {
      w.null();
      continue;
    }
    w.begin_array();
    for (const LiveSample& s : v.series) w.value(s.bytes[c]);
    w.end_array();
  }
  w.end_array();
}

void write_view(io::JsonWriter& w, const std::string& name, const TraceView& v) {
  w.begin_object().key("name").value(name).key("events").value(static_cast<int64_t>(v.n_events));
  w.key("devices").begin_array();
  for (const std::string& d : v.devices) w.value(d);
  w.end_array().key("duration_us").value(v.end_us - v.start_us).key("note").value(v.note);
  write_series(w, v);
  w.key("peak").begin_object().key("t").value(v.peak.time_us - v.start_us).key("bytes").value(v.peak.total());
  w.key("step").value(v.peak.step).key("phase").value(phase_name(v.peak.phase)).key("breakdown");
  write_breakdown(w, v.peak.bytes);
  w.end_object();
  // The run's peak as its summary reports it: over the step summaries.
  w.key("steps_peak").begin_object().key("bytes").value(v.steps_peak.peak_bytes).key("step").value(v.steps_peak.peak_step);
  w.key("phase").value(phase_name(v.steps_peak.peak_phase)).key("covers").value(describe_coverage(v.steps_peak)).end_object();
  // Markers and table rows as small arrays: [step, t], [phase, begin, end], [step, peak, breakdown].
  w.key("step_starts").begin_array();
  for (const auto& [step, t] : v.step_starts) w.begin_array().value(step).value(t - v.start_us).end_array();
  w.end_array().key("phases").begin_array();
  for (const PhaseSpan& p : v.phases) {
    w.begin_array().value(phase_name(p.phase)).value(p.begin_us - v.start_us).value(p.end_us - v.start_us).end_array();
  }
  w.end_array().key("steps").begin_array();
  for (const Tracker::StepSummary& s : v.steps) {
    w.begin_array().value(s.step).value(s.peak_bytes);
    write_breakdown(w, s.breakdown);
    w.end_array();
  }
  w.end_array().key("labels").begin_array();
  for (const Tracker::Label& l : v.labels) w.begin_array().value(l.time_us - v.start_us).value(l.text).end_array();
  w.end_array().key("steps_from_events").value(v.steps_from_events).end_object();
}

// JSON never has '<' outside strings, and inside them \u003c means the same: with none left,
// nothing in a trace name can close the <script> element (or open a comment) that holds the data.
std::string script_safe(const std::string& json) {
  std::string out;
  out.reserve(json.size());
  for (char c : json) {
    if (c == '<') {
      out += "\\u003c";
    } else {
      out += c;
    }
  }
  return out;
}

const char* kHead = R"HTML(<!DOCTYPE html>
<html lang="en">
<head>
<meta charset="utf-8">
<meta name="viewport" content="width=device-width, initial-scale=1">
<title>frugal memory report</title>
<link rel="icon" href="data:,">
<style>
:root { --fg: #1d2330; --muted: #5b6475; --line: #dde1e8; --grid: #eceef2; }
body { margin: 0; font: 14px/1.45 "DejaVu Sans", system-ui, sans-serif; color: var(--fg); background: #f4f5f7; }
header { padding: 16px 24px 4px; }
h1 { font-size: 20px; margin: 0 0 2px; }
.sub { color: var(--muted); margin: 0; }
#errors { margin: 8px 24px; padding: 8px 12px; background: #fde8e8; color: #8a1c1c; border: 1px solid #f5b5b5;
  border-radius: 6px; white-space: pre-wrap; font-family: "DejaVu Sans Mono", monospace; font-size: 12px; }
#errors:empty { display: none; }
main { display: grid; grid-template-columns: repeat(auto-fit, minmax(520px, 1fr)); gap: 16px; padding: 12px 24px 24px; }
.trace { background: #fff; border: 1px solid var(--line); border-radius: 8px; padding: 12px 16px 14px; min-width: 0; }
.trace h2 { font: 600 14px/1.3 "DejaVu Sans Mono", monospace; margin: 0 0 2px; overflow-wrap: anywhere; }
.meta { color: var(--muted); font-size: 12.5px; margin: 0 0 6px; }
.note { font-size: 12.5px; background: #fff6e0; border-left: 3px solid #e0a800; padding: 4px 8px; margin: 0 0 6px; }
.legend { display: flex; flex-wrap: wrap; gap: 2px 14px; font-size: 12.5px; margin: 2px 0 8px; }
.legend .phase { color: var(--muted); }
.swatch { display: inline-block; width: 11px; height: 11px; border-radius: 2px; margin-right: 5px; vertical-align: -1px; }
.chart { position: relative; }
.chart canvas { display: block; width: 100%; height: 330px; cursor: crosshair; }
.tip { position: absolute; display: none; pointer-events: none; background: rgba(255, 255, 255, 0.97);
  border: 1px solid #c9ced8; border-radius: 6px; padding: 6px 9px; font-size: 12px; white-space: nowrap;
  box-shadow: 0 2px 8px rgba(0, 0, 0, 0.12); }
.tip .when { color: var(--muted); margin-bottom: 2px; }
.tip .row { display: flex; justify-content: space-between; gap: 14px; }
.tip .row.total { font-weight: 600; border-bottom: 1px solid var(--grid); margin-bottom: 2px; }
.tables { display: flex; flex-wrap: wrap; gap: 8px 20px; margin-top: 10px; align-items: flex-start; }
.tables > div { min-width: 0; }
.tables > .at-peak { flex: 0 1 250px; }
.tables > .per-step { flex: 1 1 440px; }
.tables h3 { font-size: 13px; margin: 0 0 4px; }
.tables h3 span { font-weight: normal; color: var(--muted); }
.scroll { max-height: 264px; overflow: auto; }
table { border-collapse: collapse; font-size: 12.5px; width: 100%; }
th, td { text-align: right; padding: 2px 6px; border-bottom: 1px solid var(--grid); white-space: nowrap;
  font-variant-numeric: tabular-nums; }
th { position: sticky; top: 0; background: #fff; font-weight: 600; white-space: normal; vertical-align: bottom; }
th:first-child, td:first-child { text-align: left; }
tr.max td { background: #fff3d6; font-weight: 600; }
th .unit { display: block; font-weight: normal; color: var(--muted); }
</style>
</head>
<body>
<header>
<h1>frugal memory report</h1>
<p class="sub" id="subtitle">Live memory by category over time.</p>
</header>
<div id="errors" role="alert"></div>
<script>
window.onerror = function (message, source, line, column) {
  var box = document.getElementById('errors');
  if (box) box.textContent += message + (line ? ' (line ' + line + ':' + column + ')' : '') + '\n';
};
</script>
<main id="traces"></main>
<script type="application/json" id="frugal-data">)HTML";

const char* kScript = R"HTML(</script>
<script>
(function () {
  'use strict';
  var DATA = JSON.parse(document.getElementById('frugal-data').textContent);
  var CATS = DATA.categories;
  var COLORS = {
    parameter: '#4e79a7', gradient: '#f28e2b', optimizer_state: '#e15759', activation: '#59a14f',
    temporary: '#edc948', input: '#b07aa1', other: '#9d9d9d'
  };
  // Light tints of each phase's default category (forward makes activations, backward gradients).
  var PHASE_COLORS = { forward: '#b5dbae', backward: '#fbd3a9', optimizer: '#f3b3b4', evaluation: '#cdc4ea',
                       sampling: '#a8dce3' };
  var LABELLED_PHASES = { evaluation: true, sampling: true };  // named on the chart: they are not steps
  var MARGIN = { left: 70, right: 14, top: 50, bottom: 40 };

  function humanBytes(b) {  // as io::human_bytes
    var a = Math.abs(b);
    if (a >= 1073741824) return (b / 1073741824).toFixed(2) + ' GiB';
    if (a >= 1048576) return (b / 1048576).toFixed(2) + ' MiB';
    if (a >= 1024) return (b / 1024).toFixed(1) + ' KiB';
    return Math.round(b) + ' B';
  }
  function formatMs(us) {
    var ms = us / 1000;
    return ms.toFixed(ms < 10 ? 3 : ms < 1000 ? 1 : 0) + ' ms';
  }
  function columnUnit(maxBytes) {  // the largest binary unit the column's biggest value reaches
    var units = [['B', 1], ['KiB', 1024], ['MiB', 1048576], ['GiB', 1073741824]], unit = units[0];
    units.forEach(function (u) { if (maxBytes >= u[1]) unit = u; });
    return unit;
  }
  function trimNumber(x) { return String(+x.toFixed(3)); }
  function stepName(s) { return s < 0 ? 'none' : String(s); }
  function el(tag, className, text) {
    var e = document.createElement(tag);
    if (className) e.className = className;
    if (text !== undefined) e.textContent = text;
    return e;
  }
  function swatch(color) {
    var s = el('span', 'swatch');
    s.style.background = color;
    return s;
  }
  function niceStep(range, count) {
    var raw = range / Math.max(count, 1);
    var p = Math.pow(10, Math.floor(Math.log10(raw)));
    var m = raw / p;
    return (m <= 1 ? 1 : m <= 2 ? 2 : m <= 5 ? 5 : 10) * p;
  }
  function lastAtOrBefore(values, x, key) {  // largest i with key(values[i]) <= x, or -1
    var lo = 0, hi = values.length - 1, found = -1;
    while (lo <= hi) {
      var mid = (lo + hi) >> 1;
      if (key(values[mid]) <= x) { found = mid; lo = mid + 1; } else { hi = mid - 1; }
    }
    return found;
  }

  // Cumulative stacks of the categories the trace uses, bottom to top in category order.
  function prepare(tr) {
    var n = tr.t.length, acc = new Float64Array(n);
    tr.used = [];
    tr.stack = [];
    CATS.forEach(function (name, c) {
      var col = tr.series[c];
      if (!col) return;
      var top = new Float64Array(n);
      for (var i = 0; i < n; ++i) { acc[i] += col[i]; top[i] = acc[i]; }
      tr.used.push(c);
      tr.stack.push(top);
    });
    tr.total = acc;
  }

  // One y scale for every chart, in the binary unit of the largest peak.
  function yScale(maxBytes) {
    var units = [['B', 1], ['KiB', 1024], ['MiB', 1048576], ['GiB', 1073741824]];
    var m = Math.max(maxBytes, 1), unit = units[0];
    units.forEach(function (u) { if (m >= u[1]) unit = u; });
    var step = niceStep(m * 1.1 / unit[1], 5) * unit[1];  // headroom for the peak's label
    return { unit: unit, step: step, top: Math.max(step, Math.ceil(m * 1.1 / step) * step) };
  }

  function makeChart(tr, ys, box) {
    var canvas = el('canvas'), tip = el('div', 'tip');
    box.appendChild(canvas);
    box.appendChild(tip);
    var hoverX = null;
    canvas.addEventListener('mousemove', function (e) {
      hoverX = e.clientX - canvas.getBoundingClientRect().left;
      draw();
    });
    canvas.addEventListener('mouseleave', function () { hoverX = null; draw(); });

    function draw() {
      var w = canvas.clientWidth, h = canvas.clientHeight, dpr = window.devicePixelRatio || 1;
      if (canvas.width !== Math.round(w * dpr) || canvas.height !== Math.round(h * dpr)) {
        canvas.width = Math.round(w * dpr);
        canvas.height = Math.round(h * dpr);
      }
      var ctx = canvas.getContext('2d');
      ctx.setTransform(dpr, 0, 0, dpr, 0, 0);
      ctx.clearRect(0, 0, w, h);
      var g = {
        ctx: ctx, w: w, h: h, left: MARGIN.left, top: MARGIN.top,
        pw: Math.max(w - MARGIN.left - MARGIN.right, 10), ph: Math.max(h - MARGIN.top - MARGIN.bottom, 10),
        dur: Math.max(tr.duration_us, 1)
      };
      g.x = function (t) { return g.left + Math.min(Math.max(t / g.dur, 0), 1) * g.pw; };
      g.y = function (b) { return g.top + g.ph - b / ys.top * g.ph; };
      ctx.font = '11px "DejaVu Sans", sans-serif';
      drawYAxis(g);
      drawPhases(g);
      drawAreas(g);
      drawSteps(g);
      drawPhaseLabels(g);
      drawXAxis(g);
      drawPeak(g);
      drawHover(g);
    }

    function drawYAxis(g) {
      var ctx = g.ctx;
      ctx.textAlign = 'right';
      ctx.textBaseline = 'middle';
      for (var v = 0; v <= ys.top + ys.step / 2; v += ys.step) {
        var y = Math.round(g.y(v)) + 0.5;
        ctx.strokeStyle = v === 0 ? '#9aa1ad' : '#eceef2';
        ctx.beginPath(); ctx.moveTo(g.left, y); ctx.lineTo(g.left + g.pw, y); ctx.stroke();
        ctx.fillStyle = '#5b6475';
        ctx.fillText(v === 0 ? '0' : trimNumber(v / ys.unit[1]) + ' ' + ys.unit[0], g.left - 6, y);
      }
    }

    function drawPhases(g) {
      var ctx = g.ctx, y0 = g.top - 22, bh = 9;
      ctx.fillStyle = '#f0f1f4';
      ctx.fillRect(g.left, y0, g.pw, bh);
      tr.phases.forEach(function (p) {
        var x0 = g.x(p[1]), x1 = g.x(p[2]);
        ctx.fillStyle = PHASE_COLORS[p[0]] || '#ddd';
        ctx.fillRect(x0, y0, Math.max(x1 - x0, 1), bh);
      });
      ctx.fillStyle = '#5b6475';
      ctx.textAlign = 'right';
      ctx.textBaseline = 'middle';
      ctx.fillText('phase', g.left - 6, y0 + bh / 2);
    }

    function drawAreas(g) {
      var ctx = g.ctx, n = tr.t.length;
      if (!n) {
        ctx.fillStyle = '#5b6475';
        ctx.textAlign = 'center';
        ctx.fillText('no allocations in this trace', g.left + g.pw / 2, g.top + g.ph / 2);
        return;
      }
      var xs = new Float64Array(n + 1);
      for (var i = 0; i < n; ++i) xs[i] = g.x(tr.t[i]);
      xs[n] = g.x(g.dur);
      tr.stack.forEach(function (top, k) {
        var bottom = k ? tr.stack[k - 1] : null;
        ctx.beginPath();
        ctx.moveTo(xs[0], g.y(bottom ? bottom[0] : 0));
        for (var i = 0; i < n; ++i) { ctx.lineTo(xs[i], g.y(top[i])); ctx.lineTo(xs[i + 1], g.y(top[i])); }
        for (var j = n - 1; j >= 0; --j) {
          var yb = g.y(bottom ? bottom[j] : 0);
          ctx.lineTo(xs[j + 1], yb); ctx.lineTo(xs[j], yb);
        }
        ctx.closePath();
        ctx.fillStyle = COLORS[CATS[tr.used[k]]];
        ctx.fill();
      });
      ctx.beginPath();  // the total, so the outline stays readable where a layer is thin
      ctx.moveTo(xs[0], g.y(0));
      for (var m = 0; m < n; ++m) { ctx.lineTo(xs[m], g.y(tr.total[m])); ctx.lineTo(xs[m + 1], g.y(tr.total[m])); }
      ctx.strokeStyle = 'rgba(29, 35, 48, 0.7)';
      ctx.lineWidth = 1;
      ctx.stroke();
    }

    function drawSteps(g) {
      var ctx = g.ctx, lastLabel = -1e9;
      ctx.textAlign = 'left';
      ctx.textBaseline = 'alphabetic';
      tr.step_starts.forEach(function (s) {
        if (s[0] < 0) return;
        var x = Math.round(g.x(s[1])) + 0.5;
        ctx.strokeStyle = 'rgba(60, 66, 80, 0.45)';
        ctx.setLineDash([3, 3]);
        ctx.beginPath(); ctx.moveTo(x, g.top - 26); ctx.lineTo(x, g.top + g.ph); ctx.stroke();
        ctx.setLineDash([]);
        var label = 'step ' + s[0];
        if (x - lastLabel > ctx.measureText(label).width + 8) {
          ctx.fillStyle = '#3c4250';
          ctx.fillText(label, x + 3, g.top - 29);
          lastLabel = x;
        }
      });
    }

    // Evaluation and sampling spikes sit between steps, and a trace's labels (frugal account's
    // experiments) name stretches of it: write each name inside the plot at its start, on one of
    // the rows that fit in the plot's top third (a short stretch, as under a busy machine's timings,
    // goes to the next free row), skipping one that would overlap them all. The names drawn go to
    // data-labels.
    function drawPhaseLabels(g) {
      var ctx = g.ctx, rowEnd = [], drawn = [], runs = [];
      for (var k = Math.max(2, Math.floor(g.ph / 3 / 15)); k > 0; --k) rowEnd.push(-1e9);
      tr.phases.forEach(function (p) {
        if (!LABELLED_PHASES[p[0]]) return;
        var last = runs[runs.length - 1];
        if (last && last[0] === p[0] && p[1] - last[2] <= 0) { last[2] = p[2]; } else { runs.push(p.slice()); }
      });
      tr.labels.forEach(function (l) { runs.push([l[1], l[0], l[0]]); });
      runs.sort(function (a, b) { return a[1] - b[1]; });
      ctx.font = '600 11px "DejaVu Sans", sans-serif';
      ctx.textAlign = 'left';
      ctx.textBaseline = 'top';
      runs.forEach(function (r) {
        var x = g.x(r[1]), w = ctx.measureText(r[0]).width, lx = Math.min(x + 3, g.left + g.pw - w);
        ctx.strokeStyle = PHASE_COLORS[r[0]] || '#8a8fa0';
        ctx.beginPath(); ctx.moveTo(Math.round(x) + 0.5, g.top); ctx.lineTo(Math.round(x) + 0.5, g.top + g.ph); ctx.stroke();
        var row = -1;
        for (var j = 0; j < rowEnd.length && row < 0; ++j) if (lx > rowEnd[j] + 6) row = j;
        if (row < 0) return;
        var y = g.top + 3 + 15 * row;
        ctx.fillStyle = 'rgba(255, 255, 255, 0.85)';
        ctx.fillRect(lx - 2, y, w + 4, 14);
        ctx.fillStyle = '#3f3a6b';
        ctx.fillText(r[0], lx, y + 1);
        rowEnd[row] = lx + w;
        drawn.push(r[0]);
      });
      ctx.font = '11px "DejaVu Sans", sans-serif';
      canvas.dataset.labels = drawn.join(',');
    }

    function drawXAxis(g) {
      var ctx = g.ctx, ms = g.dur / 1000, step = niceStep(ms, Math.max(2, Math.floor(g.pw / 90)));
      ctx.fillStyle = '#5b6475';
      ctx.strokeStyle = '#9aa1ad';
      ctx.textAlign = 'center';
      ctx.textBaseline = 'top';
      for (var v = 0; v <= ms * (1 + 1e-9); v += step) {
        var x = Math.round(g.x(v * 1000)) + 0.5;
        ctx.beginPath(); ctx.moveTo(x, g.top + g.ph); ctx.lineTo(x, g.top + g.ph + 4); ctx.stroke();
        ctx.fillText(trimNumber(v), x, g.top + g.ph + 6);
      }
      ctx.textAlign = 'right';
      ctx.fillText('time (ms)', g.left + g.pw, g.top + g.ph + 22);
    }

    function drawPeak(g) {
      if (!tr.t.length) return;
      var ctx = g.ctx, px = g.x(tr.peak.t), py = g.y(tr.peak.bytes);
      ctx.strokeStyle = '#b0262b';
      ctx.setLineDash([4, 3]);
      ctx.beginPath(); ctx.moveTo(px, py); ctx.lineTo(px, g.top + g.ph); ctx.stroke();
      ctx.setLineDash([]);
      ctx.beginPath(); ctx.arc(px, py, 4, 0, 2 * Math.PI);
      ctx.fillStyle = '#fff'; ctx.fill();
      ctx.lineWidth = 2; ctx.stroke(); ctx.lineWidth = 1;
      var label = 'peak ' + humanBytes(tr.peak.bytes);
      ctx.font = '600 12px "DejaVu Sans", sans-serif';
      var bw = ctx.measureText(label).width + 12, bh = 20;
      var bx = Math.min(Math.max(px - bw / 2, g.left), g.left + g.pw - bw), by = Math.max(py - bh - 8, g.top);
      ctx.fillStyle = 'rgba(255, 255, 255, 0.92)';
      ctx.fillRect(bx, by, bw, bh);
      ctx.strokeRect(bx + 0.5, by + 0.5, bw - 1, bh - 1);
      ctx.fillStyle = '#b0262b';
      ctx.textAlign = 'left';
      ctx.textBaseline = 'middle';
      ctx.fillText(label, bx + 6, by + bh / 2 + 1);
      ctx.font = '11px "DejaVu Sans", sans-serif';
    }

    function drawHover(g) {
      if (hoverX === null || hoverX < g.left || hoverX > g.left + g.pw || !tr.t.length) {
        tip.style.display = 'none';
        return;
      }
      var ctx = g.ctx, t = (hoverX - g.left) / g.pw * g.dur;
      var i = lastAtOrBefore(tr.t, t, function (v) { return v; });
      ctx.strokeStyle = 'rgba(29, 35, 48, 0.8)';
      ctx.beginPath(); ctx.moveTo(hoverX, g.top - 26); ctx.lineTo(hoverX, g.top + g.ph); ctx.stroke();
      fillTip(i, t);
      tip.style.display = 'block';
      var left = hoverX + 14;
      if (left + tip.offsetWidth > g.w) left = hoverX - 14 - tip.offsetWidth;
      tip.style.left = Math.max(left, 0) + 'px';
      tip.style.top = g.top + 'px';
    }

    function fillTip(i, t) {
      tip.textContent = '';
      var s = lastAtOrBefore(tr.step_starts, t, function (v) { return v[1]; });
      var p = lastAtOrBefore(tr.phases, t, function (v) { return v[1]; });
      var phase = p >= 0 && t <= tr.phases[p][2] ? tr.phases[p][0] : 'idle';
      tip.appendChild(el('div', 'when', formatMs(t) + ' \u00b7 step ' + stepName(s >= 0 ? tr.step_starts[s][0] : -1) +
                                        ' \u00b7 ' + phase));
      var total = el('div', 'row total');
      total.appendChild(el('span', null, 'total'));
      total.appendChild(el('span', null, humanBytes(i >= 0 ? tr.total[i] : 0)));
      tip.appendChild(total);
      for (var k = tr.used.length - 1; k >= 0; --k) {  // top of the stack first, as drawn
        var c = tr.used[k], row = el('div', 'row'), name = el('span');
        name.appendChild(swatch(COLORS[CATS[c]]));
        name.appendChild(document.createTextNode(CATS[c]));
        row.appendChild(name);
        row.appendChild(el('span', null, humanBytes(i >= 0 ? tr.series[c][i] : 0)));
        tip.appendChild(row);
      }
    }

    return { draw: draw };
  }

  function legend(tr) {
    var box = el('div', 'legend');
    tr.used.forEach(function (c) {
      var item = el('span');
      item.appendChild(swatch(COLORS[CATS[c]]));
      item.appendChild(document.createTextNode(CATS[c]));
      box.appendChild(item);
    });
    Object.keys(PHASE_COLORS).forEach(function (p) {
      if (!tr.phases.some(function (s) { return s[0] === p; })) return;
      var item = el('span', 'phase');
      item.appendChild(swatch(PHASE_COLORS[p]));
      item.appendChild(document.createTextNode(p + ' phase'));
      box.appendChild(item);
    });
    return box;
  }

  function table(headers, rows, maxRow) {
    var t = el('table'), head = el('tr');
    headers.forEach(function (h) { head.appendChild(el('th', null, h)); });
    t.appendChild(el('thead')).appendChild(head);
    var body = t.appendChild(el('tbody'));
    rows.forEach(function (cells, r) {
      var tr = body.appendChild(el('tr', r === maxRow ? 'max' : null));
      cells.forEach(function (text) { tr.appendChild(el('td', null, text)); });
    });
    return t;
  }

  function peakTable(tr) {
    var div = el('div', 'at-peak'), h = el('h3', null, 'At the peak ');
    h.appendChild(el('span', null, humanBytes(tr.peak.bytes)));
    div.appendChild(h);
    var rows = [];
    CATS.forEach(function (name, c) {
      var b = tr.peak.breakdown[c];
      if (b) rows.push([name, humanBytes(b), (100 * b / Math.max(tr.peak.bytes, 1)).toFixed(1) + '%']);
    });
    var t = table(['category', 'bytes', 'share'], rows, -1);
    Array.prototype.forEach.call(t.querySelectorAll('tbody td:first-child'), function (td) {
      td.insertBefore(swatch(COLORS[td.textContent]), td.firstChild);
    });
    div.appendChild(t);
    return div;
  }

  function stepTable(tr) {
    var div = el('div', 'per-step'), steps = tr.steps;
    var h = el('h3', null, 'Per-step peaks ');
    var basis = tr.steps_from_events ? 'from the events: the trace has no step summaries'
              : steps.length + ' steps, as the run summarised them';
    h.appendChild(el('span', null, '(' + basis + ')'));
    div.appendChild(h);
    var cols = [];
    CATS.forEach(function (name, c) {
      if (steps.some(function (s) { return s[2][c] !== 0; })) cols.push(c);
    });
    var maxRow = -1;
    steps.forEach(function (s, r) { if (maxRow < 0 || s[1] > steps[maxRow][1]) maxRow = r; });
    var wholeTrace = steps.length === 1 && steps[0][0] < 0;
    // One unit per column, named in its header: bare numbers keep nine columns inside half of a
    // 1400 px page (two traces side by side), where "123.45 KiB" in every cell did not fit.
    var units = [['peak', function (s) { return s[1]; }]].concat(cols.map(function (c) {
      return [CATS[c], function (s) { return s[2][c]; }];
    })).map(function (col) {
      var max = 0;  // a loop: Math.max.apply overflows the stack on 200k steps
      steps.forEach(function (s) { max = Math.max(max, col[1](s)); });
      return { name: col[0], value: col[1], unit: columnUnit(max) };
    });
    var rows = steps.map(function (s) {
      return [wholeTrace ? 'whole trace' : stepName(s[0])].concat(units.map(function (u) {
        var v = u.value(s) / u.unit[1];
        return u.unit[1] === 1 ? String(v) : v.toFixed(2);
      }));
    });
    var scroll = el('div', 'scroll');
    var t = table(['step'].concat(units.map(function (u) { return u.name; })), rows, maxRow);
    Array.prototype.forEach.call(t.querySelectorAll('th'), function (th, k) {  // optimizer_<wbr>state: narrower columns
      var parts = th.textContent.split('_');
      th.textContent = '';
      parts.forEach(function (part, i) {
        if (i) { th.appendChild(document.createTextNode('_')); th.appendChild(el('wbr')); }
        th.appendChild(document.createTextNode(part));
      });
      if (k) th.appendChild(el('span', 'unit', units[k - 1].unit[0]));
    });
    scroll.appendChild(t);
    div.appendChild(scroll);
    return div;
  }

  function steps_covered(tr) { return tr.steps.some(function (s) { return s[0] >= 0; }); }

  function card(tr, ys) {
    var section = el('section', 'trace');
    section.appendChild(el('h2', null, tr.name));
    var meta = [tr.events.toLocaleString('en-US') + ' events', formatMs(tr.duration_us)];
    if (tr.devices.length) meta.push(tr.devices.join(' + '));
    if (steps_covered(tr)) {
      meta.push('peak over ' + tr.steps_peak.covers + ' ' + humanBytes(tr.steps_peak.bytes) + ' (step ' +
                tr.steps_peak.step + ', ' + tr.steps_peak.phase + ')');
    }
    meta.push('whole trace ' + humanBytes(tr.peak.bytes) + ' at ' + formatMs(tr.peak.t) + ' (' +
              (tr.peak.step >= 0 ? 'step ' + tr.peak.step + ', ' : 'set-up, ') + tr.peak.phase + ')');
    section.appendChild(el('p', 'meta', meta.join(' \u00b7 ')));
    if (tr.note) section.appendChild(el('p', 'note', tr.note));
    section.appendChild(legend(tr));
    var box = section.appendChild(el('div', 'chart'));
    var chart = makeChart(tr, ys, box);
    var tables = section.appendChild(el('div', 'tables'));
    tables.appendChild(peakTable(tr));
    tables.appendChild(stepTable(tr));
    return { section: section, chart: chart };
  }

  var main = document.getElementById('traces');
  var ys = yScale(Math.max.apply(null, [0].concat(DATA.traces.map(function (tr) { return tr.peak.bytes; }))));
  var charts = [];
  DATA.traces.forEach(function (tr) {
    prepare(tr);
    var c = card(tr, ys);
    main.appendChild(c.section);
    charts.push(c.chart);
  });
  var n = DATA.traces.length;
  document.getElementById('subtitle').textContent =
      'Live memory by category over time, ' + n + (n === 1 ? ' trace' : ' traces, on one y scale') +
      '. Hover a chart for the values at that moment.';
  var drawn = 0;
  charts.forEach(function (c) { c.draw(); ++drawn; });
  window.addEventListener('resize', function () { charts.forEach(function (c) { c.draw(); }); });
  document.body.dataset.rendered = String(drawn);
})();
</script>
</body>
</html>
)HTML";

}  // namespace

std::string html_report(const std::vector<NamedTrace>& traces) {
  std::ostringstream data;
  io::JsonWriter w(data, -1);  // compact: the page carries it
  w.begin_object().key("categories").begin_array();
  for (Category c : kAllCategories) w.value(category_name(c));
  w.end_array().key("traces").begin_array();
  for (const NamedTrace& t : traces) write_view(w, t.name, view_trace(t.trace));
  w.end_array().end_object();
  return std::string(kHead) + script_safe(data.str()) + kScript;
}

}  // namespace memory
}  // namespace frugal
