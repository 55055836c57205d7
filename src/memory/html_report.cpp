#include "frugal/memory/html_report.h"

#include <algorithm>
#include <set>
#include <sstream>
#include <stdexcept>
#include <string>

#include "frugal/io/json.h"

namespace {
// The page (src/memory/report_page.html): HTML, CSS and JavaScript, with one marker where the data goes.
#include "report_page.inc"
}  // namespace

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
  w.key("phase").value(phase_name(v.steps_peak.phase)).key("covers").value(describe_coverage(v.steps_peak)).end_object();
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

}  // namespace

std::string html_report(const std::vector<NamedTrace>& traces) {
  std::ostringstream data;
  io::JsonWriter w(data, -1);  // compact: the page carries it
  w.begin_object().key("categories").begin_array();
  for (Category c : kAllCategories) w.value(category_name(c));
  w.end_array().key("traces").begin_array();
  for (const NamedTrace& t : traces) write_view(w, t.name, view_trace(t.trace));
  w.end_array().end_object();
  static const std::string page(kReportPage);
  static const std::string marker = "<!-- frugal: the traces as JSON go here -->";
  static const size_t at = page.find(marker);
  if (at == std::string::npos) throw std::logic_error("html_report: the page has no place for the data");
  return page.substr(0, at) + script_safe(data.str()) + page.substr(at + marker.size());
}

}  // namespace memory
}  // namespace frugal
