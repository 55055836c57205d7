#include "frugal/memory/tracker.h"

#include <c10/core/Allocator.h>
#include <c10/util/ThreadLocalDebugInfo.h>
#include <torch/csrc/autograd/function.h>
#include <torch/csrc/autograd/function_hook.h>
#include <torch/csrc/autograd/variable.h>
#include <torch/nn/module.h>

#include <algorithm>
#include <iomanip>
#include <sstream>

#include "frugal/io/units.h"
#include "frugal/memory/trace.h"

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

  void reportMemoryUsage(void* ptr, int64_t alloc_size, TotalBytes /*total_allocated*/, ReservedBytes /*total_reserved*/,
                         c10::Device device) override {
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
    guard_.emplace(c10::DebugInfoKind::PROFILER_STATE, std::make_shared<ScopeReporter>(std::move(tracker), id_, category, phase));
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

std::shared_ptr<Tracker> Tracker::create(bool keep_events) {
  std::shared_ptr<Tracker> t(new Tracker(keep_events));
  t->self_ = t;
  return t;
}

Tracker::Tracker(bool keep_events)
    : keep_events_(keep_events),
      t0_(std::chrono::steady_clock::now()),
      start_unix_us_(std::chrono::duration_cast<std::chrono::microseconds>(std::chrono::system_clock::now().time_since_epoch()).count()) {}

int64_t Tracker::now_us() const {
  return std::chrono::duration_cast<std::chrono::microseconds>(std::chrono::steady_clock::now() - t0_).count();
}

void Tracker::on_report(void* ptr, int64_t size, c10::Device device, int64_t scope_id, Category category, Phase phase) {
  if (size == 0) return;
  const int64_t t = now_us();
  std::lock_guard<std::mutex> lock(mutex_);
  if (size > 0) {
    ++seq_;
    add_live(ptr, Allocation{size, kNotRecorded, scope_id, seq_, category, device, !open_scopes_.count(scope_id), backward_epoch_}, phase,
             t);
    return;
  }
  auto it = live_.find(ptr);
  if (it == live_.end()) {
    untracked_frees_.fetch_add(1);
    return;
  }
  // Rule 2: made and freed while its scope is open, so it was a temporary all along.
  if (it->second.scope_id != 0 && open_scopes_.count(it->second.scope_id)) settle(it->second, Category::temporary);
  // Without scopes: the program's forward kept it for backward, or made and dropped it.
  if (implicit_rules_ && it->second.undeclared && it->second.scope_id != 0) {
    if (phase == Phase::backward)
      settle(it->second, Category::activation);
    else if (phase == Phase::idle && it->second.backward_epoch == backward_epoch_)
      settle(it->second, Category::temporary);
  }
  drop_live(it, phase, t);
}

void Tracker::drop_live(std::unordered_map<void*, Allocation>::iterator it, Phase phase, int64_t t) {  // mutex_ held
  const Allocation a = it->second;
  void* ptr = it->first;
  live_.erase(it);
  for (auto& d : device_live_) {
    if (d.device == a.device) d.live -= a.bytes;
  }
  category_live_[static_cast<int>(a.category)] -= a.bytes;
  total_live_ -= a.bytes;
  if (a.event_index != kNotRecorded) {  // its allocation is in the timeline, so its free is too
    events_.push_back(MemoryEvent{t, Action::free, a.bytes, a.category, phase, a.device, reinterpret_cast<uint64_t>(ptr), step_.load()});
  }
}

void Tracker::sweep_adopted() {  // mutex_ held
  const int64_t t = now_us();
  std::vector<Adopted> kept;
  for (auto& a : adopted_) {
    auto it = live_.find(a.ptr);
    if (it == live_.end() || it->second.seq != a.seq) continue;  // gone already, or the address holds another
    if (a.storage.expired()) {
      drop_live(it, Phase::idle, t);
      continue;
    }
    kept.push_back(std::move(a));
  }
  adopted_ = std::move(kept);
}

void Tracker::add_live(void* ptr, Allocation a, Phase phase, int64_t t) {  // mutex_ held
  auto dev = std::find_if(device_live_.begin(), device_live_.end(), [&](const DeviceCounter& d) { return d.device == a.device; });
  if (dev == device_live_.end()) {
    device_live_.push_back({a.device, 0});
    dev = device_live_.end() - 1;
  }
  // An address is live once: an allocation at one still counted was freed unseen (memory adopted
  // from before tracking, whose frees c10 does not report).
  auto stale = live_.find(ptr);
  if (stale != live_.end()) drop_live(stale, phase, t);
  const int64_t step = step_.load();
  if (capturing()) {
    a.event_index = events_.size();
    events_.push_back(MemoryEvent{t, Action::alloc, a.bytes, a.category, phase, a.device, reinterpret_cast<uint64_t>(ptr), step});
  }
  live_.insert_or_assign(ptr, a);
  dev->live += a.bytes;
  category_live_[static_cast<int>(a.category)] += a.bytes;
  total_live_ += a.bytes;
  if (limit_ > 0 && total_live_ > limit_ && !limit_report_.exceeded) {
    limit_report_ = LimitReport{true, false, total_live_, a.bytes, step, phase, category_live_};
    limit_seq_ = seq_;
  }
  if (peak_.raise(total_live_, t, phase, category_live_)) {
    peak_.peak_step = step;
    peak_seq_ = seq_;
  }
  if (current_summary_.raise(total_live_, t, phase, category_live_)) current_summary_seq_ = seq_;
}

void Tracker::settle(Allocation& a, Category category) {
  const int from = static_cast<int>(a.category), to = static_cast<int>(category);
  if (from == to) return;
  // A moment recorded at seq r saw this allocation live exactly when a.seq <= r: it is live now,
  // and every record was taken before now.
  auto move = [&](int64_t record_seq, CategoryBytes& bytes) {
    if (record_seq < a.seq) return;
    bytes[from] -= a.bytes;
    bytes[to] += a.bytes;
  };
  category_live_[from] -= a.bytes;
  category_live_[to] += a.bytes;
  move(peak_seq_, peak_.breakdown);
  move(current_summary_seq_, current_summary_.breakdown);
  if (limit_report_.exceeded) move(limit_seq_, limit_report_.by_category);
  for (size_t i = static_cast<size_t>(std::lower_bound(summary_seqs_.begin(), summary_seqs_.end(), a.seq) - summary_seqs_.begin());
       i < summaries_.size(); ++i) {
    move(summary_seqs_[i], summaries_[i].breakdown);
  }
  if (a.event_index != kNotRecorded) events_[a.event_index].category = category;
  a.category = category;
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
  settle(it->second, category);  // rule 1: from its allocation on
  it->second.scope_id = 0;       // and never temporary
  return true;
}

void Tracker::close_scope(int64_t id) {
  std::lock_guard<std::mutex> lock(mutex_);
  open_scopes_.erase(id);
}

void Tracker::mark(Action action, Phase phase) {
  const int64_t t = now_us();
  std::lock_guard<std::mutex> lock(mutex_);
  if (action == Action::phase_begin && phase == Phase::backward) ++backward_epoch_;
  if (!adopted_.empty()) sweep_adopted();
  if (!capturing()) return;
  events_.push_back(MemoryEvent{t, action, 0, Category::other, phase, c10::Device(c10::kCPU), 0, step_.load()});
}

void Tracker::mark_step(int64_t step) {
  std::lock_guard<std::mutex> lock(mutex_);
  explicit_steps_ = true;
  step_boundary(step);
}

void Tracker::mark_implicit_step(int64_t step) {
  std::lock_guard<std::mutex> lock(mutex_);
  if (!explicit_steps_) step_boundary(step);
}

void Tracker::begin_implicit_phase(Phase /*phase*/) {
  std::lock_guard<std::mutex> lock(mutex_);
  implicit_rules_ = true;
}

bool Tracker::implicit_rules() const {
  std::lock_guard<std::mutex> lock(mutex_);
  return implicit_rules_;
}

void Tracker::step_boundary(int64_t step) {  // mutex_ held
  if (!adopted_.empty()) sweep_adopted();
  const int64_t t = now_us();
  if (current_summary_.step >= 0) {
    summaries_.push_back(current_summary_);
    summary_seqs_.push_back(current_summary_seq_);
  }
  current_summary_ = StepSummary{{total_live_, t, Phase::idle, category_live_}, step};
  current_summary_seq_ = seq_;
  step_.store(step);
  const bool now_capturing = capturing();
  if (now_capturing && !was_capturing_) record_live_allocations(t);
  was_capturing_ = now_capturing;
  if (now_capturing) {
    events_.push_back(MemoryEvent{t, Action::step, 0, Category::other, Phase::idle, c10::Device(c10::kCPU), 0, step});
  }
}

void Tracker::record_live_allocations(int64_t time_us) {
  std::vector<std::pair<void*, Allocation*>> missing;
  for (auto& [ptr, a] : live_) {
    if (a.event_index == kNotRecorded) missing.emplace_back(ptr, &a);
  }
  std::sort(missing.begin(), missing.end(), [](const auto& x, const auto& y) { return x.second->seq < y.second->seq; });
  for (auto& [ptr, a] : missing) {
    a->event_index = events_.size();
    events_.push_back(
        MemoryEvent{time_us, Action::alloc, a->bytes, a->category, Phase::idle, a->device, reinterpret_cast<uint64_t>(ptr), step_.load()});
  }
}

bool Tracker::capturing() const {  // mutex_ held
  if (!keep_events_) return false;
  return capture_steps_.empty() || std::binary_search(capture_steps_.begin(), capture_steps_.end(), step_.load());
}

void Tracker::set_capture_steps(std::vector<int64_t> steps) {
  std::sort(steps.begin(), steps.end());
  std::lock_guard<std::mutex> lock(mutex_);
  capture_steps_ = std::move(steps);
  was_capturing_ = capturing();
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
  limit_seq_ = seq_;
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
  return peak_.peak_bytes;
}

void Tracker::reset_peak() {
  const int64_t t = now_us();
  std::lock_guard<std::mutex> lock(mutex_);
  const int64_t step = step_.load();
  peak_ = PeakReport{{total_live_, t, Phase::idle, category_live_}, step, step, step};
  peak_seq_ = seq_;
}

PeakReport Tracker::peak_report() const {
  std::lock_guard<std::mutex> lock(mutex_);
  PeakReport r = peak_;
  r.covers_last_step = step_.load();
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

void Tracker::label(const std::string& text) {
  const int64_t t = now_us();
  std::lock_guard<std::mutex> lock(mutex_);
  labels_.push_back({t, text});
}

std::vector<Tracker::Label> Tracker::labels() const {
  std::lock_guard<std::mutex> lock(mutex_);
  return labels_;
}

Trace Tracker::trace() const {
  Trace t;
  t.events = events();
  t.steps = step_summaries();
  t.labels = labels();
  t.start_unix_us = start_unix_us_;
  return t;
}

void Tracker::write_timeline_json(std::ostream& out) const { write_trace(out, trace()); }

// ---- watching a model made before tracking ----

namespace {

// Tags a watched parameter's gradient the moment autograd has accumulated it.
class GradientTag : public torch::autograd::FunctionPostHook {
 public:
  GradientTag(std::weak_ptr<Tracker> tracker, at::Tensor param) : tracker_(std::move(tracker)), param_(std::move(param)) {}
  torch::autograd::variable_list operator()(const torch::autograd::variable_list& outputs,
                                            const torch::autograd::variable_list& /*inputs*/) override {
    const at::Tensor& grad = param_.grad();
    if (grad.defined() && grad.has_storage()) {
      if (auto t = tracker_.lock()) t->retag(grad.storage().data(), Category::gradient);
    }
    return outputs;
  }

 private:
  std::weak_ptr<Tracker> tracker_;
  at::Tensor param_;  // the accumulator holds it already
};

}  // namespace

struct Tracker::WatchHook {
  // kept alive so the hook stays on it: a shared_ptr in LibTorch 1.13, an intrusive_ptr in 2.x
  decltype(torch::autograd::impl::grad_accumulator(std::declval<const at::Tensor&>())) accumulator;
  uintptr_t key;
};

Tracker::~Tracker() {
  for (auto& h : watch_hooks_) h->accumulator->del_post_hook(h->key);
}

void Tracker::adopt(const at::Tensor& tensor, Category category) {  // mutex_ held
  if (!tensor.defined() || !tensor.has_storage()) return;
  void* ptr = const_cast<void*>(static_cast<const void*>(tensor.storage().data()));
  const auto bytes = static_cast<int64_t>(tensor.storage().nbytes());
  if (ptr == nullptr || bytes == 0) return;
  auto it = live_.find(ptr);
  if (it != live_.end()) {  // made while tracking: what it is, from its allocation on
    settle(it->second, category);
    it->second.scope_id = 0;
    return;
  }
  // Made before tracking: counted from now. c10 reports no free of memory allocated before its
  // reporting began, so the tracker watches for the storage to go (sweep_adopted).
  ++seq_;
  add_live(ptr, Allocation{bytes, kNotRecorded, 0, seq_, category, tensor.device(), false, backward_epoch_}, Phase::idle, now_us());
  adopted_.push_back({ptr, seq_, tensor.storage().getWeakStorageImpl()});
}

void Tracker::watch(const torch::nn::Module& module) { watch(module.parameters(/*recurse=*/true), module.buffers(/*recurse=*/true)); }

void Tracker::watch(const std::vector<at::Tensor>& parameters, const std::vector<at::Tensor>& buffers) {
  {
    std::lock_guard<std::mutex> lock(mutex_);
    implicit_rules_ = true;
    if (!adopted_.empty()) sweep_adopted();
    for (const auto& b : buffers) adopt(b, Category::parameter);
    for (const auto& p : parameters) {
      adopt(p, Category::parameter);
      if (p.defined()) adopt(p.grad(), Category::gradient);
    }
  }
  for (const auto& p : parameters) {
    if (!p.defined() || !p.requires_grad() || !p.is_leaf()) continue;
    auto h = std::make_shared<WatchHook>();
    h->accumulator = torch::autograd::impl::grad_accumulator(p);
    if (!h->accumulator) continue;
    h->key = h->accumulator->add_post_hook(std::make_unique<GradientTag>(self_, p));
    std::lock_guard<std::mutex> lock(mutex_);
    watch_hooks_.push_back(std::move(h));
  }
}

MemoryReport Tracker::report(int64_t first_step) const {
  const auto steps = step_summaries();
  const bool any = std::any_of(steps.begin(), steps.end(), [&](const StepSummary& s) { return s.step >= first_step; });
  return MemoryReport::from(any ? peak_over_steps(steps, first_step) : peak_report());
}

MemoryReport MemoryReport::from(const PeakReport& p) {
  MemoryReport r;
  r.peak_bytes = p.peak_bytes;
  r.peak_step = p.peak_step;
  r.peak_phase = p.phase;
  r.first_step = p.covers_first_step;
  r.last_step = p.covers_last_step;
  auto at = [&](Category c) { return p.breakdown[static_cast<int>(c)]; };
  r.parameter = at(Category::parameter);
  r.gradient = at(Category::gradient);
  r.optimizer_state = at(Category::optimizer_state);
  r.activation = at(Category::activation);
  r.temporary = at(Category::temporary);
  r.input = at(Category::input);
  r.other = at(Category::other);
  return r;
}

int64_t MemoryReport::at_peak(Category c) const {
  switch (c) {
    case Category::parameter: return parameter;
    case Category::gradient: return gradient;
    case Category::optimizer_state: return optimizer_state;
    case Category::activation: return activation;
    case Category::temporary: return temporary;
    case Category::input: return input;
    case Category::other: return other;
  }
  return 0;
}

CategoryBytes MemoryReport::breakdown() const {
  CategoryBytes b{};
  for (auto c : kAllCategories) b[static_cast<int>(c)] = at_peak(c);
  return b;
}

std::ostream& operator<<(std::ostream& out, const MemoryReport& r) {
  std::ostringstream s;
  s << "peak " << io::human_bytes(r.peak_bytes) << " (";
  if (r.peak_step >= 0)
    s << "step " << r.peak_step << ", ";
  else
    s << "set-up, ";
  s << phase_name(r.peak_phase) << "):";
  const char* sep = " ";
  for (auto c : kAllCategories) {
    s << sep << category_name(c) << " " << io::human_bytes(r.at_peak(c));
    sep = ", ";
  }
  return out << s.str();
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

void mark_step_if_implicit(int64_t step) {
  if (ScopeReporter* r = current_reporter()) r->tracker()->mark_implicit_step(step);
}

ImplicitPhase::ImplicitPhase(Phase phase) {
  ScopeReporter* r = current_reporter();
  if (r == nullptr || r->phase() != Phase::idle) return;
  r->tracker()->begin_implicit_phase(phase);
  scope_ = std::make_unique<PhaseScope>(phase);
}
ImplicitPhase::~ImplicitPhase() = default;

}  // namespace memory
}  // namespace frugal
