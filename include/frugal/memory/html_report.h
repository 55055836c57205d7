// frugal/memory/html_report.h — allocation traces as one self-contained HTML page.
//
// Per trace: a stacked area chart of live bytes per category over time, with step markers, a
// phase band, the peak and its breakdown, values on hover, and a table of per-step peaks. Several
// traces sit side by side on one y scale, so techniques on and off compare directly. Styles,
// scripts and data are inline: the page works offline and fetches nothing.
//
// The work is done here, not in the browser: the events are replayed into live bytes per category
// and reduced to a few thousand samples that keep the peaks, so a trace of hundreds of thousands
// of events still gives a small page. The exact peak comes from the full replay.
//
//   memory::Trace t = memory::read_trace(text);              // a --trace-out file
//   std::string html = memory::html_report({{"run.json", t}});
#pragma once

#include <cstddef>
#include <cstdint>
#include <string>
#include <utility>
#include <vector>

#include "frugal/memory/trace.h"

namespace frugal {
namespace memory {

// At most 2 * buckets + 1 samples: in each of `buckets` equal time spans, the sample with the
// largest total and the one with the smallest (in time order), and the last sample. The first
// sample with the largest total overall is always kept, so the reduced series has the exact peak.
// Series that are already small enough (and any with buckets = 0) come back whole.
std::vector<LiveSample> downsample_keep_peaks(const std::vector<LiveSample>& samples, size_t buckets);

// A stretch of time, in trace microseconds, spent in one phase.
struct PhaseSpan {
  Phase phase = Phase::idle;
  int64_t begin_us = 0, end_us = 0;
};

// Everything the page shows for one trace.
struct TraceView {
  int64_t start_us = 0, end_us = 0;                      // first and last event
  size_t n_events = 0;                                   // every event, markers included
  std::vector<std::string> devices;                      // of the alloc events, in order of appearance
  std::vector<LiveSample> series;                        // reduced (downsample_keep_peaks)
  LiveSample peak;                                       // of the whole trace (set-up included), exact, from the full replay
  PeakReport steps_peak;                                 // peak_over_steps(steps): what a run's summary reports
  std::vector<std::pair<int64_t, int64_t>> step_starts;  // (step, time_us) where the step field changes
  std::vector<PhaseSpan> phases;                         // innermost open phase between phase_begin and phase_end
  // Per-step peaks: the trace's summaries (the tracker's, with the same categories as the events),
  // or, for traces without summaries, step_peaks() of the replay.
  std::vector<Tracker::StepSummary> steps;
  bool steps_from_events = false;      // no summaries in the trace
  std::string note;                    // what the chart leaves out (bounded capture), or empty
  std::vector<Tracker::Label> labels;  // the trace's names for what ran from when (Tracker::label)
};

constexpr size_t kReportBuckets = 1000;
TraceView view_trace(const Trace& trace, size_t buckets = kReportBuckets);

// One trace for html_report, with the title it is shown under.
struct NamedTrace {
  std::string name;  // shown as the trace's title (usually its file name)
  Trace trace;
};

// The whole page. Names are data: nothing in them can end the embedded script or add markup.
std::string html_report(const std::vector<NamedTrace>& traces);

}  // namespace memory
}  // namespace frugal
