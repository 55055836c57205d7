// Schedule values at known steps, and the scheduler setting every group's lr.
#include <gtest/gtest.h>

#include <cmath>

#include "frugal/optim/schedule.h"

using namespace frugal::optim;

TEST(Schedule, ValuesAtKnownSteps) {
  EXPECT_DOUBLE_EQ(schedule_factor(ScheduleOptions(), 1000), 1.0);
  const auto warm = ScheduleOptions().kind(ScheduleKind::linear_warmup).warmup_steps(4);
  EXPECT_DOUBLE_EQ(schedule_factor(warm, 0), 0.0);
  EXPECT_DOUBLE_EQ(schedule_factor(warm, 1), 0.25);
  EXPECT_DOUBLE_EQ(schedule_factor(warm, 4), 1.0);
  EXPECT_DOUBLE_EQ(schedule_factor(warm, 100), 1.0);
  const auto cosine = ScheduleOptions().kind(ScheduleKind::cosine).warmup_steps(10).total_steps(110).min_lr_ratio(0.1);
  EXPECT_DOUBLE_EQ(schedule_factor(cosine, 5), 0.5);
  EXPECT_DOUBLE_EQ(schedule_factor(cosine, 10), 1.0);
  EXPECT_NEAR(schedule_factor(cosine, 60), 0.1 + 0.9 * 0.5, 1e-12);  // halfway: cos(pi/2) = 0
  EXPECT_NEAR(schedule_factor(cosine, 110), 0.1, 1e-12);
  EXPECT_NEAR(schedule_factor(cosine, 500), 0.1, 1e-12);
  const auto linear = ScheduleOptions().kind(ScheduleKind::linear_decay).warmup_steps(0).total_steps(100);
  EXPECT_DOUBLE_EQ(schedule_factor(linear, 0), 1.0);
  EXPECT_DOUBLE_EQ(schedule_factor(linear, 25), 0.75);
  EXPECT_DOUBLE_EQ(schedule_factor(linear, 100), 0.0);
  EXPECT_DOUBLE_EQ(schedule_factor(linear, 150), 0.0);
  const auto step = ScheduleOptions().kind(ScheduleKind::step).step_size(10).gamma(0.5);
  EXPECT_DOUBLE_EQ(schedule_factor(step, 9), 1.0);
  EXPECT_DOUBLE_EQ(schedule_factor(step, 10), 0.5);
  EXPECT_DOUBLE_EQ(schedule_factor(step, 25), 0.25);
  EXPECT_THROW(schedule_factor(ScheduleOptions().kind(ScheduleKind::cosine).warmup_steps(10).total_steps(10), 0), std::invalid_argument);
  EXPECT_EQ(parse_schedule("cosine"), ScheduleKind::cosine);
  EXPECT_FALSE(parse_schedule("cosin").has_value());
}

TEST(Schedule, SchedulerSetsEveryGroupFromItsBaseLr) {
  at::Tensor a = at::zeros({2}).requires_grad_(), b = at::zeros({2}).requires_grad_();
  ParamGroup g1{{"a"}, {a}, 0.1, std::nullopt}, g2{{"b"}, {b}, 0.02, std::nullopt};
  Optimizer opt({g1, g2}, OptimizerOptions());
  LRScheduler sched(opt, ScheduleOptions().kind(ScheduleKind::linear_warmup).warmup_steps(2));
  EXPECT_DOUBLE_EQ(opt.lr(0), 0.0);
  sched.step();
  EXPECT_DOUBLE_EQ(opt.lr(0), 0.05);
  EXPECT_DOUBLE_EQ(opt.lr(1), 0.01);
  sched.step();
  EXPECT_DOUBLE_EQ(sched.lr(1), 0.02);
  sched.set_last_step(1);
  EXPECT_DOUBLE_EQ(opt.lr(0), 0.05);
}
