#include "frugal/memory/trace.h"

#include <algorithm>
#include <stdexcept>

#include "frugal/io/json.h"
#include "frugal/io/json_value.h"

namespace frugal {
namespace memory {
namespace {

constexpr const char* kFormat = "frugal-trace";
constexpr int64_t kMaxTimeUs = int64_t{1} << 53;
constexpr int64_t kVersion = 4;  // 3: the evaluation and sampling phases; 4: start_unix_us

// ---- reading ----

Action parse_action(const std::string& s) {
  for (Action a : {Action::alloc, Action::free, Action::phase_begin, Action::phase_end, Action::step}) {
    if (s == action_name(a)) return a;
  }
  throw std::invalid_argument("trace: unknown action '" + s + "'");
}

Phase parse_phase(const std::string& s) {
  for (Phase p : {Phase::idle, Phase::forward, Phase::backward, Phase::optimizer, Phase::evaluation, Phase::sampling}) {
    if (s == phase_name(p)) return p;
  }
  throw std::invalid_argument("trace: unknown phase '" + s + "'");
}

Category parse_category_or_throw(const std::string& s) {
  const auto c = parse_category(s);
  if (!c) throw std::invalid_argument("trace: unknown category '" + s + "'");
  return *c;
}

int64_t add_or_throw(int64_t a, int64_t b, const std::string& what) {
  int64_t sum = 0;
  if (__builtin_add_overflow(a, b, &sum)) throw std::invalid_argument("trace: " + what + " pass 2^63 bytes");
  return sum;
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
  // Times are since the tracker started; with none negative, every difference the replay and the
  // page take (end - start) fits in 63 bits.
  // 2^53 us is 285 years: more is a damaged file, and the memory-viewer snapshot adds start_unix_us to it.
  if (ev.time_us < 0 || ev.time_us > kMaxTimeUs)
    throw std::invalid_argument("trace: time_us " + std::to_string(ev.time_us) + " is outside 0 to 2^53");
  return ev;
}

Tracker::StepSummary parse_step(const io::JsonValue& s) {
  Tracker::StepSummary out;
  out.step = s.at("step").as_int();
  out.peak_bytes = s.at("peak_bytes").as_int();
  if (out.peak_bytes < 0) throw std::invalid_argument("trace: negative peak_bytes in step " + std::to_string(out.step));
  if (const io::JsonValue* t = s.find("time_us")) out.time_us = t->as_int();
  if (out.time_us < 0) throw std::invalid_argument("trace: negative time_us in step " + std::to_string(out.step));
  if (const io::JsonValue* p = s.find("phase")) out.phase = parse_phase(p->as_string());
  int64_t sum = 0;
  for (const auto& [name, bytes] : s.at("breakdown").members()) {
    const int64_t b = bytes.as_int();
    if (b < 0) throw std::invalid_argument("trace: negative " + name + " bytes in step " + std::to_string(out.step));
    out.breakdown[static_cast<int>(parse_category_or_throw(name))] = b;
    sum = add_or_throw(sum, b, "step " + std::to_string(out.step) + "'s categories");
  }
  return out;
}

}  // namespace

// ---- writing ----

void write_trace(std::ostream& out, const Trace& trace) {
  io::JsonWriter w(out, 0);
  w.begin_object().key("format").value(kFormat).key("version").value(kVersion).key("start_unix_us").value(trace.start_unix_us);
  w.key("categories").begin_array();
  for (Category c : kAllCategories) w.value(category_name(c));
  w.end_array().key("steps").begin_array();
  for (const Tracker::StepSummary& s : trace.steps) {
    out << '\n';
    w.begin_object()
        .key("step")
        .value(s.step)
        .key("peak_bytes")
        .value(s.peak_bytes)
        .key("time_us")
        .value(s.time_us)
        .key("phase")
        .value(phase_name(s.phase))
        .key("breakdown")
        .begin_object();
    for (Category c : kAllCategories) w.key(category_name(c)).value(s.breakdown[static_cast<int>(c)]);
    w.end_object().end_object();
  }
  w.end_array();
  if (!trace.labels.empty()) {
    w.key("labels").begin_array();
    for (const Tracker::Label& l : trace.labels) w.begin_object().key("time_us").value(l.time_us).key("text").value(l.text).end_object();
    w.end_array();
  }
  w.key("events").begin_array();
  for (const MemoryEvent& e : trace.events) {
    out << '\n';
    w.begin_object()
        .key("time_us")
        .value(e.time_us)
        .key("action")
        .value(action_name(e.action))
        .key("bytes")
        .value(e.bytes)
        .key("category")
        .value(category_name(e.category))
        .key("phase")
        .value(phase_name(e.phase))
        .key("device")
        .value(e.device.str())
        .key("step")
        .value(e.step)
        .key("addr")
        .value(static_cast<int64_t>(e.addr))
        .end_object();
  }
  w.end_array().end_object();
  out << '\n';
}

Trace read_trace(const std::string& text) {
  Trace out;
  int64_t allocated = 0;  // every alloc's bytes: bounds any live total the replay can reach
  CategoryBytes live{};   // per category, as the replay will see it: never below zero
  try {
    const io::JsonValue root = io::parse_json_streaming(text, "events", [&](const io::JsonValue& e) {
      out.events.push_back(parse_event(e));
      const MemoryEvent& ev = out.events.back();
      int64_t& now = live[static_cast<int>(ev.category)];
      if (ev.action == Action::alloc) {
        allocated = add_or_throw(allocated, ev.bytes, "the allocations");
        now += ev.bytes;  // <= allocated, so it cannot overflow
      } else if (ev.action == Action::free) {
        if (ev.bytes > now) {
          throw std::invalid_argument("trace: event " + std::to_string(out.events.size() - 1) + " frees " + std::to_string(ev.bytes) + " " +
                                      category_name(ev.category) + " bytes but only " + std::to_string(now) + " are live");
        }
        now -= ev.bytes;
      }
    });
    if (!root.is_object()) throw std::invalid_argument("trace: not a JSON object");
    if (const io::JsonValue* format = root.find("format")) {
      if (format->as_string() != kFormat) throw std::invalid_argument("trace: format is '" + format->as_string() + "', not frugal-trace");
      const int64_t version = root.at("version").as_int();
      if (version > kVersion) {
        throw std::invalid_argument("trace: version " + std::to_string(version) + " is newer than this frugal reads (" +
                                    std::to_string(kVersion) + ")");
      }
    }
    root.at("events").items();  // JsonError when it is missing or not an array
    if (const io::JsonValue* start = root.find("start_unix_us")) {
      out.start_unix_us = start->as_int();
      if (out.start_unix_us < 0 || out.start_unix_us > kMaxTimeUs) throw std::invalid_argument("trace: start_unix_us is out of range");
    }
    // Older traces and hand-written ones have no step summaries; the events still make a timeline.
    if (const io::JsonValue* steps = root.find("steps")) {
      for (const io::JsonValue& s : steps->items()) out.steps.push_back(parse_step(s));
    }
    if (const io::JsonValue* labels = root.find("labels")) {
      for (const io::JsonValue& l : labels->items()) {
        out.labels.push_back({l.at("time_us").as_int(), l.at("text").as_string()});
        if (out.labels.back().time_us < 0) throw std::invalid_argument("trace: negative time_us in label '" + out.labels.back().text + "'");
      }
    }
  } catch (const io::JsonError& e) {
    throw std::invalid_argument(std::string("trace: ") + e.what());
  } catch (const c10::Error& e) {
    throw std::invalid_argument(std::string("trace: bad device: ") + e.what_without_backtrace());
  }
  return out;
}

// ---- replay ----

int64_t LiveSample::total() const {
  int64_t sum = 0;
  for (int64_t b : bytes) sum += b;
  return sum;
}

std::vector<LiveSample> replay_live_bytes(const std::vector<MemoryEvent>& events) {
  std::vector<LiveSample> out;
  LiveSample now;
  bool first = true;
  for (const MemoryEvent& e : events) {
    if (e.action != Action::alloc && e.action != Action::free) continue;
    // A free carries its allocation's final category, as its alloc does.
    now.bytes[static_cast<int>(e.category)] += e.action == Action::alloc ? e.bytes : -e.bytes;
    now.time_us = first ? e.time_us : std::max(now.time_us, e.time_us);
    now.step = e.step;
    now.phase = e.phase;
    first = false;
    out.push_back(now);
  }
  return out;
}

LiveSample peak_sample(const std::vector<LiveSample>& samples) {
  LiveSample best;
  for (const LiveSample& s : samples) {
    if (&s == &samples.front() || s.total() > best.total()) best = s;
  }
  return best;
}

CategoryBytes max_by_category(const std::vector<MemoryEvent>& events, size_t from_event) {
  CategoryBytes live{}, out{};
  for (size_t i = 0; i < events.size(); ++i) {
    const MemoryEvent& e = events[i];
    if (i == from_event) out = live;
    if (e.action != Action::alloc && e.action != Action::free) continue;
    live[static_cast<int>(e.category)] += e.action == Action::alloc ? e.bytes : -e.bytes;
    if (i < from_event) continue;
    for (int c = 0; c < kNumCategories; ++c) out[c] = std::max(out[c], live[c]);
  }
  if (from_event >= events.size()) out = live;
  return out;
}

std::vector<Tracker::StepSummary> step_peaks(const std::vector<LiveSample>& samples) {
  std::vector<Tracker::StepSummary> out;
  LiveSample before;
  for (const LiveSample& s : samples) {
    if (out.empty() || out.back().step != s.step) out.push_back({{before.total(), s.time_us, Phase::idle, before.bytes}, s.step});
    out.back().raise(s.total(), s.time_us, s.phase, s.bytes);
    before = s;
  }
  return out;
}

PeakReport peak_over_steps(const std::vector<Tracker::StepSummary>& steps, int64_t first_step, int64_t last_step) {
  PeakReport r;
  bool any = false;
  for (const Tracker::StepSummary& s : steps) {
    if ((first_step >= 0 && s.step < first_step) || (last_step >= 0 && s.step > last_step)) continue;
    r.covers_first_step = any ? std::min(r.covers_first_step, s.step) : s.step;
    r.covers_last_step = any ? std::max(r.covers_last_step, s.step) : s.step;
    if (!any || s.peak_bytes > r.peak_bytes) {
      static_cast<PeakMoment&>(r) = s;
      r.peak_step = s.step;
    }
    any = true;
  }
  return r;
}

std::string describe_coverage(const PeakReport& p) {
  if (p.covers_first_step < 0 && p.covers_last_step < 0) return "set-up only";
  const std::string from = p.covers_first_step < 0 ? "set-up" : "step " + std::to_string(p.covers_first_step);
  if (p.covers_first_step == p.covers_last_step) return from;
  if (p.covers_first_step < 0) return "set-up and steps 0-" + std::to_string(p.covers_last_step);
  return "steps " + std::to_string(p.covers_first_step) + "-" + std::to_string(p.covers_last_step);
}

}  // namespace memory
}  // namespace frugal
