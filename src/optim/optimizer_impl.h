// The optimizer's runtime state (Optimizer::Impl), shared by the files that implement Optimizer:
// optimizer.cpp (construction, both modes' step, data-parallel exchange) and optimizer_state.cpp
// (the state dict: saving, checking and restoring it, re-sharded across world sizes). Private to
// src/optim.
#pragma once

#include <ATen/ThreadLocalState.h>
#include <torch/csrc/autograd/function.h>
#include <torch/csrc/autograd/variable.h>

#include <chrono>
#include <cmath>
#include <condition_variable>
#include <deque>
#include <exception>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <thread>
#include <vector>

#include "frugal/memory/tracker.h"
#include "frugal/optim/optimizer.h"

namespace frugal {
namespace optim {

namespace detail {

enum class Pass { step, measure_norm };

// The clip coefficient min(1, max_norm / (norm + 1e-6)) as a tensor (no device sync).
inline at::Tensor clip_coefficient(const at::Tensor& norm, double max_norm) { return (max_norm / (norm + 1e-6)).clamp_max(1.0); }

// loss.backward() under two-pass clipping: the first gradient arrives before any norm was measured.
// A plain std::logic_error (autograd hands it to the caller as it is), so the sentence comes
// without a backtrace; no parameter has changed yet.
[[noreturn]] inline void throw_two_pass_needs_backward() {
  throw std::logic_error(
      "optimizer: two-pass global-norm clipping measures the gradient norm in a first backward pass, so call "
      "optimizer.backward(loss) instead of loss.backward()");
}

}  // namespace detail

using detail::clip_coefficient;
using detail::Pass;
using detail::throw_two_pass_needs_backward;

struct Optimizer::Impl {
  OptimizerOptions options;
  struct Param {
    std::string name;
    at::Tensor tensor;
    size_t group = 0;
    ParamState state;
    // The flattened elements [begin, end) this rank updates: all of them in one process; with an
    // Exchange the owned range (nothing, all, or a slice).
    int64_t begin = 0, end = 0;
  };
  std::vector<Param> params;

  static bool whole(const Param& p) { return p.begin == 0 && p.end == p.tensor.numel(); }
  // Whether params is split over the ranks (each holds a slice): its norm is a sum over them.
  static bool split(const Param& p) { return p.begin < p.end && !whole(p); }
  // The part of a parameter-shaped tensor (the parameter, its gradient) this rank updates.
  static at::Tensor own(const Param& p, const at::Tensor& t) { return whole(p) ? t : t.view({-1}).narrow(0, p.begin, p.end - p.begin); }
  std::vector<double> group_lr, group_base_lr, group_weight_decay;
  int64_t micro_steps = 0;
  int64_t steps_taken = 0;
  double last_grad_norm = NAN;
  // in-backward
  struct Hook {
    // kept alive so the hook stays on it: a shared_ptr in LibTorch 1.13, an intrusive_ptr in 2.x
    decltype(torch::autograd::impl::grad_accumulator(std::declval<const at::Tensor&>())) accumulator;
    uintptr_t key;
  };
  std::vector<Hook> hooks;
  std::vector<std::shared_ptr<const void>> code_tables;  // quantized state's shared tables, built up front
  Pass pass = Pass::step;
  bool norm_ready = false;
  at::Tensor norm_sq;      // sum of squared gradient norms in the measuring pass (double)
  at::Tensor global_coef;  // the clip coefficient for the stepping pass
  // data parallel (exchange.h)
  std::shared_ptr<Exchange> exchange;
  struct Pending {
    size_t index;
    at::Tensor grad;  // being averaged; the parameter's .grad is already reset
    Exchange::Wait wait;
  };
  std::deque<Pending> pending;  // in-backward: gradients being averaged, oldest first
  int64_t pending_bytes = 0;
  std::vector<Exchange::Wait> shares;  // owners' updated parameters on their way to the other ranks

  bool owns(size_t i) const { return !exchange || exchange->owns(i); }
  bool owns(const Param& p) const { return owns(static_cast<size_t>(&p - params.data())); }

  // The averaged gradient of params[i] has arrived (in-backward): the owner clips and updates, then
  // sends the new values; the gradient is dropped either way.
  void use_averaged(size_t i, const at::Tensor& grad) {
    Param& p = params[i];
    if (owns(i)) {
      clip_and_update(p, grad);
    }
    shares.push_back(exchange->share_parameter(i, p.tensor));
  }
  void clip_and_update(Param& p, const at::Tensor& grad) { clip_and_update(p, grad, hyper(p.group)); }
  void clip_and_update(Param& p, const at::Tensor& grad, const Hyper& h) {
    const at::Tensor g = own(p, grad);
    if (options.clip() == Clip::global_norm_two_pass) {
      g.mul_(global_coef.to(g.scalar_type()));
    } else if (options.clip() == Clip::per_param_norm) {
      clip_per_param(p, g);
    }
    update(p, grad, h);
  }
  // g: this rank's part of p's gradient; a split parameter's norm is summed over the ranks' slices.
  void clip_per_param(const Param& p, const at::Tensor& g) {
    at::Tensor norm = g.norm();
    if (split(p)) {
      const double n = norm.item<double>();
      norm = at::scalar_tensor(std::sqrt(exchange->sum(n * n)), g.options());
    }
    g.mul_(clip_coefficient(norm, options.max_grad_norm()));
  }
  // Waits for the oldest averages until no more than `limit` bytes are in flight.
  void drain(int64_t limit) {
    at::NoGradGuard no_grad;
    while (!pending.empty() && pending_bytes > limit) {
      Pending next = std::move(pending.front());
      pending.pop_front();
      pending_bytes -= next.grad.numel() * static_cast<int64_t>(next.grad.element_size());
      next.wait();
      use_averaged(next.index, next.grad);
      next = Pending{};
      exchange->release(/*wait=*/false);
    }
  }
  // Every average used and every owner's values received: the parameters are the same everywhere.
  void settle() {
    drain(-1);
    {
      std::vector<Exchange::Wait> waits;
      waits.swap(shares);
      for (auto& w : waits) w();
    }
    exchange->release(/*wait=*/true);
  }

  // The options' update settings with the group's learning rate and weight decay.
  Hyper hyper(size_t group) const {
    Hyper h = options.hyper();
    h.lr = group_lr[group];
    h.weight_decay = group_weight_decay[group];
    return h;
  }

  void update(Param& p, const at::Tensor& grad) { update(p, grad, hyper(p.group)); }
  void update(Param& p, const at::Tensor& grad, const Hyper& h) {
    memory::CategoryScope scope(memory::Category::optimizer_state);
    const auto t0 = std::chrono::steady_clock::now();
    auto moved = [&p] { return (p.state.m ? p.state.m->transfer_seconds() : 0.0) + (p.state.v ? p.state.v->transfer_seconds() : 0.0); };
    const double moved_before = moved();
    at::Tensor target = own(p, p.tensor);
    apply_update(h, p.state, target, own(p, grad));
    if (p.state.m && p.state.m->windowed()) read_ahead_after(static_cast<size_t>(&p - params.data()));
    update_seconds += std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
    state_transfer_seconds += moved() - moved_before;
  }
  double update_seconds = 0;
  double state_transfer_seconds = 0;

  // File placement: params[i] was just updated. The state of the parameters that followed it last
  // time (in in-backward mode, the order gradients complete; the last of a step is followed by the
  // first of the next) is read ahead, whole, in that order, until kReadAheadWindows windows' worth
  // is on its way or in the page cache (not the process's memory: the window bounds what is mapped
  // in), so the disk works through forward and backward rather than only between two updates.
  static constexpr int64_t kReadAheadWindows = 8;
  std::vector<int64_t> updated_after;  // -1: not seen yet
  std::vector<char> read_ahead;        // its state asked for and not yet updated
  std::vector<char> cached;            // read ahead into the page cache besides (cache_read_ahead)
  int64_t last_updated = -1, ahead_end = -1, ahead_bytes = 0;
  static int64_t state_file_bytes(const ParamState& s) { return s.m && s.v ? s.m->file_bytes() + s.v->file_bytes() : 0; }
  void read_ahead_after(size_t i) {
    if (updated_after.size() != params.size()) {
      updated_after.assign(params.size(), -1), read_ahead.assign(params.size(), 0), cached.assign(params.size(), 0);
    }
    if (last_updated >= 0) updated_after[static_cast<size_t>(last_updated)] = static_cast<int64_t>(i);
    last_updated = static_cast<int64_t>(i);
    cached[i] = 0;
    if (read_ahead[i]) {
      read_ahead[i] = 0;
      ahead_bytes -= state_file_bytes(params[i].state);
    } else {  // not read ahead (the first step, or the order changed): the frontier starts here
      if (ahead_bytes > 0) std::fill(read_ahead.begin(), read_ahead.end(), 0);  // (none is flagged in the first step)
      ahead_end = static_cast<int64_t>(i), ahead_bytes = 0;
    }
    const int64_t limit = kReadAheadWindows * options.state().window_bytes();
    for (int64_t next = updated_after[static_cast<size_t>(ahead_end)]; next >= 0 && ahead_bytes < limit;
         next = updated_after[static_cast<size_t>(next)]) {
      const auto n = static_cast<size_t>(next);
      const ParamState& s = params[n].state;
      if (read_ahead[n] || next == static_cast<int64_t>(i) || !(s.m && s.v && s.m->windowed())) break;
      s.m->prefetch(0, s.m->numel());
      s.v->prefetch(0, s.v->numel());
      read_ahead[n] = 1;
      ahead_bytes += state_file_bytes(s);
      ahead_end = next;
    }
  }

  // File placement, the step is over: the state read ahead for the next one (the frontier above)
  // goes into the page cache now, while forward leaves the disk idle. Within a step the window's
  // reader reads the rest straight from the disk into its buffers: a page-cache copy of 12.5 GiB a
  // step (the 7B recipe's 8-bit state) is CPU time taken from backward.
  void cache_read_ahead() {
    if (read_ahead.empty() || last_updated < 0) return;
    for (int64_t n = updated_after[static_cast<size_t>(last_updated)]; n >= 0; n = updated_after[static_cast<size_t>(n)]) {
      const auto k = static_cast<size_t>(n);
      if (!read_ahead[k] || cached[k]) break;
      cached[k] = 1;
      params[k].state.m->cache(0, params[k].state.m->numel());
      params[k].state.v->cache(0, params[k].state.v->numel());
    }
  }

  // In-backward updates on a thread of their own (OptimizerOptions::update_threads): the hook hands
  // each completed gradient over and backward goes on; the thread updates in the order handed.
  struct Worker {
    struct Job {
      size_t index = 0;
      at::Tensor grad;
      // As the hook would have used them: the group's lr and weight decay, and the stochastic
      // rounding's seed drawn from the default generator in the hook (not on this thread, where
      // the draw could fall inside a checkpointed block's recompute, which replays the generator).
      std::optional<Hyper> hyper;
      std::optional<at::ThreadLocalState> state;  // the posting thread's: tracker scope, phase, grad mode
    };
    std::mutex mutex;
    std::condition_variable changed;  // a job was posted or finished, or the thread is to stop
    std::deque<Job> jobs;             // waiting, oldest first
    int64_t bytes = 0;                // gradients held: the waiting ones' and the one being updated
    size_t held = 0;                  // how many
    std::exception_ptr error;         // the first failed update's (the jobs after it are dropped)
    bool stop = false;
    double wait_seconds = 0;  // the posting thread's waits
    std::thread thread;
  };
  std::unique_ptr<Worker> worker;

  ~Impl() { stop_worker(); }
  void stop_worker() {
    if (!worker) return;
    {
      std::lock_guard<std::mutex> lock(worker->mutex);
      worker->stop = true;
    }
    worker->changed.notify_all();
    if (worker->thread.joinable()) worker->thread.join();
    worker.reset();
  }
  // Hands params[i]'s gradient to the update thread, then waits while more than bytes_in_flight
  // are held (the new one alone always goes). Rethrows an earlier update's exception.
  void post_update(size_t i, at::Tensor grad) {
    if (!worker) {
      worker = std::make_unique<Worker>();
      worker->thread = std::thread([this] { run_updates(); });
    }
    Worker& w = *worker;
    const int64_t bytes = grad.numel() * static_cast<int64_t>(grad.element_size());
    std::unique_lock<std::mutex> lock(w.mutex);
    take_error(lock);
    Hyper h = hyper(params[i].group);
    h.rounding_seed = rounding_seed(h, params[i].tensor);
    w.jobs.push_back({i, std::move(grad), h, at::ThreadLocalState()});
    w.bytes += bytes;
    ++w.held;
    w.changed.notify_all();
    const auto t0 = std::chrono::steady_clock::now();
    w.changed.wait(lock, [&] { return w.held <= 1 || w.bytes <= options.bytes_in_flight() || w.error; });
    w.wait_seconds += std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
    take_error(lock);
  }
  // Waits until every posted update is done; rethrows the first failed one's exception.
  void finish_updates() {
    if (!worker) return cache_read_ahead();
    Worker& w = *worker;
    std::unique_lock<std::mutex> lock(w.mutex);
    const auto t0 = std::chrono::steady_clock::now();
    w.changed.wait(lock, [&] { return w.held == 0; });
    w.wait_seconds += std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
    take_error(lock);
    cache_read_ahead();
  }
  // The same after a failure of the caller's own: the first error is already on its way.
  void finish_updates_quietly() {
    try {
      finish_updates();
    } catch (...) {
    }
  }
  void take_error(std::unique_lock<std::mutex>& /*held*/) {
    if (!worker->error) return;
    std::exception_ptr e = worker->error;
    worker->error = nullptr;
    std::rethrow_exception(e);
  }
  void run_updates();  // the update thread (optimizer.cpp)

  // The gradient of params[i] is complete (autograd accumulated it): it is a gradient from its
  // allocation on, for the tracker; in in-backward mode it is used and freed now.
  void on_gradient(size_t i) {
    Param& p = params[i];
    at::Tensor grad = p.tensor.grad();
    if (!grad.defined()) return;
    memory::tag(grad, memory::Category::gradient);
    if (options.mode() != Mode::in_backward) return;
    at::NoGradGuard no_grad;
    if (exchange) {
      p.tensor.mutable_grad().reset();  // the average below holds it until it is used
      if (pass == Pass::measure_norm) {
        exchange->average_gradient(i, grad)();
        if (owns(i)) {
          const at::Tensor n = own(p, grad).norm().to(at::kDouble);
          norm_sq = norm_sq.defined() ? norm_sq + n * n : n * n;
        }
        grad = at::Tensor();
        exchange->release(/*wait=*/false);  // as drain does: the operation's hold on the gradient goes now
        return;
      }
      if (options.clip() == Clip::global_norm_two_pass && !norm_ready) throw_two_pass_needs_backward();
      pending.push_back({i, grad, exchange->average_gradient(i, grad)});
      pending_bytes += grad.numel() * static_cast<int64_t>(grad.element_size());
      drain(options.bytes_in_flight());  // backward goes on while the newest are on their way
      return;
    }
    if (pass == Pass::measure_norm) {
      const at::Tensor n = grad.norm().to(at::kDouble);
      norm_sq = norm_sq.defined() ? norm_sq + n * n : n * n;
    } else {
      if (options.clip() == Clip::global_norm_two_pass && !norm_ready) throw_two_pass_needs_backward();
      if (options.update_threads() > 0) {
        p.tensor.mutable_grad().reset();  // the update thread holds it until it is used
        post_update(i, std::move(grad));
        return;
      }
      clip_and_update(p, grad);
    }
    p.tensor.mutable_grad().reset();  // the whole point: the gradient is gone as soon as it is used
  }
};

}  // namespace optim
}  // namespace frugal
