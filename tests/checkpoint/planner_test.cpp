// The budget planner: its plans respect their budgets, are optimal (checked by brute force over
// every segmentation of small chains), and on a real stack the measured activation peak is within
// 10% of the prediction while gradients stay those of the plain run.
#include <gtest/gtest.h>

#include <random>

#include "frugal/checkpoint/planner.h"
#include "frugal/memory/trace.h"
#include "frugal/models/transformer_block.h"

using namespace frugal;
using namespace frugal::checkpoint;

namespace {

// Every segmentation of n blocks, each segment plain or checkpointed.
std::vector<std::vector<Segment>> all_segmentations(int64_t n) {
  std::vector<std::vector<Segment>> out;
  for (uint64_t cuts = 0; cuts < (1ull << (n - 1)); ++cuts) {
    std::vector<Segment> base;
    int64_t begin = 0;
    for (int64_t b = 1; b <= n; ++b) {
      if (b == n || (cuts >> (b - 1)) & 1) {
        base.push_back({begin, b, false});
        begin = b;
      }
    }
    for (uint64_t flags = 0; flags < (1ull << base.size()); ++flags) {
      auto segs = base;
      for (size_t i = 0; i < segs.size(); ++i) segs[i].checkpointed = (flags >> i) & 1;
      out.push_back(segs);
    }
  }
  return out;
}

std::vector<BlockCost> random_costs(std::mt19937& rng, int64_t n) {
  std::uniform_int_distribution<int64_t> kept(100, 1000), out(5, 60);
  std::uniform_real_distribution<double> time(0.5, 2.0);
  std::uniform_real_distribution<double> tail(0.0, 0.3);  // of the forward: the closing product's share
  std::vector<BlockCost> costs(static_cast<size_t>(n));
  for (auto& c : costs) {
    c = {kept(rng), out(rng), time(rng)};
    c.tail_s = tail(rng) * c.forward_s;
  }
  return costs;
}

}  // namespace

TEST(Planner, OptimalOnSmallChainsByBruteForce) {
  std::mt19937 rng(7);
  for (int trial = 0; trial < 12; ++trial) {
    const int64_t n = 3 + trial % 5;  // 3..7 blocks
    const auto costs = random_costs(rng, n);
    const auto segmentations = all_segmentations(n);
    int64_t min_peak = std::numeric_limits<int64_t>::max();
    for (const auto& segs : segmentations) min_peak = std::min(min_peak, predicted_peak_bytes(costs, segs));
    EXPECT_EQ(min_achievable_bytes(costs), min_peak);
    const int64_t none_peak = no_checkpoint_plan(costs).predicted_bytes;
    for (double fraction : {0.0, 0.2, 0.35, 0.5, 0.75, 1.0}) {
      const int64_t budget = static_cast<int64_t>(fraction * static_cast<double>(none_peak));
      double best = std::numeric_limits<double>::infinity();
      for (const auto& segs : segmentations) {
        if (predicted_peak_bytes(costs, segs) <= budget) best = std::min(best, recompute_seconds(costs, segs));
      }
      const auto plan = plan_for_budget(costs, budget);
      SCOPED_TRACE("n=" + std::to_string(n) + " budget=" + std::to_string(budget));
      ASSERT_EQ(plan.has_value(), std::isfinite(best));
      if (!plan) continue;
      EXPECT_LE(plan->predicted_bytes, budget);
      EXPECT_NEAR(plan->recompute_s, best, 1e-9);
      EXPECT_EQ(plan->predicted_bytes, predicted_peak_bytes(costs, plan->segments));
      // The segments cover the chain in order.
      int64_t next = 0;
      for (const auto& s : plan->segments) {
        EXPECT_EQ(s.begin, next);
        next = s.end;
      }
      EXPECT_EQ(next, n);
    }
  }
}

TEST(Planner, CostModelAndChensRule) {
  const std::vector<BlockCost> costs(9, BlockCost{100, 10, 1.0});
  EXPECT_EQ(no_checkpoint_plan(costs).predicted_bytes, 900);
  EXPECT_EQ(no_checkpoint_plan(costs).recompute_s, 0.0);
  const auto chen = sqrt_n_plan(costs);
  ASSERT_EQ(chen.segments.size(), 3u);
  EXPECT_EQ(chen.describe(), "0-2 ckpt | 3-5 ckpt | 6-8 ckpt");
  // Kept: 3 outputs (30); peak: recomputing the first segment with the other two outputs gone...
  // the last segment is recomputed first, with 20 bytes of earlier outputs kept: 20 + 300.
  EXPECT_EQ(chen.predicted_bytes, 320);
  EXPECT_DOUBLE_EQ(chen.recompute_s, 9.0);
  EXPECT_EQ(chen.checkpointed_blocks(), 9);
  // A budget everything fits in needs no recompute.
  const auto generous = plan_for_budget(costs, 900);
  ASSERT_TRUE(generous);
  EXPECT_EQ(generous->checkpointed_blocks(), 0);
  EXPECT_FALSE(plan_for_budget(costs, min_achievable_bytes(costs) - 1));
}

TEST(Planner, MeasuredPeakOnARealStackIsWithinTenPercentOfThePrediction) {
  torch::manual_seed(0);
  std::vector<models::PreLNBlock> blocks;
  for (int i = 0; i < 8; ++i) blocks.emplace_back(64, 4);
  const auto chain = make_chain(blocks);
  std::vector<at::Tensor> params;
  for (auto& b : blocks) {
    for (auto& p : b->parameters()) params.push_back(p);
  }
  const at::Tensor x = at::randn({4, 32, 64});
  const auto costs = measure_chain(chain, x, 1);
  // Each block keeps what the formula says (within the LayerNorm statistics) and outputs (B, T, d).
  const int64_t per_layer = models::predicted_saved_bytes(1, 4, 32, 64, 4);
  for (const auto& c : costs) {
    EXPECT_NEAR(static_cast<double>(c.kept_bytes) / static_cast<double>(per_layer), 1.0, 0.05);
    EXPECT_EQ(c.output_bytes, 4 * 32 * 64 * 4);
    EXPECT_GT(c.forward_s, 0);
  }

  x.set_requires_grad(false);
  run_plan(chain, x, no_checkpoint_plan(costs)).pow(2).mean().backward();
  std::vector<at::Tensor> plain;
  for (auto& p : params) plain.push_back(p.grad().clone());

  const int64_t none = no_checkpoint_plan(costs).predicted_bytes;
  for (double fraction : {0.25, 0.5, 0.75}) {
    SCOPED_TRACE(fraction);
    const auto plan = plan_for_budget(costs, static_cast<int64_t>(fraction * static_cast<double>(none)));
    ASSERT_TRUE(plan.has_value());
    for (auto& p : params) p.mutable_grad().reset();
    auto tracker = memory::Tracker::create();
    {
      memory::TrackingGuard on(tracker);
      at::Tensor loss;
      {
        memory::PhaseScope fw(memory::Phase::forward);
        loss = run_plan(chain, x, *plan).pow(2).mean();
      }
      memory::PhaseScope bw(memory::Phase::backward);
      loss.backward();
    }
    const int64_t measured = memory::max_by_category(tracker->events())[static_cast<int>(memory::Category::activation)];
    EXPECT_NEAR(static_cast<double>(measured) / static_cast<double>(plan->predicted_bytes), 1.0, 0.10)
        << plan->describe() << " measured " << measured << " predicted " << plan->predicted_bytes;
    for (size_t i = 0; i < params.size(); ++i) {
      EXPECT_LE((params[i].grad() - plain[i]).abs().max().item<double>(), 1e-6);
    }
  }
}
