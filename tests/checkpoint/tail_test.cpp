// checkpoint::tail_linear: the product that closes a residual branch is not multiplied again when
// its block ends a checkpointed region; gradients stay the plain run's (fp32 and under autocast,
// with and without bias, through run_chain, run_plan and selective), only the region's last tail
// is skipped, strict regions skip none, and the planner counts the saving.
#include <gtest/gtest.h>

#include "frugal/precision/autocast.h"
#include "frugal/checkpoint/planner.h"
#include "frugal/checkpoint/selective.h"

using namespace frugal;
using namespace frugal::checkpoint;
using frugal::precision::AutocastGuard;
using frugal::precision::AutocastState;

namespace {

// x + tail_linear(tanh(x W1^T), W2, b2): a residual block, (N, T, 8) -> (N, T, 8)
struct ResidualBlock {
  at::Tensor w1, w2, b2;
  explicit ResidualBlock(bool bias) {
    w1 = (at::randn({24, 8}) * 0.3).requires_grad_();
    w2 = (at::randn({8, 24}) * 0.3).requires_grad_();
    if (bias) b2 = at::randn({8}).requires_grad_();
  }
  std::vector<at::Tensor> params() const {
    std::vector<at::Tensor> p{w1, w2};
    if (b2.defined()) p.push_back(b2);
    return p;
  }
  at::Tensor operator()(const at::Tensor& x) const { return x + tail_linear(at::tanh(checkpoint::linear(x, w1, at::Tensor())), w2, b2); }
};

std::vector<ChainBlock> chain_of(const std::vector<ResidualBlock>& blocks) {
  std::vector<ChainBlock> chain;
  for (const ResidualBlock& b : blocks) chain.push_back({[b](const at::Tensor& x) { return b(x); }, b.params(), {}});
  return chain;
}

struct Gradients {
  at::Tensor y;
  std::vector<at::Tensor> grads;  // input's, then every parameter's
};

// Runs forward and backward; `run` maps the input to the output through the chain.
Gradients run(const std::vector<ResidualBlock>& blocks, const at::Tensor& x0,
              const std::function<at::Tensor(const std::vector<ChainBlock>&, const at::Tensor&)>& how,
              const AutocastState& autocast = AutocastState::off()) {
  at::Tensor x = x0.clone().requires_grad_();
  for (const ResidualBlock& b : blocks) {
    for (at::Tensor p : b.params()) p.mutable_grad().reset();
  }
  Gradients out;
  {
    AutocastGuard guard(autocast);
    out.y = how(chain_of(blocks), x);
  }
  (out.y * out.y).sum().backward();  // backward outside the autocast scope, as the trainer runs it
  out.grads.push_back(x.grad());
  for (const ResidualBlock& b : blocks) {
    for (const at::Tensor& p : b.params()) out.grads.push_back(p.grad());
  }
  return out;
}

at::Tensor plain(const std::vector<ChainBlock>& chain, const at::Tensor& x) {
  at::Tensor h = x;
  for (const ChainBlock& b : chain) h = b.forward(h);
  return h;
}

void expect_same(const Gradients& a, const Gradients& b, double tol) {
  EXPECT_TRUE(at::allclose(a.y, b.y, 0, tol));
  ASSERT_EQ(a.grads.size(), b.grads.size());
  for (size_t i = 0; i < a.grads.size(); ++i) {
    ASSERT_TRUE(a.grads[i].defined() && b.grads[i].defined()) << "gradient " << i;
    EXPECT_LE((a.grads[i] - b.grads[i]).abs().max().item<double>(), tol * (1 + b.grads[i].abs().max().item<double>())) << "gradient " << i;
  }
}

}  // namespace

TEST(TailLinear, EndsOfRegionsAreNotRecomputedAndGradientsStayThePlainRuns) {
  for (bool bias : {false, true}) {
    SCOPED_TRACE(bias ? "with bias" : "without bias");
    torch::manual_seed(3);
    const std::vector<ResidualBlock> blocks{ResidualBlock(bias), ResidualBlock(bias), ResidualBlock(bias), ResidualBlock(bias)};
    const at::Tensor x = at::randn({3, 5, 8});
    const Gradients reference = run(blocks, x, plain);

    // Each block its own region: every tail is skipped, once per backward.
    int64_t before = checkpoint::detail::tail_products_skipped();
    const Gradients full =
        run(blocks, x, [](const auto& chain, const at::Tensor& in) { return run_chain(chain, in, CheckpointPolicy::full()); });
    EXPECT_EQ(checkpoint::detail::tail_products_skipped() - before, 4);
    expect_same(full, reference, 1e-6);

    // Segments of two blocks and a plain one: only each region's last tail (blocks 1 and 2); a
    // skipped tail inside a region would hand the next block a wrong input and wrong gradients.
    ActivationPlan plan;
    plan.segments = {{0, 2, true}, {2, 3, true}, {3, 4, false}};
    before = checkpoint::detail::tail_products_skipped();
    const Gradients planned = run(blocks, x, [&](const auto& chain, const at::Tensor& in) { return run_plan(chain, in, plan); });
    EXPECT_EQ(checkpoint::detail::tail_products_skipped() - before, 2);
    expect_same(planned, reference, 1e-6);

    // Selective regions keep their other products and skip the tail too.
    before = checkpoint::detail::tail_products_skipped();
    const Gradients selective =
        run(blocks, x, [](const auto& chain, const at::Tensor& in) { return run_chain(chain, in, CheckpointPolicy::selective()); });
    EXPECT_EQ(checkpoint::detail::tail_products_skipped() - before, 4);
    expect_same(selective, reference, 1e-6);

    // Under autocast: bf16 products in the recompute's hand-built backward as in the plain run.
    const AutocastState bf16 = AutocastState::compute(c10::kCPU, at::kBFloat16);
    const Gradients reference16 = run(blocks, x, plain, bf16);
    before = checkpoint::detail::tail_products_skipped();
    const Gradients full16 = run(
        blocks, x, [](const auto& chain, const at::Tensor& in) { return run_chain(chain, in, CheckpointPolicy::full()); }, bf16);
    EXPECT_EQ(checkpoint::detail::tail_products_skipped() - before, 4);
    expect_same(full16, reference16, 1e-6);
  }
}

TEST(TailLinear, PlainCallsAndStrictOrUnmarkedRegionsMultiply) {
  torch::manual_seed(4);
  const ResidualBlock block(true);
  const at::Tensor x = at::randn({2, 3, 8}).requires_grad_();
  // Outside a region it is at::linear.
  const at::Tensor z = at::tanh(at::linear(x, block.w1));
  EXPECT_TRUE(at::equal(tail_linear(z, block.w2, block.b2), at::linear(z, block.w2, block.b2)));
  const int64_t before = checkpoint::detail::tail_products_skipped();
  // checkpoint() on any function does not skip unless asked (its last tail might be read after).
  checkpoint::checkpoint([&](const at::Tensor& in) { return block(in); }, x, block.params()).sum().backward();
  // Strict regions compare the recompute's values with the forward's: nothing is skipped.
  checkpoint::checkpoint([&](const at::Tensor& in) { return block(in); }, x, block.params(),
                         CheckpointOptions().skip_final_tail(true).strict(true))
      .sum()
      .backward();
  EXPECT_EQ(checkpoint::detail::tail_products_skipped(), before);
}

TEST(TailLinear, ThePlannerTimesTailsAndCountsTheSaving) {
  torch::manual_seed(5);
  const std::vector<ResidualBlock> blocks{ResidualBlock(false), ResidualBlock(false), ResidualBlock(false)};
  const auto costs = measure_chain(chain_of(blocks), at::randn({4, 64, 8}).requires_grad_(), 3);
  for (const BlockCost& c : costs) {
    EXPECT_GT(c.tail_s, 0.0);
    EXPECT_LT(c.tail_s, c.forward_s);
  }
  // A segment's recompute is its blocks' forward but the last one's tail.
  std::vector<BlockCost> fixed(4, BlockCost{100, 10, 1.0});
  for (auto& c : fixed) c.tail_s = 0.25;
  EXPECT_DOUBLE_EQ(recompute_seconds(fixed, {{0, 2, true}, {2, 4, true}}), 2 * (2.0 - 0.25));
  EXPECT_DOUBLE_EQ(recompute_seconds(fixed, {{0, 1, true}, {1, 2, true}, {2, 3, true}, {3, 4, true}}), 4 * 0.75);
  // The plans charge the saving (their optimality with tails: Planner.OptimalOnSmallChainsByBruteForce).
  const auto plan = plan_for_budget(fixed, 130);
  ASSERT_TRUE(plan);
  EXPECT_EQ(plan->describe(), "0 ckpt | 1 ckpt | 2 ckpt | 3");
  EXPECT_DOUBLE_EQ(plan->recompute_s, 3 * 0.75);
}
