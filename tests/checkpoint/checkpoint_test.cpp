// Checkpointed regions give the plain run's outputs and gradients (inputs and every parameter),
// with inputs that do not require grad, with weights shared between regions, and their forward
// runs exactly twice per training step.
#include <gtest/gtest.h>
#include <torch/nn/modules/linear.h>

#include "frugal/checkpoint/checkpoint.h"
#include "frugal/checkpoint/selective.h"
#include "../support/common.h"

using namespace frugal;

namespace {

using frugal::testing::max_diff;

struct TwoLayer {
  at::Tensor w1, b1, w2;
  TwoLayer() {
    w1 = at::randn({16, 8}).requires_grad_();
    b1 = at::randn({16}).requires_grad_();
    w2 = at::randn({4, 16}).requires_grad_();
  }
  std::vector<at::Tensor> params() const { return {w1, b1, w2}; }
  // x: (N, 8) -> (N, 4)
  at::Tensor operator()(const at::Tensor& x) const { return at::linear(at::tanh(at::linear(x, w1, b1)), w2); }
  void clear() {
    for (auto* p : {&w1, &b1, &w2}) p->mutable_grad().reset();
  }
};

}  // namespace

TEST(Checkpoint, OutputAndEveryGradientEqualThePlainRun) {
  torch::manual_seed(0);
  TwoLayer net;
  at::Tensor x = at::randn({5, 8}).requires_grad_();

  at::Tensor y_plain = net(x);
  y_plain.sum().backward();
  const at::Tensor gx = x.grad().clone(), gw1 = net.w1.grad().clone(), gb1 = net.b1.grad().clone(), gw2 = net.w2.grad().clone();
  x.mutable_grad().reset();
  net.clear();

  at::Tensor y = checkpoint::checkpoint([&](const at::Tensor& in) { return net(in); }, x, net.params());
  EXPECT_TRUE(y.requires_grad());
  EXPECT_TRUE(at::equal(y, y_plain));
  y.sum().backward();
  EXPECT_LE(max_diff(x.grad(), gx), 1e-6);
  EXPECT_LE(max_diff(net.w1.grad(), gw1), 1e-6);
  EXPECT_LE(max_diff(net.b1.grad(), gb1), 1e-6);
  EXPECT_LE(max_diff(net.w2.grad(), gw2), 1e-6);
}

TEST(Checkpoint, ParameterGradientsFlowWhenNoInputRequiresGrad) {
  torch::manual_seed(1);
  TwoLayer net;
  const at::Tensor x = at::randn({5, 8});  // no requires_grad, no dummy input needed
  net(x).pow(2).sum().backward();
  const at::Tensor gw1 = net.w1.grad().clone(), gw2 = net.w2.grad().clone();
  net.clear();

  at::Tensor y = checkpoint::checkpoint([&](const at::Tensor& in) { return net(in); }, x, net.params());
  ASSERT_TRUE(y.requires_grad());
  y.pow(2).sum().backward();
  EXPECT_LE(max_diff(net.w1.grad(), gw1), 1e-6);
  EXPECT_LE(max_diff(net.w2.grad(), gw2), 1e-6);
}

TEST(Checkpoint, SharedWeightAccumulatesOnceFromEachRegion) {
  torch::manual_seed(2);
  at::Tensor w = at::randn({8, 8}).requires_grad_();
  const at::Tensor x = at::randn({3, 8});
  auto region = [&](const at::Tensor& in) { return at::tanh(at::linear(in, w)); };

  region(region(x)).sum().backward();
  const at::Tensor gw = w.grad().clone();
  w.mutable_grad().reset();

  at::Tensor h = checkpoint::checkpoint(region, x, {w});
  checkpoint::checkpoint(region, h, {w}).sum().backward();
  EXPECT_LE(max_diff(w.grad(), gw), 1e-6);

  // A second step accumulates on top, exactly as the plain run would.
  h = checkpoint::checkpoint(region, x, {w});
  checkpoint::checkpoint(region, h, {w}).sum().backward();
  EXPECT_LE(max_diff(w.grad(), 2 * gw), 2e-6);
}

TEST(Checkpoint, RegionForwardRunsTwicePerStepAndAPlainOneOnce) {
  torch::manual_seed(3);
  TwoLayer net;
  const at::Tensor x = at::randn({5, 8}).requires_grad_();
  int checkpointed_calls = 0, plain_calls = 0;
  auto region = [&](const at::Tensor& in) {
    ++checkpointed_calls;
    return net(in);
  };
  auto plain = [&](const at::Tensor& in) {
    ++plain_calls;
    return at::tanh(in);
  };
  at::Tensor h = checkpoint::checkpoint(region, x, net.params());
  at::Tensor y = plain(h);
  EXPECT_EQ(checkpointed_calls, 1);
  EXPECT_EQ(plain_calls, 1);
  y.sum().backward();
  EXPECT_EQ(checkpointed_calls, 2);
  EXPECT_EQ(plain_calls, 1);
}

TEST(Checkpoint, SeveralInputsAndOutputs) {
  torch::manual_seed(4);
  at::Tensor a = at::randn({4, 4}).requires_grad_();
  at::Tensor b = at::randn({4, 4}).requires_grad_();
  at::Tensor w = at::randn({4, 4}).requires_grad_();
  auto fn = [&](const std::vector<at::Tensor>& in) {
    at::Tensor s = at::sigmoid(in[0].mm(w) + in[1]);
    return std::vector<at::Tensor>{s * in[1], s.sum(1)};
  };
  auto plain = fn({a, b});
  (plain[0].sum() + plain[1].pow(2).sum()).backward();
  const at::Tensor ga = a.grad().clone(), gb = b.grad().clone(), gw = w.grad().clone();
  for (auto* t : {&a, &b, &w}) t->mutable_grad().reset();

  auto outs = checkpoint::checkpoint(fn, {a, b}, {w});
  ASSERT_EQ(outs.size(), 2u);
  EXPECT_TRUE(at::equal(outs[0], plain[0]));
  (outs[0].sum() + outs[1].pow(2).sum()).backward();
  EXPECT_LE(max_diff(a.grad(), ga), 1e-6);
  EXPECT_LE(max_diff(b.grad(), gb), 1e-6);
  EXPECT_LE(max_diff(w.grad(), gw), 1e-6);
}

TEST(Checkpoint, ModuleOverloadUsesTheModulesParameters) {
  torch::manual_seed(5);
  torch::nn::Linear lin(6, 3);
  const at::Tensor x = at::randn({2, 6});
  lin->forward(x).sum().backward();
  const at::Tensor gw = lin->weight.grad().clone(), gb = lin->bias.grad().clone();
  lin->zero_grad();
  lin->weight.mutable_grad().reset();
  lin->bias.mutable_grad().reset();

  checkpoint::checkpoint(lin, x).sum().backward();
  EXPECT_LE(max_diff(lin->weight.grad(), gw), 1e-6);
  EXPECT_LE(max_diff(lin->bias.grad(), gb), 1e-6);
}

TEST(Checkpoint, WithoutGradModeItIsAPlainCall) {
  TwoLayer net;
  const at::Tensor x = at::randn({5, 8});
  int calls = 0;
  at::NoGradGuard no_grad;
  at::Tensor y = checkpoint::checkpoint(
      [&](const at::Tensor& in) {
        ++calls;
        return net(in);
      },
      x, net.params());
  EXPECT_FALSE(y.requires_grad());
  EXPECT_EQ(calls, 1);
}

TEST(Checkpoint, SelectiveKeepsLinearOutputsWithAndWithoutBias) {
  torch::manual_seed(6);
  at::Tensor w1 = at::randn({12, 8}).requires_grad_(), w2 = at::randn({4, 12}).requires_grad_();
  at::Tensor b2 = at::randn({4}).requires_grad_();
  at::Tensor x = at::randn({5, 8}).requires_grad_();
  auto region = [&](const at::Tensor& in) { return checkpoint::linear(at::gelu(checkpoint::linear(in, w1, at::Tensor())), w2, b2); };
  region(x).pow(2).sum().backward();
  std::vector<at::Tensor> plain = {x.grad().clone(), w1.grad().clone(), w2.grad().clone(), b2.grad().clone()};
  for (auto* t : {&x, &w1, &w2, &b2}) t->mutable_grad().reset();

  checkpoint::checkpoint(region, x, {w1, w2, b2}, checkpoint::CheckpointOptions().keep_linear_outputs(true)).pow(2).sum().backward();
  EXPECT_LE(max_diff(x.grad(), plain[0]), 1e-5);
  EXPECT_LE(max_diff(w1.grad(), plain[1]), 1e-5);
  EXPECT_LE(max_diff(w2.grad(), plain[2]), 1e-5);
  EXPECT_LE(max_diff(b2.grad(), plain[3]), 1e-5);
}
