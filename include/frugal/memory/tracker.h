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

namespace frugal {
namespace memory {

enum class Action : uint8_t { alloc, free, phase_begin, phase_end, step };
const char* action_name(Action a);

struct MemoryEvent {
  int64_t time_us = 0;  // since the tracker was created
  Action action = Action::alloc;
  int64_t bytes = 0;    // size of the allocation (alloc/free), 0 for markers
  Category category = Category::other;
  Phase phase = Phase::idle;
  c10::Device device = c10::Device(c10::kCPU);
  uint64_t addr = 0;
  int64_t step = -1;    // the step this event belongs to (-1 before the first mark_step)
};

using CategoryBytes = std::array<int64_t, kNumCategories>;
struct Trace;  // trace.h

struct PeakReport {
  int64_t peak_bytes = 0;     // highest live total
  int64_t peak_time_us = 0;   // when it was reached
  int64_t peak_step = -1;
  Phase peak_phase = Phase::idle;
  CategoryBytes breakdown{};  // live bytes per category at that moment
  // What the peak covers: the steps from covers_first_step to covers_last_step (-1: before the
  // first step, i.e. set-up).
  int64_t covers_first_step = -1, covers_last_step = -1;
};

class Tracker {
 public:
  // keep_events = false keeps only counters and maxima (constant memory for long runs): events()
  // is then empty; every count and peak is the same as with events.
  static std::shared_ptr<Tracker> create(bool keep_events = true);

  // Live bytes of allocations made while tracking and not yet freed. Per category, allocations
  // of a still-open scope count under the scope's category (rule 3) until they are freed.
  int64_t live_bytes() const;
  int64_t live_bytes(c10::Device device) const;
  CategoryBytes live_by_category() const;
  // Highest live total since creation or the last reset_peak(); updated on every allocation.
  int64_t peak_bytes() const;
  void reset_peak();

  // The highest live total since creation or the last reset_peak(), and what made it up (every
  // device together). The same number a replay of trace() gives.
  PeakReport peak_report() const;

  // A live-bytes limit: the first allocation that takes the total above it (or an allocation the
  // allocator reports as failed) records what each category held at that moment. Nothing is
  // stopped here; the caller checks limit_report() at a safe point.
  void set_limit(int64_t bytes);
  struct LimitReport {
    bool exceeded = false;
    bool allocation_failed = false;  // the allocator ran out, rather than the limit
    int64_t live_bytes = 0, requested_bytes = 0, step = -1;
    Phase phase = Phase::idle;
    CategoryBytes by_category{};
  };
  LimitReport limit_report() const;
  void on_out_of_memory(int64_t requested_bytes, Phase phase);

  // Bounded capture for long runs: keep full events only while the current step (mark_step) is
  // one of these (all steps when empty); every step still gets a summary.
  void set_capture_steps(std::vector<int64_t> steps);
  struct StepSummary {
    int64_t step = -1;
    int64_t peak_bytes = 0;            // highest live total during the step (from what was live at its start)
    int64_t time_us = 0;               // when it was first reached
    Phase phase = Phase::idle;         // in which phase
    CategoryBytes breakdown{};         // at that moment
  };
  std::vector<StepSummary> step_summaries() const;  // steps closed so far, and the current one

  std::vector<MemoryEvent> events() const;
  std::vector<c10::Device> devices() const;
  // Frees of memory allocated before tracking began (ignored in every count).
  int64_t untracked_frees() const { return untracked_frees_.load(); }
  int64_t current_step() const { return step_.load(); }

  // With bounded capture, memory still live when a captured step begins is given an alloc event
  // at that moment, so a replay of the captured steps sees all of it.
  Trace trace() const;
  // write_trace(out, trace()) (trace.h owns the format).
  void write_timeline_json(std::ostream& out) const;

  // --- called by the reporters and scopes; not for users ---
  void on_report(void* ptr, int64_t size, c10::Device device, int64_t scope_id, Category category,
                 Phase phase);
  int64_t open_scope(bool reclassify_transients);
  // Gives the live allocation at ptr a category from its start (its alloc event is rewritten) and
  // exempts it from becoming temporary. Returns false when ptr is not a live tracked allocation.
  bool retag(const void* ptr, Category category);
  void close_scope(int64_t id);
  void mark(Action action, Phase phase);
  void mark_step(int64_t step);

  // Names what runs from now on (an experiment of frugal account, say); the trace keeps the name
  // and its time, and the report writes it on the chart.
  void label(const std::string& text);
  struct Label {
    int64_t time_us = 0;
    std::string text;
  };
  std::vector<Label> labels() const;

 private:
  explicit Tracker(bool keep_events);
  int64_t now_us() const;
  bool keep_events_ = true;

  struct Allocation {
    int64_t bytes;
    size_t event_index;  // of its alloc event, or none
    int64_t scope_id;    // 0: exempt from rule 2 (tagged)
    int64_t seq;         // allocations made so far, this one included
    Category category;
    c10::Device device;
  };
  // The one place a live allocation's category changes (rule 1 or 2 of category.h): the counters,
  // its alloc event, and every recorded moment it was live at (peak, step summaries, limit report).
  void settle(Allocation& a, Category category);
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
  int64_t seq_ = 0;                 // allocations made so far
  PeakReport peak_;
  int64_t peak_seq_ = 0;            // seq_ when peak_ was taken
  int64_t limit_ = 0;
  LimitReport limit_report_;
  int64_t limit_seq_ = 0;
  std::vector<int64_t> capture_steps_;   // sorted; empty: every step
  std::vector<StepSummary> summaries_;   // closed steps
  std::vector<int64_t> summary_seqs_;    // seq_ when each closed summary's peak was taken
  StepSummary current_summary_;
  int64_t current_summary_seq_ = 0;
  bool capturing() const;
  bool was_capturing_ = true;
  int64_t next_scope_ = 1;
  std::atomic<int64_t> untracked_frees_{0};
  std::atomic<int64_t> step_{-1};
};

// Installs the tracker on this thread (and on threads that inherit its state) until destroyed.
class TrackingGuard {
 public:
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
  explicit PhaseScope(Phase phase);
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

// The tracker installed on this thread, or nullptr.
std::shared_ptr<Tracker> current_tracker();
// Marks the start of training step `step` on the current tracker (no-op without one).
void mark_step(int64_t step);

}  // namespace memory
}  // namespace frugal
