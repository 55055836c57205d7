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
//   memory::Timeline t = memory::read_timeline(text);              // a --trace-out file
//   std::string html = memory::html_report({{"run.json", t}});
#pragma once

#include <cstddef>
#include <cstdint>
#include <string>
#include <utility>
#include <vector>

#include "frugal/memory/memory_viz.h"
#include "frugal/memory/tracker.h"

namespace frugal {
namespace memory {

// Live bytes just after one alloc or free event.
struct LiveSample {
  int64_t time_us = 0;
  int64_t step = -1;
  Phase phase = Phase::idle;
  CategoryBytes bytes{};
  int64_t total() const;
};

// Replays the alloc and free events (all devices together) into one sample per event. Times never
// go backward: events recorded on several threads can be a few microseconds out of order.
std::vector<LiveSample> replay_live_bytes(const std::vector<MemoryEvent>& events);

// At most 2 * buckets + 1 samples: in each of `buckets` equal time spans, the sample with the
// largest total and the one with the smallest (in time order), and the last sample. The first
// sample with the largest total overall is always kept, so the reduced series has the exact peak.
// Series that are already small enough (and any with buckets = 0) come back whole.
std::vector<LiveSample> downsample_keep_peaks(const std::vector<LiveSample>& samples, size_t buckets);

// The first sample with the largest total (a zero sample at time 0 when there is none).
LiveSample peak_sample(const std::vector<LiveSample>& samples);

struct PhaseSpan {
  Phase phase = Phase::idle;
  int64_t begin_us = 0, end_us = 0;
};

// Everything the page shows for one trace.
struct TraceView {
  int64_t start_us = 0, end_us = 0;   // first and last event
  size_t n_events = 0;                // every event, markers included
  std::vector<std::string> devices;   // of the alloc events, in order of appearance
  std::vector<LiveSample> series;     // reduced (downsample_keep_peaks)
  LiveSample peak;                    // exact, from the full replay
  std::vector<std::pair<int64_t, int64_t>> step_starts;  // (step, time_us) where the step field changes
  std::vector<PhaseSpan> phases;      // innermost open phase between phase_begin and phase_end
  // Per-step peaks. The trace's summaries carry categories as tagged when each buffer was allocated
  // (the tracker cannot know yet that a buffer will be freed inside its scope, i.e. is temporary);
  // where the events cover the step and give the same peak, the breakdown is taken from the replay
  // instead, so the table and the chart agree. Traces without summaries get them from the events.
  std::vector<Tracker::StepSummary> steps;
  bool steps_from_events = false;    // no summaries in the trace
  size_t steps_recategorized = 0;    // summaries whose breakdown now comes from the replay
  std::string note;                   // what the chart leaves out (bounded capture), or empty
};

constexpr size_t kReportBuckets = 1000;
TraceView view_trace(const Timeline& timeline, size_t buckets = kReportBuckets);

struct NamedTimeline {
  std::string name;  // shown as the trace's title (usually its file name)
  Timeline timeline;
};

// The whole page. Names are data: nothing in them can end the embedded script or add markup.
std::string html_report(const std::vector<NamedTimeline>& traces);

}  // namespace memory
}  // namespace frugal
