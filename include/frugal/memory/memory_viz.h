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
//   frugal::memory::Trace t = frugal::memory::read_trace(text);      // a --trace-out file
//   std::string pickle = frugal::memory::memory_viz_pickle(t.events);
#pragma once

#include <string>
#include <vector>

#include "frugal/memory/trace.h"

namespace frugal {
namespace memory {

std::string memory_viz_pickle(const std::vector<MemoryEvent>& events);

}  // namespace memory
}  // namespace frugal
