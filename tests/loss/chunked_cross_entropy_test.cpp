// The chunked loss equals Linear + cross_entropy, in value and in every gradient (to 1e-5
// relative), with ignore_index, mean and sum, with and without bias, and chunks that do not divide
// the token count.
#include <gtest/gtest.h>
#include <torch/csrc/autograd/autograd.h>
#include <torch/nn/functional/loss.h>

#include "frugal/loss/chunked_cross_entropy.h"
#include "frugal/memory/tracker.h"

using namespace frugal;
using loss::ChunkedCrossEntropyOptions;
using loss::Reduction;

namespace {

double rel_diff(const at::Tensor& a, const at::Tensor& b) {
  return ((a - b).abs().max() / b.abs().max().clamp_min(1e-12)).item<double>();
}

}  // namespace

TEST(ChunkedCrossEntropy, EqualsLinearPlusCrossEntropy) {
  torch::manual_seed(0);
  for (bool with_bias : {true, false}) {
    for (Reduction reduction : {Reduction::mean, Reduction::sum}) {
      for (int64_t chunk : {1, 7, 64, 1000}) {
        SCOPED_TRACE("bias " + std::to_string(with_bias) + " chunk " + std::to_string(chunk) +
                     (reduction == Reduction::mean ? " mean" : " sum"));
        const at::Tensor hidden = at::randn({3, 21, 16}).requires_grad_();  // (B, T, H)
        const at::Tensor weight = (at::randn({50, 16}) * 0.3).requires_grad_();
        const at::Tensor bias = with_bias ? at::randn({50}).requires_grad_() : at::Tensor();
        at::Tensor targets = at::randint(0, 50, {3, 21}, at::kLong);
        targets.index_put_({at::rand({3, 21}) < 0.2}, -100);  // some ignored tokens

        const at::Tensor logits = at::linear(hidden, weight, bias).reshape({-1, 50});
        auto ce_options = torch::nn::functional::CrossEntropyFuncOptions().ignore_index(-100);
        if (reduction == Reduction::mean) {
          ce_options.reduction(torch::kMean);
        } else {
          ce_options.reduction(torch::kSum);
        }
        const at::Tensor ref = torch::nn::functional::cross_entropy(logits, targets.reshape({-1}), ce_options);
        std::vector<at::Tensor> inputs = {hidden, weight};
        if (with_bias) inputs.push_back(bias);
        const auto ref_grads = torch::autograd::grad({ref * 3.0}, inputs);

        const at::Tensor out = loss::chunked_cross_entropy(
            hidden, weight, bias, targets, ChunkedCrossEntropyOptions().chunk_size(chunk).reduction(reduction));
        EXPECT_LE(rel_diff(out, ref), 1e-6);
        const auto grads = torch::autograd::grad({out * 3.0}, inputs);
        for (size_t i = 0; i < grads.size(); ++i) EXPECT_LE(rel_diff(grads[i], ref_grads[i]), 1e-5) << "input " << i;
      }
    }
  }
}

TEST(ChunkedCrossEntropy, IgnoredTokensGetNoGradient) {
  const at::Tensor hidden = at::randn({4, 8}).requires_grad_();
  const at::Tensor weight = at::randn({10, 8}).requires_grad_();
  const at::Tensor targets = at::tensor({3, -1, 7, -1}, at::kLong);
  loss::chunked_cross_entropy(hidden, weight, at::Tensor(), targets, ChunkedCrossEntropyOptions().ignore_index(-1))
      .backward();
  EXPECT_EQ(hidden.grad()[1].abs().sum().item<double>(), 0.0);
  EXPECT_EQ(hidden.grad()[3].abs().sum().item<double>(), 0.0);
  EXPECT_GT(hidden.grad()[0].abs().sum().item<double>(), 0.0);
}

TEST(ChunkedCrossEntropy, BadInputIsAClearError) {
  const at::Tensor hidden = at::randn({4, 8});
  const at::Tensor weight = at::randn({10, 8});
  EXPECT_THROW(loss::chunked_cross_entropy(hidden, weight, at::Tensor(), at::tensor({1, 2, 10, 3}, at::kLong)),
               c10::Error);
  EXPECT_THROW(loss::chunked_cross_entropy(hidden, weight, at::Tensor(), at::tensor({1, 2, 3}, at::kLong)), c10::Error);
  EXPECT_THROW(loss::chunked_cross_entropy(hidden, at::randn({10, 9}), at::Tensor(), at::tensor({1, 2, 3, 4}, at::kLong)),
               c10::Error);
  EXPECT_THROW(loss::chunked_cross_entropy(hidden, weight, at::Tensor(), at::tensor({1, 2, 3, 4}, at::kLong),
                                           ChunkedCrossEntropyOptions().chunk_size(0)),
               c10::Error);
}

TEST(ChunkedCrossEntropy, BytesFormulaMatchesTheTracker) {
  const int64_t N = 64, H = 16, V = 200, chunk = 24;
  const at::Tensor hidden = at::randn({N, H}).requires_grad_();
  const at::Tensor weight = at::randn({V, H}).requires_grad_();
  const at::Tensor targets = at::randint(0, V, {N}, at::kLong);
  const auto b = loss::chunked_cross_entropy_bytes(N, H, V, chunk, at::kFloat);
  auto tracker = memory::Tracker::create();
  memory::TrackingGuard on(tracker);
  memory::mark_step(0);
  at::Tensor l;
  {
    memory::PhaseScope fw(memory::Phase::forward);
    l = loss::chunked_cross_entropy(hidden, weight, at::Tensor(), targets, loss::ChunkedCrossEntropyOptions().chunk_size(chunk));
  }
  const auto after_forward = tracker->step_summaries().back();
  const int64_t kept = tracker->live_by_category()[static_cast<int>(memory::Category::activation)];
  EXPECT_NEAR(static_cast<double>(kept), static_cast<double>(b.kept), 0.05 * static_cast<double>(b.kept) + 64);
  EXPECT_NEAR(static_cast<double>(after_forward.breakdown[static_cast<int>(memory::Category::temporary)]),
              static_cast<double>(b.forward_temporary), 0.10 * static_cast<double>(b.forward_temporary));
  memory::mark_step(1);
  {
    memory::PhaseScope bw(memory::Phase::backward);
    l.backward();
  }
  const auto backward = tracker->step_summaries().back();
  // Here hidden is a leaf, so its gradient (an intermediate inside a model: part of
  // backward_temporary) stays, like the weight's, as 'other': nothing tags leaves' gradients here.
  EXPECT_NEAR(static_cast<double>(backward.breakdown[static_cast<int>(memory::Category::temporary)] + N * H * 4),
              static_cast<double>(b.backward_temporary), 0.10 * static_cast<double>(b.backward_temporary));
  EXPECT_EQ(backward.breakdown[static_cast<int>(memory::Category::other)], b.weight_gradient + N * H * 4);
}
