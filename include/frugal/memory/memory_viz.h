// frugal/memory/memory_viz.h — traces for PyTorch's memory viewer (pytorch.org/memory_viz).
//
// Turns a tracker trace into the snapshot that viewer loads: a pickle (protocol 2, only the
// opcodes its unpickler accepts) of {"segments": [...], "device_traces": [[...], ...]}.
// - One device trace per device, numbered as torch numbers them: CUDA device i at index i, the
//   CPU's memory after the last CUDA device (index 0 in a CPU-only trace).
// - Trace entries (alloc, free_requested + free_completed) carry addr, size, stream, category
//   (frugal's), time_us in microseconds since the Unix epoch (the trace's start_unix_us plus the
//   event's time; traces older than version 4 have no start, and their times stay relative), and
//   one frame, "frugal:<step>:category=C phase=P step=S", which the viewer shows on hover.
// - Segments are the address ranges the trace touched (its allocations' ranges, merged), present
//   for the whole trace, so the viewer finds every block's pool; each is tiled by the blocks still
//   allocated at the end (active_allocated) and inactive gaps.
//
//   frugal::memory::Trace t = frugal::memory::read_trace(text);      // a --trace-out file
//   std::string pickle = frugal::memory::memory_viz_pickle(t);
#pragma once

#include <string>
#include <vector>

#include "frugal/memory/trace.h"

namespace frugal {
namespace memory {

std::string memory_viz_pickle(const Trace& trace);

}  // namespace memory
}  // namespace frugal
