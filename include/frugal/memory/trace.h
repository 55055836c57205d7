// frugal/memory/trace.h — the allocation trace: its file format (written and read here only) and
// its replay into live bytes per category.
//
// A trace is what a Tracker saw: the alloc/free events (each carrying its allocation's final
// category, see category.h for the rule) and one summary per training step. Every view of a run
// (the trainer's summary, --json-out, the HTML page, the memory-viewer snapshot) reads its numbers
// through these functions, so they cannot disagree.
//
//   memory::Trace t = tracker->trace();                      // or memory::read_trace(text)
//   memory::write_trace(file, t);                            // frugal train/account --trace-out
//   memory::PeakReport run = memory::peak_over_steps(t.steps);  // the run's peak and what held it
#pragma once

#include <cstdint>
#include <ostream>
#include <string>
#include <vector>

#include "frugal/memory/tracker.h"

namespace frugal {
namespace memory {

// A Tracker's record of a run: its allocation events, step summaries and labels.
struct Trace {
  std::vector<MemoryEvent> events;
  std::vector<Tracker::StepSummary> steps;  // empty when the trace has none (or no "steps" key)
  std::vector<Tracker::Label> labels;       // Tracker::label's names, in time order
  int64_t start_unix_us = 0;                // wall clock at time_us 0, microseconds since the Unix epoch (0: unknown)
};

// {"format": "frugal-trace", "version": 4, "start_unix_us": N, "categories": [...],
//  "steps": [{step, peak_bytes, time_us, phase, breakdown: {category: bytes}}...],
//  "labels": [{time_us, text}...] (only when there are labels),
//  "events": [{time_us, action, bytes, category, phase, device, step, addr}...]}, one record a line.
void write_trace(std::ostream& out, const Trace& trace);

// Parses write_trace's output (version 1 traces, without "format", time_us and phase in steps,
// too). Events are parsed one at a time, so a long trace is never held whole as a JSON tree.
// Throws std::invalid_argument naming the problem; sizes that are negative or whose sums pass
// 2^63, negative times, and frees of more bytes than their category has live (which the replay
// would draw as negative memory) are refused.
Trace read_trace(const std::string& text);

// Live bytes just after one alloc or free event.
struct LiveSample {
  int64_t time_us = 0;
  int64_t step = -1;
  Phase phase = Phase::idle;
  CategoryBytes bytes{};
  int64_t total() const;  // the live bytes of every category together
};

// Replays the alloc and free events (all devices together) into one sample per event. Times never
// go backward: events recorded on several threads can be a few microseconds out of order.
std::vector<LiveSample> replay_live_bytes(const std::vector<MemoryEvent>& events);

// The first sample with the largest total (a zero sample at time 0 when there is none).
LiveSample peak_sample(const std::vector<LiveSample>& samples);

// Each category's own highest live bytes (at different moments, in general) from events[from_event]
// on, counting what was live just before it.
CategoryBytes max_by_category(const std::vector<MemoryEvent>& events, size_t from_event = 0);

// Per-step peaks from a replay, as the tracker computes them live: a step's peak starts from what
// was live when it began, and its breakdown is the one at the first moment of its highest total.
// Events before the first step make an entry of step -1 (set-up).
std::vector<Tracker::StepSummary> step_peaks(const std::vector<LiveSample>& samples);

// The highest of the step summaries with first_step <= step <= last_step (-1: no bound), with
// covers_first_step/covers_last_step saying which steps it covers. Runs, their JSON and their
// HTML pages all take their peak from here.
PeakReport peak_over_steps(const std::vector<Tracker::StepSummary>& steps, int64_t first_step = -1, int64_t last_step = -1);

// "steps 0-5", "step 3" or "no steps": what a peak covers, in words.
std::string describe_coverage(const PeakReport& peak);

}  // namespace memory
}  // namespace frugal
