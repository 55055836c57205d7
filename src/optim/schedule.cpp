#include "frugal/optim/schedule.h"

#include <algorithm>
#include <cmath>
#include <stdexcept>

namespace frugal {
namespace optim {

const char* schedule_name(ScheduleKind k) {
  switch (k) {
    case ScheduleKind::constant: return "constant";
    case ScheduleKind::linear_warmup: return "linear_warmup";
    case ScheduleKind::cosine: return "cosine";
    case ScheduleKind::linear_decay: return "linear_decay";
    case ScheduleKind::step: return "step";
  }
  return "constant";
}

std::optional<ScheduleKind> parse_schedule(const std::string& name) {
  for (ScheduleKind k : kAllScheduleKinds) {
    if (name == schedule_name(k)) return k;
  }
  return std::nullopt;
}

double schedule_factor(const ScheduleOptions& o, int64_t t) {
  if (o.warmup_steps() < 0) throw std::invalid_argument("schedule: warmup_steps must be >= 0");
  if (t < 0) throw std::invalid_argument("schedule: step must be >= 0");
  const bool decays = o.kind() == ScheduleKind::cosine || o.kind() == ScheduleKind::linear_decay;
  if (decays && o.total_steps() <= o.warmup_steps()) {
    throw std::invalid_argument(std::string("schedule: ") + schedule_name(o.kind()) + " needs total_steps > warmup_steps, got " +
                                std::to_string(o.total_steps()) + " and " + std::to_string(o.warmup_steps()));
  }
  if (decays && !(o.min_lr_ratio() >= 0 && o.min_lr_ratio() <= 1)) {
    throw std::invalid_argument("schedule: min_lr_ratio must be in [0, 1]");
  }
  const bool warms = o.kind() != ScheduleKind::constant && o.kind() != ScheduleKind::step;
  if (warms && t < o.warmup_steps()) return static_cast<double>(t) / static_cast<double>(o.warmup_steps());
  switch (o.kind()) {
    case ScheduleKind::constant:
    case ScheduleKind::linear_warmup: return 1.0;
    case ScheduleKind::cosine: {
      const double progress =
          std::min(1.0, static_cast<double>(t - o.warmup_steps()) / static_cast<double>(o.total_steps() - o.warmup_steps()));
      return o.min_lr_ratio() + (1 - o.min_lr_ratio()) * 0.5 * (1 + std::cos(M_PI * progress));
    }
    case ScheduleKind::linear_decay: {
      const double remaining =
          std::max(0.0, static_cast<double>(o.total_steps() - t) / static_cast<double>(o.total_steps() - o.warmup_steps()));
      return o.min_lr_ratio() + (1 - o.min_lr_ratio()) * remaining;
    }
    case ScheduleKind::step:
      if (o.step_size() < 1) throw std::invalid_argument("schedule: step_size must be >= 1");
      return std::pow(o.gamma(), static_cast<double>(t / o.step_size()));
  }
  return 1.0;
}

LRScheduler::LRScheduler(Optimizer& optimizer, const ScheduleOptions& options) : optimizer_(optimizer), options_(options) {
  schedule_factor(options_, 0);  // validates
  apply();
}

void LRScheduler::step() {
  ++t_;
  apply();
}

void LRScheduler::set_last_step(int64_t t) {
  if (t < 0) throw std::invalid_argument("schedule: last step must be >= 0");
  t_ = t;
  apply();
}

double LRScheduler::factor() const { return schedule_factor(options_, t_); }
double LRScheduler::lr(size_t group) const { return optimizer_.lr(group); }

void LRScheduler::apply() {
  const double f = factor();
  for (size_t g = 0; g < optimizer_.num_groups(); ++g) optimizer_.set_lr(g, optimizer_.base_lr(g) * f);
}

}  // namespace optim
}  // namespace frugal
