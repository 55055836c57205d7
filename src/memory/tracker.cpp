#include "frugal/memory/tracker.h"

#include <c10/core/Allocator.h>
#include <c10/util/ThreadLocalDebugInfo.h>

#include <algorithm>

#include "frugal/io/json.h"

namespace frugal {
namespace memory {
namespace {

constexpr size_t kNotRecorded = static_cast<size_t>(-1);  // an allocation outside the captured steps

// The total_allocated/total_reserved parameter types of reportMemoryUsage changed between LibTorch
// 1.13 (int64_t) and 2.x (size_t); read them off the base class so one override fits both.
template <typename F>
struct ReportSignature;
template <typename C, typename P, typename S, typename T, typename R, typename D>
struct ReportSignature<void (C::*)(P, S, T, R, D)> {
  using Total = T;
  using Reserved = R;
};
using ReportFn = decltype(&c10::MemoryReportingInfoBase::reportMemoryUsage);
using TotalBytes = ReportSignature<ReportFn>::Total;
using ReservedBytes = ReportSignature<ReportFn>::Reserved;
template <typename F>
struct OomSignature;
template <typename C, typename S, typename T, typename R, typename D>
struct OomSignature<void (C::*)(S, T, R, D)> {
  using Total = T;
  using Reserved = R;
};
using OomFn = decltype(&c10::MemoryReportingInfoBase::reportOutOfMemory);

// One reporter per open scope: c10 calls it on the allocating (or freeing) thread, and it forwards
// to the shared tracker with the scope's identity. Autograd copies the thread's debug info into its
// worker threads, so allocations there land in the scope that launched the backward.
class ScopeReporter final : public c10::MemoryReportingInfoBase {
 public:
  ScopeReporter(std::shared_ptr<Tracker> tracker, int64_t scope_id, Category category, Phase phase)
      : tracker_(std::move(tracker)), scope_id_(scope_id), category_(category), phase_(phase) {}

  void reportMemoryUsage(void* ptr, int64_t alloc_size, TotalBytes /*total_allocated*/,
                         ReservedBytes /*total_reserved*/, c10::Device device) override {
    tracker_->on_report(ptr, alloc_size, device, scope_id_, category_, phase_);
  }
  bool memoryProfilingEnabled() const override { return true; }
  void reportOutOfMemory(int64_t alloc_size, OomSignature<OomFn>::Total /*total_allocated*/,
                         OomSignature<OomFn>::Reserved /*total_reserved*/, c10::Device /*device*/) override {
    tracker_->on_out_of_memory(alloc_size, phase_);
  }

  const std::shared_ptr<Tracker>& tracker() const { return tracker_; }
  Phase phase() const { return phase_; }

 private:
  std::shared_ptr<Tracker> tracker_;
  int64_t scope_id_;
  Category category_;
  Phase phase_;
};

ScopeReporter* current_reporter() {
  return dynamic_cast<ScopeReporter*>(c10::ThreadLocalDebugInfo::get(c10::DebugInfoKind::PROFILER_STATE));
}

// Pushes a reporter for a new scope on this thread's debug-info stack; pops and closes it on exit.
class ScopeInstall {
 public:
  ScopeInstall(std::shared_ptr<Tracker> tracker, Category category, Phase phase, bool reclassify)
      : tracker_(tracker), id_(tracker->open_scope(reclassify)) {
    guard_.emplace(c10::DebugInfoKind::PROFILER_STATE,
                   std::make_shared<ScopeReporter>(std::move(tracker), id_, category, phase));
  }
  ~ScopeInstall() {
    guard_.reset();
    tracker_->close_scope(id_);
  }

 private:
  std::shared_ptr<Tracker> tracker_;
  int64_t id_;
  std::optional<c10::DebugInfoGuard> guard_;
};

}  // namespace

const char* action_name(Action a) {
  switch (a) {
    case Action::alloc: return "alloc";
    case Action::free: return "free";
    case Action::phase_begin: return "phase_begin";
    case Action::phase_end: return "phase_end";
    case Action::step: return "step";
  }
  return "alloc";
}

std::shared_ptr<Tracker> Tracker::create(bool keep_events) { return std::shared_ptr<Tracker>(new Tracker(keep_events)); }

Tracker::Tracker(bool keep_events) : keep_events_(keep_events), t0_(std::chrono::steady_clock::now()) {}

int64_t Tracker::now_us() const {
  return std::chrono::duration_cast<std::chrono::microseconds>(std::chrono::steady_clock::now() - t0_)
      .count();
}

void Tracker::on_report(void* ptr, int64_t size, c10::Device device, int64_t scope_id,
                        Category category, Phase phase) {
  if (size == 0) return;
  const int64_t t = now_us();
  std::lock_guard<std::mutex> lock(mutex_);
  auto dev = std::find_if(device_live_.begin(), device_live_.end(),
                          [&](const DeviceCounter& d) { return d.device == device; });
  if (dev == device_live_.end()) {
    device_live_.push_back({device, 0});
    dev = device_live_.end() - 1;
  }
  const int64_t step = step_.load();
  if (size > 0) {
    const bool record = capturing();
    live_.insert_or_assign(ptr, Allocation{size, record ? events_.size() : kNotRecorded, scope_id, category, device});
    if (record) {
      events_.push_back(MemoryEvent{t, Action::alloc, size, category, phase, device, reinterpret_cast<uint64_t>(ptr), step});
    }
    dev->live += size;
    const int c = static_cast<int>(category);
    category_live_[c] += size;
    live_max_by_category_[c] = std::max(live_max_by_category_[c], category_live_[c]);
    total_live_ += size;
    if (limit_ > 0 && total_live_ > limit_ && !limit_report_.exceeded) {
      limit_report_ = LimitReport{true, false, total_live_, size, step, phase, category_live_};
    }
    if (total_live_ > peak_) {
      peak_ = total_live_;
      live_breakdown_at_peak_ = category_live_;
    }
    if (total_live_ > current_summary_.peak_bytes) {
      current_summary_.peak_bytes = total_live_;
      current_summary_.breakdown = category_live_;
    }
    return;
  }
  auto it = live_.find(ptr);
  if (it == live_.end()) {
    untracked_frees_.fetch_add(1);
    return;
  }
  Allocation a = it->second;
  live_.erase(it);
  dev->live -= a.bytes;
  category_live_[static_cast<int>(a.category)] -= a.bytes;
  total_live_ -= a.bytes;
  Category final_category = a.category;
  if (open_scopes_.count(a.scope_id)) {
    // Made and freed inside the same scope: a temporary, in the timeline too.
    final_category = Category::temporary;
    if (a.event_index != kNotRecorded) events_[a.event_index].category = Category::temporary;
  }
  if (a.event_index != kNotRecorded) {  // its allocation is in the timeline, so its free is too
    events_.push_back(MemoryEvent{t, Action::free, a.bytes, final_category, phase, device, reinterpret_cast<uint64_t>(ptr), step});
  }
}

int64_t Tracker::open_scope(bool reclassify_transients) {
  std::lock_guard<std::mutex> lock(mutex_);
  const int64_t id = next_scope_++;
  if (reclassify_transients) open_scopes_.insert(id);
  return id;
}

bool Tracker::retag(const void* ptr, Category category) {
  std::lock_guard<std::mutex> lock(mutex_);
  auto it = live_.find(const_cast<void*>(ptr));
  if (it == live_.end()) return false;
  Allocation& a = it->second;
  category_live_[static_cast<int>(a.category)] -= a.bytes;
  category_live_[static_cast<int>(category)] += a.bytes;
  a.category = category;
  a.scope_id = 0;  // no scope: never reclassified as temporary
  if (a.event_index != kNotRecorded) events_[a.event_index].category = category;
  return true;
}

void Tracker::close_scope(int64_t id) {
  std::lock_guard<std::mutex> lock(mutex_);
  open_scopes_.erase(id);
}

void Tracker::mark(Action action, Phase phase) {
  const int64_t t = now_us();
  std::lock_guard<std::mutex> lock(mutex_);
  if (!capturing()) return;
  events_.push_back(
      MemoryEvent{t, action, 0, default_category(phase), phase, c10::Device(c10::kCPU), 0, step_.load()});
}

void Tracker::mark_step(int64_t step) {
  {
    std::lock_guard<std::mutex> lock(mutex_);
    if (current_summary_.step >= 0) summaries_.push_back(current_summary_);
    current_summary_ = StepSummary{step, total_live_, category_live_};
  }
  step_.store(step);
  mark(Action::step, Phase::idle);
}

bool Tracker::capturing() const {
  if (!keep_events_) return false;
  return capture_steps_.empty() || std::binary_search(capture_steps_.begin(), capture_steps_.end(), step_.load());
}

void Tracker::set_capture_steps(std::vector<int64_t> steps) {
  std::sort(steps.begin(), steps.end());
  std::lock_guard<std::mutex> lock(mutex_);
  capture_steps_ = std::move(steps);
}

std::vector<Tracker::StepSummary> Tracker::step_summaries() const {
  std::lock_guard<std::mutex> lock(mutex_);
  std::vector<StepSummary> out = summaries_;
  if (current_summary_.step >= 0) out.push_back(current_summary_);
  return out;
}

void Tracker::set_limit(int64_t bytes) {
  std::lock_guard<std::mutex> lock(mutex_);
  limit_ = bytes;
  limit_report_ = LimitReport();
}

Tracker::LimitReport Tracker::limit_report() const {
  std::lock_guard<std::mutex> lock(mutex_);
  return limit_report_;
}

void Tracker::on_out_of_memory(int64_t requested_bytes, Phase phase) {
  std::lock_guard<std::mutex> lock(mutex_);
  if (limit_report_.exceeded) return;
  limit_report_ = LimitReport{true, true, total_live_, requested_bytes, step_.load(), phase, category_live_};
}

int64_t Tracker::live_bytes() const {
  std::lock_guard<std::mutex> lock(mutex_);
  return total_live_;
}

int64_t Tracker::live_bytes(c10::Device device) const {
  std::lock_guard<std::mutex> lock(mutex_);
  for (const auto& d : device_live_) {
    if (d.device == device) return d.live;
  }
  return 0;
}

CategoryBytes Tracker::live_by_category() const {
  std::lock_guard<std::mutex> lock(mutex_);
  return category_live_;
}

int64_t Tracker::peak_bytes() const {
  std::lock_guard<std::mutex> lock(mutex_);
  return peak_;
}

void Tracker::reset_peak() {
  const int64_t t = now_us();
  std::lock_guard<std::mutex> lock(mutex_);
  peak_ = total_live_;
  live_breakdown_at_peak_ = category_live_;
  live_max_by_category_ = category_live_;
  peak_since_event_ = events_.size();
  peak_since_us_ = t;
}

PeakReport Tracker::peak_report(std::optional<c10::Device> device) const {
  std::lock_guard<std::mutex> lock(mutex_);
  PeakReport r;
  if (!keep_events_ || !capture_steps_.empty()) {  // no full timeline to replay: the live maxima
    r.peak_bytes = peak_;
    r.breakdown = live_breakdown_at_peak_;
    r.max_by_category = live_max_by_category_;
    r.peak_step = step_.load();
    return r;
  }
  CategoryBytes live{};
  int64_t total = 0;
  bool seeded = false;
  // Considers the current state as a peak candidate (the state at the reset counts too).
  auto consider = [&](int64_t time_us, int64_t step) {
    if (!seeded || total > r.peak_bytes) {
      r.peak_bytes = total;
      r.peak_time_us = time_us;
      r.peak_step = step;
      r.breakdown = live;
    }
    for (int c = 0; c < kNumCategories; ++c) r.max_by_category[c] = std::max(r.max_by_category[c], live[c]);
    seeded = true;
  };
  for (size_t i = 0; i < events_.size(); ++i) {
    const MemoryEvent& e = events_[i];
    if (e.action != Action::alloc && e.action != Action::free) continue;
    if (device && e.device != *device) continue;
    const bool counts = i >= peak_since_event_;
    if (counts && !seeded) consider(e.time_us, e.step);
    const int64_t signed_bytes = e.action == Action::alloc ? e.bytes : -e.bytes;
    live[static_cast<int>(e.category)] += signed_bytes;
    total += signed_bytes;
    if (counts) consider(e.time_us, e.step);
  }
  if (!seeded) consider(peak_since_us_, step_.load());
  return r;
}

std::vector<MemoryEvent> Tracker::events() const {
  std::lock_guard<std::mutex> lock(mutex_);
  return events_;
}

std::vector<c10::Device> Tracker::devices() const {
  std::lock_guard<std::mutex> lock(mutex_);
  std::vector<c10::Device> out;
  for (const auto& d : device_live_) out.push_back(d.device);
  return out;
}

void Tracker::write_timeline_json(std::ostream& out) const {
  const std::vector<MemoryEvent> evs = events();
  io::JsonWriter w(out, 0);
  w.begin_object().key("categories").begin_array();
  for (Category c : kAllCategories) w.value(category_name(c));
  w.end_array().key("steps").begin_array();
  for (const StepSummary& s : step_summaries()) {
    out << '\n';
    w.begin_object().key("step").value(s.step).key("peak_bytes").value(s.peak_bytes).key("breakdown").begin_object();
    for (Category c : kAllCategories) w.key(category_name(c)).value(s.breakdown[static_cast<int>(c)]);
    w.end_object().end_object();
  }
  w.end_array().key("events").begin_array();
  for (const MemoryEvent& e : evs) {
    out << '\n';
    w.begin_object()
        .key("time_us").value(e.time_us)
        .key("action").value(action_name(e.action))
        .key("bytes").value(e.bytes)
        .key("category").value(category_name(e.category))
        .key("phase").value(phase_name(e.phase))
        .key("device").value(e.device.str())
        .key("step").value(e.step)
        .key("addr").value(static_cast<int64_t>(e.addr))
        .end_object();
  }
  w.end_array().end_object();
  out << '\n';
}

// ---- guards ----

struct TrackingGuard::Impl {
  std::optional<ScopeInstall> install;
};

TrackingGuard::TrackingGuard(std::shared_ptr<Tracker> tracker) : impl_(new Impl) {
  // The base scope declares nothing, so what is freed while it is open keeps its category.
  impl_->install.emplace(std::move(tracker), Category::other, Phase::idle, /*reclassify=*/false);
}
TrackingGuard::~TrackingGuard() = default;

struct CategoryScope::Impl {
  std::optional<ScopeInstall> install;
};

CategoryScope::CategoryScope(Category category) : impl_(new Impl) {
  if (ScopeReporter* parent = current_reporter()) {
    impl_->install.emplace(parent->tracker(), category, parent->phase(), /*reclassify=*/true);
  }
}
CategoryScope::~CategoryScope() = default;

struct PhaseScope::Impl {
  std::shared_ptr<Tracker> tracker;
  Phase phase = Phase::idle;
  std::optional<ScopeInstall> install;
};

PhaseScope::PhaseScope(Phase phase) : PhaseScope(phase, default_category(phase)) {}

PhaseScope::PhaseScope(Phase phase, Category category) : impl_(new Impl) {
  if (ScopeReporter* parent = current_reporter()) {
    impl_->tracker = parent->tracker();
    impl_->phase = phase;
    impl_->tracker->mark(Action::phase_begin, phase);
    impl_->install.emplace(impl_->tracker, category, phase, /*reclassify=*/true);
  }
}

PhaseScope::~PhaseScope() {
  if (!impl_->tracker) return;
  impl_->install.reset();
  impl_->tracker->mark(Action::phase_end, impl_->phase);
}

std::shared_ptr<Tracker> current_tracker() {
  ScopeReporter* r = current_reporter();
  return r ? r->tracker() : nullptr;
}

void tag(const at::Tensor& tensor, Category category) {
  if (!tensor.defined() || !tensor.has_storage()) return;
  if (ScopeReporter* r = current_reporter()) r->tracker()->retag(tensor.storage().data(), category);
}

void mark_step(int64_t step) {
  if (ScopeReporter* r = current_reporter()) r->tracker()->mark_step(step);
}

}  // namespace memory
}  // namespace frugal
