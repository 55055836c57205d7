#include "frugal/memory/memory_viz.h"

#include <map>
#include <stdexcept>

#include "frugal/io/pickle.h"

namespace frugal {
namespace memory {
std::string memory_viz_pickle(const std::vector<MemoryEvent>& events) {
  struct Live {
    int64_t bytes;
    int64_t device;
  };
  std::map<uint64_t, Live> live;
  std::map<int64_t, std::vector<const MemoryEvent*>> by_device;
  for (const MemoryEvent& e : events) {
    if (e.action != Action::alloc && e.action != Action::free) continue;
    const int64_t dev = e.device.is_cuda() ? e.device.index() : 0;
    by_device[dev].push_back(&e);
  }
  const int64_t n_devices = by_device.empty() ? 1 : by_device.rbegin()->first + 1;
  io::PickleWriter p;
  auto entry = [&](const char* action, const MemoryEvent& e, const char* category) {
    p.begin_dict()
        .key("action").value(action)
        .key("addr").value(static_cast<int64_t>(e.addr))
        .key("size").value(e.bytes)
        .key("stream").value(int64_t{0})
        .key("time_us").value(e.time_us)
        .key("category").value(category)
        .key("frames").begin_list().end_list()
        .end_dict();
  };
  p.begin_dict();
  p.key("device_traces").begin_list();
  for (int64_t d = 0; d < n_devices; ++d) {
    p.begin_list();
    for (const MemoryEvent* e : by_device[d]) {
      const char* category = category_name(e->category);
      if (e->action == Action::alloc) {
        live[e->addr] = {e->bytes, d};
        entry("segment_alloc", *e, "unknown");
        entry("alloc", *e, category);
      } else if (live.count(e->addr)) {  // a free of something allocated before the trace began is skipped
        live.erase(e->addr);
        entry("free_requested", *e, category);
        entry("free_completed", *e, category);
        entry("segment_free", *e, "unknown");
      }
    }
    p.end_list();
  }
  p.end_list();
  p.key("segments").begin_list();
  for (const auto& [addr, l] : live) {
    p.begin_dict()
        .key("device").value(l.device)
        .key("address").value(static_cast<int64_t>(addr))
        .key("total_size").value(l.bytes)
        .key("allocated_size").value(l.bytes)
        .key("active_size").value(l.bytes)
        .key("requested_size").value(l.bytes)
        .key("stream").value(int64_t{0})
        .key("segment_type").value("large")
        .key("segment_pool_id").pair(0, 0)
        .key("is_expandable").value(false)
        .key("frames").begin_list().end_list()
        .key("blocks").begin_list()
        .begin_dict()
        .key("address").value(static_cast<int64_t>(addr))
        .key("size").value(l.bytes)
        .key("requested_size").value(l.bytes)
        .key("state").value("active_allocated")
        .key("frames").begin_list().end_list()
        .end_dict()
        .end_list()
        .end_dict();
  }
  p.end_list();
  p.end_dict();
  return p.finish();
}

}  // namespace memory
}  // namespace frugal
