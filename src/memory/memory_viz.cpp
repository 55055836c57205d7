#include "frugal/memory/memory_viz.h"

#include <algorithm>
#include <map>
#include <stdexcept>
#include <string>
#include <vector>

#include "frugal/io/pickle.h"

namespace frugal {
namespace memory {
namespace {

// The viewer's device index: CUDA device i is i (as torch numbers them); the CPU's memory, which
// torch's snapshots never hold, comes after the last CUDA device (0 when there is none).
struct DeviceIndex {
  int64_t cuda_count = 0;
  explicit DeviceIndex(const std::vector<MemoryEvent>& events) {
    for (const MemoryEvent& e : events) {
      if (e.device.is_cuda()) cuda_count = std::max<int64_t>(cuda_count, e.device.index() + 1);
    }
  }
  int64_t operator()(const c10::Device& d) const { return d.is_cuda() ? d.index() : cuda_count; }
};

// An address range the trace touched (the union of its allocations' ranges on one device).
struct Region {
  uint64_t begin = 0, end = 0;
};

}  // namespace

std::string memory_viz_pickle(const Trace& trace) {
  const std::vector<MemoryEvent>& events = trace.events;
  const DeviceIndex index(events);
  int64_t n_devices = 1;
  for (const MemoryEvent& e : events) {
    if (e.action == Action::alloc || e.action == Action::free) n_devices = std::max(n_devices, index(e.device) + 1);
  }

  // Per device: the trace's alloc/free events, the blocks still live at the end, every range touched.
  std::vector<std::vector<const MemoryEvent*>> by_device(static_cast<size_t>(n_devices));
  std::vector<std::map<uint64_t, int64_t>> live(static_cast<size_t>(n_devices));  // addr -> bytes
  std::vector<std::vector<Region>> ranges(static_cast<size_t>(n_devices));
  for (const MemoryEvent& e : events) {
    if (e.action != Action::alloc && e.action != Action::free) continue;
    const size_t d = static_cast<size_t>(index(e.device));
    if (e.action == Action::alloc) {
      live[d][e.addr] = e.bytes;
      ranges[d].push_back({e.addr, e.addr + static_cast<uint64_t>(std::max<int64_t>(e.bytes, 1))});
    } else if (!live[d].erase(e.addr)) {
      continue;  // a free of something allocated before the trace began
    }
    by_device[d].push_back(&e);
  }

  io::PickleWriter p;
  auto entry = [&](const char* action, const MemoryEvent& e) {
    // The frame is what the viewer shows beside a block on hover: frugal's category, phase and step.
    const std::string where =
        std::string("category=") + category_name(e.category) + " phase=" + phase_name(e.phase) + " step=" + std::to_string(e.step);
    p.begin_dict()
        .key("action")
        .value(action)
        .key("addr")
        .value(static_cast<int64_t>(e.addr))
        .key("size")
        .value(e.bytes)
        .key("stream")
        .value(int64_t{0})
        .key("time_us")
        .value(trace.start_unix_us + e.time_us)
        .key("category")
        .value(category_name(e.category))
        .key("frames")
        .begin_list()
        .begin_dict()
        .key("filename")
        .value("frugal")
        .key("line")
        .value(e.step)
        .key("name")
        .value(where)
        .end_dict()
        .end_list()
        .end_dict();
  };
  p.begin_dict();
  p.key("device_traces").begin_list();
  for (const auto& device_events : by_device) {
    p.begin_list();
    for (const MemoryEvent* e : device_events) {
      if (e->action == Action::alloc) {
        entry("alloc", *e);
      } else {
        entry("free_requested", *e);
        entry("free_completed", *e);
      }
    }
    p.end_list();
  }
  p.end_list();
  // Segments: the address ranges the trace touched, merged, present from its start to its end, so
  // every block of the trace lies in one (the viewer finds a block's pool by address). Each is tiled
  // by the blocks live at the end and inactive gaps. No caching allocator reserves memory here:
  // what the viewer draws as reserved is the ranges touched.
  p.key("segments").begin_list();
  for (size_t d = 0; d < ranges.size(); ++d) {
    std::vector<Region>& r = ranges[d];
    std::sort(r.begin(), r.end(), [](const Region& a, const Region& b) { return a.begin < b.begin; });
    std::vector<Region> merged;
    for (const Region& x : r) {
      if (!merged.empty() && x.begin <= merged.back().end)
        merged.back().end = std::max(merged.back().end, x.end);
      else
        merged.push_back(x);
    }
    for (const Region& m : merged) {
      int64_t allocated = 0;
      auto first = live[d].lower_bound(m.begin);
      for (auto it = first; it != live[d].end() && it->first < m.end; ++it) allocated += it->second;
      p.begin_dict()
          .key("device")
          .value(static_cast<int64_t>(d))
          .key("address")
          .value(static_cast<int64_t>(m.begin))
          .key("total_size")
          .value(static_cast<int64_t>(m.end - m.begin))
          .key("allocated_size")
          .value(allocated)
          .key("active_size")
          .value(allocated)
          .key("requested_size")
          .value(allocated)
          .key("stream")
          .value(int64_t{0})
          .key("segment_type")
          .value("large")
          .key("segment_pool_id")
          .pair(0, 0)
          .key("is_expandable")
          .value(false)
          .key("frames")
          .begin_list()
          .end_list()
          .key("blocks")
          .begin_list();
      auto block = [&](uint64_t addr, int64_t size, int64_t requested, const char* state) {
        p.begin_dict()
            .key("address")
            .value(static_cast<int64_t>(addr))
            .key("size")
            .value(size)
            .key("requested_size")
            .value(requested)
            .key("state")
            .value(state)
            .key("frames")
            .begin_list()
            .end_list()
            .end_dict();
      };
      uint64_t at = m.begin;
      for (auto it = first; it != live[d].end() && it->first < m.end; ++it) {
        if (it->first > at) block(at, static_cast<int64_t>(it->first - at), 0, "inactive");
        block(it->first, std::max<int64_t>(it->second, 1), it->second, "active_allocated");
        at = it->first + static_cast<uint64_t>(std::max<int64_t>(it->second, 1));
      }
      if (at < m.end) block(at, static_cast<int64_t>(m.end - at), 0, "inactive");
      p.end_list().end_dict();
    }
  }
  p.end_list();
  p.end_dict();
  return p.finish();
}

}  // namespace memory
}  // namespace frugal
