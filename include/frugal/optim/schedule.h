// frugal/optim/schedule.h — learning-rate schedules that drive both optimizer modes the same way.
//
// The factor multiplies each group's base lr. step() is called once per training step, after the
// update; lr() is the rate the next step will use. Warm-up (where the kind has one) is linear from
// 0: factor(t) = t / warmup_steps for t < warmup_steps (the Hugging Face convention).
//   constant       1
//   linear_warmup  warm-up, then 1
//   cosine         warm-up, then min_lr_ratio + (1 - min_lr_ratio) * (1 + cos(pi * progress)) / 2
//   linear_decay   warm-up, then from 1 down to min_lr_ratio at total_steps
//   step           gamma ^ floor(t / step_size)
//
//   frugal::optim::LRScheduler sched(opt, frugal::optim::ScheduleOptions()
//       .kind(frugal::optim::ScheduleKind::cosine).warmup_steps(100).total_steps(1000));
//   ...; opt.step(); sched.step();
#pragma once

#include <torch/arg.h>

#include <array>
#include <cstdint>
#include <optional>
#include <string>

#include "frugal/optim/optimizer.h"

namespace frugal {
namespace optim {

enum class ScheduleKind { constant, linear_warmup, cosine, linear_decay, step };
constexpr std::array<ScheduleKind, 5> kAllScheduleKinds = {ScheduleKind::constant, ScheduleKind::linear_warmup, ScheduleKind::cosine,
                                                           ScheduleKind::linear_decay, ScheduleKind::step};

// "constant", "linear_warmup", "cosine", "linear_decay", "step"; parse_schedule is the inverse
// (nullopt for any other text).
const char* schedule_name(ScheduleKind k);
std::optional<ScheduleKind> parse_schedule(const std::string& name);

// Which schedule, and its parameters (see the table above); schedule_factor checks them.
struct ScheduleOptions {
  TORCH_ARG(ScheduleKind, kind) = ScheduleKind::constant;
  TORCH_ARG(int64_t, warmup_steps) = 0;
  TORCH_ARG(int64_t, total_steps) = 0;    // cosine and linear_decay
  TORCH_ARG(double, min_lr_ratio) = 0.0;  // cosine and linear_decay floor
  TORCH_ARG(int64_t, step_size) = 1;      // step
  TORCH_ARG(double, gamma) = 0.1;         // step
};

// The factor at training step t (0-based). Throws std::invalid_argument for inconsistent options.
double schedule_factor(const ScheduleOptions& options, int64_t t);

// Sets an optimizer's group learning rates to base lr * factor(t) as the steps go by.
class LRScheduler {
 public:
  // Sets every group's lr to base_lr * factor(0).
  LRScheduler(Optimizer& optimizer, const ScheduleOptions& options);
  void step();  // one training step done
  // The number of step() calls so far (or the value set_last_step gave): the t of factor().
  int64_t last_step() const { return t_; }
  void set_last_step(int64_t t);      // resume: the number of step() calls made before
  double lr(size_t group = 0) const;  // the rate group `group` uses next; std::out_of_range for a bad group
  double factor() const;              // schedule_factor at last_step()

 private:
  void apply();
  Optimizer& optimizer_;
  ScheduleOptions options_;
  int64_t t_ = 0;
};

}  // namespace optim
}  // namespace frugal
