// frugal/memory/tracker.h — observe every tensor allocation and free, tagged with what it is for.
//
// The tracker is a c10::MemoryReportingInfoBase installed with c10::DebugInfoGuard, so c10's CPU
// allocator and the CUDA caching allocator report each allocation to it as it happens (no sampling).
// Scopes declare what is being allocated; autograd's worker threads inherit the open scope.
//
//   auto tracker = frugal::memory::Tracker::create();
//   { frugal::memory::TrackingGuard on(tracker);
//     { frugal::memory::PhaseScope fw(frugal::memory::Phase::forward); loss = model(x); }
//     { frugal::memory::PhaseScope bw(frugal::memory::Phase::backward); loss.backward(); } }
//   tracker->peak_report().breakdown;   // bytes per Category at the peak
//
// A model built before tracking began (the LibTorch habit) is adopted with watch(): its
// parameters and buffers count as parameter from then on, and its gradients as gradient whoever
// makes them. With frugal's optimizer and checkpointing and no scopes of the program's own, the
// steps and phases are marked for it (see "Without scopes" below), and report() answers with the
// steady-state peak:
//
//   auto model = MyNet();  auto tracker = frugal::memory::Tracker::create();
//   tracker->watch(*model);
//   frugal::memory::TrackingGuard on(tracker);
//   for (...) { auto loss = model->forward(x); opt.backward(loss); opt.step(); opt.zero_grad(); }
//   auto r = tracker->report();   // r.peak_bytes, r.parameter, r.at_peak(Category::activation)
//
// Categories follow the one rule in category.h (tag > freed inside its scope = temporary > the
// scope's category). The tracker applies it when it learns a fact (a free inside the scope, a
// tag) to the live counters, the event list, the recorded peak, every step summary and the limit
// report alike, so a run with events and one with counters only report the same numbers, and a
// replay of the trace (trace.h) gives them again.
#pragma once

#include <ATen/core/Tensor.h>
#include <c10/core/Device.h>

#include <array>
#include <atomic>
#include <chrono>
#include <cstdint>
#include <memory>
#include <mutex>
#include <optional>
#include <ostream>
#include <string>
#include <unordered_map>
#include <unordered_set>
#include <vector>

#include "frugal/memory/category.h"

namespace torch {
namespace nn {
class Module;
}  // namespace nn
}  // namespace torch

namespace frugal {
namespace memory {

enum class Action : uint8_t { alloc, free, phase_begin, phase_end, step };
const char* action_name(Action a);

// One entry of the timeline: an allocation or free, a phase boundary, or a step mark.
struct MemoryEvent {
  int64_t time_us = 0;  // since the tracker was created
  Action action = Action::alloc;
  int64_t bytes = 0;  // size of the allocation (alloc/free), 0 for markers
  Category category = Category::other;
  Phase phase = Phase::idle;
  c10::Device device = c10::Device(c10::kCPU);
  uint64_t addr = 0;
  int64_t step = -1;  // the step this event belongs to (-1 before the first mark_step)
};

using CategoryBytes = std::array<int64_t, kNumCategories>;
struct Trace;  // trace.h

// The highest live total over some span and what made it up: a step's summary and a run's peak
// are each one, updated by raise() alone.
struct PeakMoment {
  int64_t peak_bytes = 0;     // highest live total
  int64_t time_us = 0;        // when it was first reached
  Phase phase = Phase::idle;  // in which phase
  CategoryBytes breakdown{};  // live bytes per category at that moment
  // Takes this moment when total is above the peak so far (a tie keeps the earlier one); true
  // when it did.
  bool raise(int64_t total, int64_t t, Phase p, const CategoryBytes& bytes) {
    if (total <= peak_bytes) return false;
    peak_bytes = total;
    time_us = t;
    phase = p;
    breakdown = bytes;
    return true;
  }
};

// A run's peak: the moment, the step it fell in, and the steps it covers.
struct PeakReport : PeakMoment {
  int64_t peak_step = -1;
  // What the peak covers: the steps from covers_first_step to covers_last_step (-1: before the
  // first step, i.e. set-up).
  int64_t covers_first_step = -1, covers_last_step = -1;
};

// What a training run's memory was at its peak, by name: report() of a Tracker. The per-category
// fields are the bytes each category held at that moment.
struct MemoryReport {
  int64_t peak_bytes = 0;
  int64_t peak_step = -1;  // the step in which it was reached (-1: set-up)
  Phase peak_phase = Phase::idle;
  // The steps it covers (first_step -1: set-up included).
  int64_t first_step = -1, last_step = -1;
  int64_t parameter = 0, gradient = 0, optimizer_state = 0, activation = 0, temporary = 0, input = 0, other = 0;

  // The bytes category c held at the peak (the field of that name).
  int64_t at_peak(Category c) const;
  // Every category's bytes at the peak, indexed by static_cast<int>(Category).
  CategoryBytes breakdown() const;
  // The same peak by name (what trace.h's peak_over_steps returns, say).
  static MemoryReport from(const PeakReport& peak);
};
// "peak 113.0 MiB (step 2, backward): parameter 40.0 MiB, gradient ..." on one line.
std::ostream& operator<<(std::ostream& out, const MemoryReport& report);

// Sees every tensor allocation and free while installed (TrackingGuard) and keeps the live bytes
// per category, the peak and what made it up, one summary per step and, optionally, the events.
class Tracker {
 public:
  // keep_events = false keeps only counters and maxima (constant memory for long runs): events()
  // is then empty; every count and peak is the same as with events.
  static std::shared_ptr<Tracker> create(bool keep_events = true);

  // Live bytes of allocations made while tracking and not yet freed. Per category, allocations
  // of a still-open scope count under the scope's category (rule 3) until they are freed.
  int64_t live_bytes() const;
  int64_t live_bytes(c10::Device device) const;  // the same on one device
  CategoryBytes live_by_category() const;        // the same per category (every device)
  // Highest live total since creation or the last reset_peak(); updated on every allocation.
  int64_t peak_bytes() const;
  // Starts a new peak from what is live now (peak_report() then covers from here on).
  void reset_peak();

  // The highest live total since creation or the last reset_peak(), and what made it up (every
  // device together). The same number a replay of trace() gives.
  PeakReport peak_report() const;

  // The steady-state peak: the highest of the step summaries from `first_step` on (step 0, the
  // first, makes the optimizer's state and the allocator's caches, so the default leaves it
  // out); the whole run's peak when no step that late was marked.
  MemoryReport report(int64_t first_step = 1) const;

  // Adopts a model made before (or while) tracking: the memory of its parameters and buffers is
  // parameter from now on (counted from now when it was allocated before tracking began, retagged
  // when it was tracked), and its parameters' gradients are gradient from their allocation on,
  // whoever makes them (loss.backward() and torch::optim included). Also turns on the scope-free
  // rules below. The tracker keeps the parameters alive while it lives (their AccumulateGrad
  // nodes, which hold them, carry its hooks); other adopted memory (existing gradients, buffers)
  // counts as freed at the first phase mark or step after its storage goes, since c10 reports no
  // free of memory allocated before reporting began.
  void watch(const torch::nn::Module& module);
  // The same for tensors of one's own (parameters: their gradients are watched too).
  void watch(const std::vector<at::Tensor>& parameters, const std::vector<at::Tensor>& buffers = {});

  // Without scopes. When the program opens no phase of its own, frugal's optimizer marks the
  // backward and optimizer phases (ImplicitPhase) and a step after each update
  // (mark_step_if_implicit), unless the program marks steps itself. Then what was made outside
  // any scope (the forward the program ran) and freed during a backward phase is activation (what
  // forward kept for backward), and what was made and freed outside any scope before the step's
  // backward began is temporary. What outlives backward (the loss, the inputs) stays other.
  bool implicit_rules() const;

  // A live-bytes limit: the first allocation that takes the total above it (or an allocation the
  // allocator reports as failed) records what each category held at that moment. Nothing is
  // stopped here; the caller checks limit_report() at a safe point.
  void set_limit(int64_t bytes);
  // What set_limit recorded: whether the limit was passed, and what was live at that moment.
  struct LimitReport {
    bool exceeded = false;
    bool allocation_failed = false;  // the allocator ran out, rather than the limit
    int64_t live_bytes = 0, requested_bytes = 0, step = -1;
    Phase phase = Phase::idle;
    CategoryBytes by_category{};
  };
  LimitReport limit_report() const;  // the record of the first allocation over the limit
  // The allocator failed an allocation of requested_bytes: recorded as the limit report (called by c10).
  void on_out_of_memory(int64_t requested_bytes, Phase phase);

  // Bounded capture for long runs: keep full events only while the current step (mark_step) is
  // one of these (all steps when empty); every step still gets a summary.
  void set_capture_steps(std::vector<int64_t> steps);
  // One step's peak and what made it up.
  // One step's peak and what made it up (from what was live at its start).
  struct StepSummary : PeakMoment {
    int64_t step = -1;
  };
  std::vector<StepSummary> step_summaries() const;  // steps closed so far, and the current one

  // The timeline kept so far (empty without keep_events; the captured steps with set_capture_steps).
  std::vector<MemoryEvent> events() const;
  std::vector<c10::Device> devices() const;  // every device an allocation was seen on
  // Frees of memory allocated before tracking began (ignored in every count).
  int64_t untracked_frees() const { return untracked_frees_.load(); }
  // The last step marked (-1: none yet).
  int64_t current_step() const { return step_.load(); }

  // With bounded capture, memory still live when a captured step begins is given an alloc event
  // at that moment, so a replay of the captured steps sees all of it.
  Trace trace() const;
  // write_trace(out, trace()) (trace.h owns the format).
  void write_timeline_json(std::ostream& out) const;

  // --- called by the reporters and scopes; not for users ---
  void on_report(void* ptr, int64_t size, c10::Device device, int64_t scope_id, Category category, Phase phase);
  // A new scope's id; reclassify_transients: what is freed while it is open becomes temporary.
  int64_t open_scope(bool reclassify_transients);
  // Gives the live allocation at ptr a category from its start (its alloc event is rewritten) and
  // exempts it from becoming temporary. Returns false when ptr is not a live tracked allocation.
  bool retag(const void* ptr, Category category);
  void close_scope(int64_t id);           // the scope of that id closed
  void mark(Action action, Phase phase);  // a phase began or ended (a timeline marker)
  // Step `step` begins now (memory::mark_step); from then on the optimizer marks no steps of its own.
  void mark_step(int64_t step);
  // An implicit phase opened (see "Without scopes"); mark_step_if_implicit's step.
  void begin_implicit_phase(Phase phase);
  void mark_implicit_step(int64_t step);  // step `step` begins, unless the program marks its own

  // Names what runs from now on (an experiment of frugal account, say); the trace keeps the name
  // and its time, and the report writes it on the chart.
  void label(const std::string& text);
  // A name given to what runs from time_us on.
  struct Label {
    int64_t time_us = 0;
    std::string text;
  };
  std::vector<Label> labels() const;  // every label, in time order

 private:
  explicit Tracker(bool keep_events);

 public:
  ~Tracker();
  Tracker(const Tracker&) = delete;
  Tracker& operator=(const Tracker&) = delete;

 private:
  int64_t now_us() const;
  bool keep_events_ = true;

  struct Allocation {
    int64_t bytes;
    size_t event_index;  // of its alloc event, or none
    int64_t scope_id;    // 0: exempt from rule 2 (tagged)
    int64_t seq;         // allocations made so far, this one included
    Category category;
    c10::Device device;
    bool undeclared = false;     // made outside any CategoryScope or PhaseScope
    int64_t backward_epoch = 0;  // backward phases begun before it was made
  };
  // The one place a live allocation's category changes (rule 1 or 2 of category.h): the counters,
  // its alloc event, and every recorded moment it was live at (peak, step summaries, limit report).
  void settle(Allocation& a, Category category);
  // Counts an allocation: the counters, its alloc event, the peak and the step's summary.
  void add_live(void* ptr, Allocation a, Phase phase, int64_t time_us);
  void adopt(const at::Tensor& tensor, Category category);
  void drop_live(std::unordered_map<void*, Allocation>::iterator it, Phase phase, int64_t time_us);
  // Counts as freed the adopted memory whose storage is gone (at phase marks, steps and watch()).
  void sweep_adopted();
  struct Adopted {
    void* ptr;
    int64_t seq;  // of its Allocation, so a reuse of the address is not taken for it
    c10::weak_intrusive_ptr<c10::StorageImpl> storage;
  };
  std::vector<Adopted> adopted_;
  void step_boundary(int64_t step);
  // Gives live allocations not yet in the timeline an alloc event now (capture begins).
  void record_live_allocations(int64_t time_us);
  struct DeviceCounter {
    c10::Device device;
    int64_t live;
  };

  mutable std::mutex mutex_;
  std::chrono::steady_clock::time_point t0_;
  int64_t start_unix_us_ = 0;  // the wall clock at t0_
  std::vector<MemoryEvent> events_;
  std::vector<Label> labels_;
  std::unordered_map<void*, Allocation> live_;
  std::unordered_set<int64_t> open_scopes_;  // scopes whose transients become temporary
  std::vector<DeviceCounter> device_live_;
  CategoryBytes category_live_{};
  int64_t total_live_ = 0;
  int64_t seq_ = 0;  // allocations made so far
  PeakReport peak_;
  int64_t peak_seq_ = 0;  // seq_ when peak_ was taken
  int64_t limit_ = 0;
  LimitReport limit_report_;
  int64_t limit_seq_ = 0;
  std::vector<int64_t> capture_steps_;  // sorted; empty: every step
  std::vector<StepSummary> summaries_;  // closed steps
  std::vector<int64_t> summary_seqs_;   // seq_ when each closed summary's peak was taken
  StepSummary current_summary_;
  int64_t current_summary_seq_ = 0;
  bool capturing() const;
  bool was_capturing_ = true;
  int64_t next_scope_ = 1;
  bool implicit_rules_ = false;  // an implicit phase opened, or watch() was called
  bool explicit_steps_ = false;  // the program called mark_step
  int64_t backward_epoch_ = 0;   // backward phases begun
  std::weak_ptr<Tracker> self_;
  struct WatchHook;
  std::vector<std::shared_ptr<WatchHook>> watch_hooks_;
  std::atomic<int64_t> untracked_frees_{0};
  std::atomic<int64_t> step_{-1};
};

// Installs the tracker on this thread (and on threads that inherit its state) until destroyed.
class TrackingGuard {
 public:
  // Installs tracker on this thread (and the threads autograd starts from it).
  explicit TrackingGuard(std::shared_ptr<Tracker> tracker);
  ~TrackingGuard();
  TrackingGuard(const TrackingGuard&) = delete;
  TrackingGuard& operator=(const TrackingGuard&) = delete;

 private:
  struct Impl;
  std::unique_ptr<Impl> impl_;
};

// Declares the category of what is allocated until destroyed. No-op when nothing is tracking.
class CategoryScope {
 public:
  // Allocations made from now until destruction are `category` (when a tracker is installed).
  explicit CategoryScope(Category category);
  ~CategoryScope();
  CategoryScope(const CategoryScope&) = delete;
  CategoryScope& operator=(const CategoryScope&) = delete;

 private:
  struct Impl;
  std::unique_ptr<Impl> impl_;
};

// Marks a phase of the step in the timeline and opens a scope of the phase's default category
// (or the one given). No-op when nothing is tracking.
class PhaseScope {
 public:
  // Marks `phase` begun; allocations in it take the phase's default category (category.h).
  explicit PhaseScope(Phase phase);
  // The same with `category` for what is allocated in it.
  PhaseScope(Phase phase, Category category);
  ~PhaseScope();
  PhaseScope(const PhaseScope&) = delete;
  PhaseScope& operator=(const PhaseScope&) = delete;

 private:
  struct Impl;
  std::unique_ptr<Impl> impl_;
};

// Declares what an existing tensor's memory is for, from its allocation on (e.g. a parameter's
// gradient made by some backward node). No-op without a tracker or for untracked memory.
void tag(const at::Tensor& tensor, Category category);

// Library code that marks a phase on the program's behalf: a PhaseScope of `phase` when a tracker
// is installed and no phase is open (the program opened none), otherwise nothing.
class ImplicitPhase {
 public:
  // Opens a PhaseScope of `phase` only when a tracker is installed and no phase is open.
  explicit ImplicitPhase(Phase phase);
  ~ImplicitPhase();
  ImplicitPhase(const ImplicitPhase&) = delete;
  ImplicitPhase& operator=(const ImplicitPhase&) = delete;

 private:
  std::unique_ptr<PhaseScope> scope_;
};

// The tracker installed on this thread, or nullptr.
std::shared_ptr<Tracker> current_tracker();
// Marks the start of training step `step` on the current tracker (no-op without one).
void mark_step(int64_t step);
// Marks step `step` for a program that marks none itself (frugal's optimizer, after an update).
void mark_step_if_implicit(int64_t step);

}  // namespace memory
}  // namespace frugal
