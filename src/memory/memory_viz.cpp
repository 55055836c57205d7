#include "frugal/memory/memory_viz.h"

#include <map>
#include <stdexcept>

#include "frugal/io/json_value.h"
#include "frugal/io/pickle.h"

namespace frugal {
namespace memory {
namespace {

Action parse_action(const std::string& s) {
  for (Action a : {Action::alloc, Action::free, Action::phase_begin, Action::phase_end, Action::step}) {
    if (s == action_name(a)) return a;
  }
  throw std::invalid_argument("trace: unknown action '" + s + "'");
}

Phase parse_phase(const std::string& s) {
  for (Phase p : {Phase::idle, Phase::forward, Phase::backward, Phase::optimizer}) {
    if (s == phase_name(p)) return p;
  }
  throw std::invalid_argument("trace: unknown phase '" + s + "'");
}

Category parse_category_or_throw(const std::string& s) {
  const auto c = parse_category(s);
  if (!c) throw std::invalid_argument("trace: unknown category '" + s + "'");
  return *c;
}

MemoryEvent parse_event(const io::JsonValue& e) {
  MemoryEvent ev;
  ev.time_us = e.at("time_us").as_int();
  ev.action = parse_action(e.at("action").as_string());
  ev.bytes = e.at("bytes").as_int();
  ev.category = parse_category_or_throw(e.at("category").as_string());
  ev.phase = parse_phase(e.at("phase").as_string());
  ev.device = c10::Device(e.at("device").as_string());
  ev.step = e.at("step").as_int();
  const io::JsonValue* addr = e.find("addr");
  ev.addr = addr ? static_cast<uint64_t>(addr->as_int()) : 0;
  if (ev.bytes < 0) throw std::invalid_argument("trace: negative size");
  return ev;
}

Tracker::StepSummary parse_step(const io::JsonValue& s) {
  Tracker::StepSummary out;
  out.step = s.at("step").as_int();
  out.peak_bytes = s.at("peak_bytes").as_int();
  if (out.peak_bytes < 0) throw std::invalid_argument("trace: negative peak_bytes in step " + std::to_string(out.step));
  for (const auto& [name, bytes] : s.at("breakdown").members()) {
    out.breakdown[static_cast<int>(parse_category_or_throw(name))] = bytes.as_int();
  }
  return out;
}

}  // namespace

Timeline read_timeline(const std::string& text) {
  Timeline out;
  try {
    // Events are parsed one at a time: a long trace is never held whole as a JSON tree.
    const io::JsonValue root =
        io::parse_json_streaming(text, "events", [&](const io::JsonValue& e) { out.events.push_back(parse_event(e)); });
    if (!root.is_object()) throw std::invalid_argument("trace: not a JSON object");
    root.at("events").items();  // JsonError when it is missing or not an array
    // Older traces and hand-written ones have no step summaries; the events still make a timeline.
    if (const io::JsonValue* steps = root.find("steps")) {
      for (const io::JsonValue& s : steps->items()) out.steps.push_back(parse_step(s));
    }
  } catch (const io::JsonError& e) {
    throw std::invalid_argument(std::string("trace: ") + e.what());
  } catch (const c10::Error& e) {
    throw std::invalid_argument(std::string("trace: bad device: ") + e.what_without_backtrace());
  }
  return out;
}

std::vector<MemoryEvent> read_timeline_json(const std::string& text) { return read_timeline(text).events; }

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
