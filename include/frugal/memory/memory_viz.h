// frugal/memory/memory_viz.h — traces for PyTorch's memory viewer (pytorch.org/memory_viz).
//
// Turns a tracker timeline into the snapshot that viewer loads: a pickle (protocol 2, only the
// opcodes its unpickler accepts) of {"segments": [...], "device_traces": [[...]]}. Every tracked
// allocation becomes its own segment (segment_alloc + alloc ... free_requested + free_completed +
// segment_free), so the segments left at the end hold exactly the blocks still allocated and the
// viewer's state-history replay agrees with the trace. Trace entries carry addr, size, stream,
// time_us and category (frugal's categories; segment events are 'unknown'). CPU memory is shown as
// device 0.
//
//   auto events = frugal::memory::read_timeline_json(text);      // a --trace-out file
//   std::string pickle = frugal::memory::memory_viz_pickle(events);
//   frugal::memory::Timeline t = frugal::memory::read_timeline(text);   // events and step summaries
#pragma once

#include <string>
#include <vector>

#include "frugal/memory/tracker.h"

namespace frugal {
namespace memory {

// A whole --trace-out file: the events, and the per-step summaries the tracker keeps for every
// step (also for steps whose events were not captured).
struct Timeline {
  std::vector<MemoryEvent> events;
  std::vector<Tracker::StepSummary> steps;  // empty when the trace has none (or no "steps" key)
};

// Parses Tracker::write_timeline_json output. Throws std::invalid_argument naming the problem.
Timeline read_timeline(const std::string& text);
std::vector<MemoryEvent> read_timeline_json(const std::string& text);  // read_timeline(text).events

std::string memory_viz_pickle(const std::vector<MemoryEvent>& events);

}  // namespace memory
}  // namespace frugal
