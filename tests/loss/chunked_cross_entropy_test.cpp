// The chunked loss, and the plain one (linear_cross_entropy), equal Linear + cross_entropy, in value
// and in every gradient: with ignore_index, mean and sum, with and without bias, chunks that do not
// divide the token count, vocabularies that leave vector tails, and bf16 weights. And the row
// kernels behind them agree with double precision and with one another.
#include <gtest/gtest.h>
#include <torch/csrc/autograd/autograd.h>
#include <torch/nn/functional/loss.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <limits>
#include <string>
#include <vector>

#include "frugal/loss/chunked_cross_entropy.h"
#include "frugal/loss/cross_entropy_rows.h"
#include "frugal/memory/tracker.h"

using namespace frugal;
using loss::ChunkedCrossEntropyOptions;
using loss::Reduction;
using loss::RowKernel;

namespace {

double rel_diff(const at::Tensor& a, const at::Tensor& b) { return ((a - b).abs().max() / b.abs().max().clamp_min(1e-12)).item<double>(); }

// Gaps of a loss and its gradients from the reference, relative to the reference's largest entry
// (for the loss, to max(|loss|, 1)); NaN where both are NaN counts as no gap.
struct Gaps {
  double loss = 0, grad = 0;
};

double relative_gap(const at::Tensor& got, const at::Tensor& want, double floor) {
  const at::Tensor g = got.to(at::kDouble), w = want.to(at::kDouble);
  EXPECT_TRUE(at::equal(g.isnan(), w.isnan())) << "NaN in one and not the other";
  const at::Tensor both = g.isnan() & w.isnan();
  const double gap = (g - w).masked_fill(both, 0).abs().max().item<double>();
  return gap / std::max(w.masked_fill(both, 0).abs().max().item<double>(), floor);
}

// Loss and gradients (of 3 * loss, so that the incoming gradient is not 1) with respect to
// hidden, weight and bias (when defined). `kind`: "reference" (at::linear + cross_entropy on fp32
// copies of the same values), "plain" (linear_cross_entropy) or a chunk size.
struct LossRun {
  at::Tensor loss;
  std::vector<at::Tensor> grads;
};

LossRun run_loss(const at::Tensor& hidden, const at::Tensor& weight, const at::Tensor& bias, const at::Tensor& targets, Reduction reduction,
                 int64_t chunk, bool plain, bool reference) {
  auto leaf = [&](const at::Tensor& t) {
    if (!t.defined()) return t;
    return (reference ? t.to(at::kFloat) : t).detach().clone().requires_grad_();
  };
  const at::Tensor h = leaf(hidden), w = leaf(weight), b = leaf(bias);
  const auto options = ChunkedCrossEntropyOptions().chunk_size(chunk).ignore_index(-100).reduction(reduction);
  at::Tensor l;
  if (reference) {
    auto ce = torch::nn::functional::CrossEntropyFuncOptions().ignore_index(-100);
    if (reduction == Reduction::sum) ce.reduction(torch::kSum);
    l = torch::nn::functional::cross_entropy(at::linear(h, w, b).reshape({-1, w.size(0)}), targets.reshape({-1}), ce);
  } else if (plain) {
    l = loss::linear_cross_entropy(h, w, b, targets, options);
  } else {
    l = loss::chunked_cross_entropy(h, w, b, targets, options);
  }
  std::vector<at::Tensor> inputs = {h, w};
  if (b.defined()) inputs.push_back(b);
  LossRun r;
  r.loss = l.detach();
  r.grads = torch::autograd::grad({l * 3.0}, inputs);
  return r;
}

Gaps gaps_from_reference(const at::Tensor& hidden, const at::Tensor& weight, const at::Tensor& bias, const at::Tensor& targets,
                         Reduction reduction, int64_t chunk, bool plain) {
  const LossRun want = run_loss(hidden, weight, bias, targets, reduction, chunk, plain, true);
  const LossRun got = run_loss(hidden, weight, bias, targets, reduction, chunk, plain, false);
  Gaps g;
  g.loss = relative_gap(got.loss, want.loss, 1.0);
  for (size_t i = 0; i < got.grads.size(); ++i) {
    EXPECT_EQ(got.grads[i].scalar_type(), (i == 0 ? hidden : i == 1 ? weight : bias).scalar_type()) << "input " << i;
    g.grad = std::max(g.grad, relative_gap(got.grads[i], want.grads[i], 1e-6));
  }
  return g;
}

std::string label(int64_t V, int64_t chunk, bool plain, bool with_bias, Reduction reduction) {
  return "V " + std::to_string(V) + (plain ? " plain" : " chunk " + std::to_string(chunk)) + (with_bias ? " bias" : "") +
         (reduction == Reduction::mean ? " mean" : " sum");
}

// Without and with a bias (random, in the weight's dtype), each reduction, chunks of 1, 64 and all
// rows and the plain loss, against the reference: every gap within its tolerance. Returns the
// worst gaps, for the test to print.
Gaps sweep_against_reference(const at::Tensor& hidden, const at::Tensor& weight, const at::Tensor& targets, double loss_tolerance,
                             double grad_tolerance) {
  const int64_t N = hidden.size(0), V = weight.size(0);
  Gaps worst;
  for (bool with_bias : {false, true}) {
    const at::Tensor bias = with_bias ? at::randn({V}).to(weight.scalar_type()) : at::Tensor();
    for (Reduction reduction : {Reduction::mean, Reduction::sum}) {
      for (int64_t chunk : {int64_t{1}, int64_t{64}, N, int64_t{0}}) {
        const bool plain = chunk == 0;
        SCOPED_TRACE(label(V, chunk, plain, with_bias, reduction));
        const Gaps g = gaps_from_reference(hidden, weight, bias, targets, reduction, plain ? 1 : chunk, plain);
        EXPECT_LE(g.loss, loss_tolerance);
        EXPECT_LE(g.grad, grad_tolerance);
        worst.loss = std::max(worst.loss, g.loss);
        worst.grad = std::max(worst.grad, g.grad);
      }
    }
  }
  return worst;
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

        const at::Tensor out =
            loss::chunked_cross_entropy(hidden, weight, bias, targets, ChunkedCrossEntropyOptions().chunk_size(chunk).reduction(reduction));
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
  loss::chunked_cross_entropy(hidden, weight, at::Tensor(), targets, ChunkedCrossEntropyOptions().ignore_index(-1)).backward();
  EXPECT_EQ(hidden.grad()[1].abs().sum().item<double>(), 0.0);
  EXPECT_EQ(hidden.grad()[3].abs().sum().item<double>(), 0.0);
  EXPECT_GT(hidden.grad()[0].abs().sum().item<double>(), 0.0);
}

TEST(ChunkedCrossEntropy, BadInputIsAClearError) {
  const at::Tensor hidden = at::randn({4, 8});
  const at::Tensor weight = at::randn({10, 8});
  EXPECT_THROW(loss::chunked_cross_entropy(hidden, weight, at::Tensor(), at::tensor({1, 2, 10, 3}, at::kLong)), c10::Error);
  EXPECT_THROW(loss::chunked_cross_entropy(hidden, weight, at::Tensor(), at::tensor({1, 2, 3}, at::kLong)), c10::Error);
  EXPECT_THROW(loss::chunked_cross_entropy(hidden, at::randn({10, 9}), at::Tensor(), at::tensor({1, 2, 3, 4}, at::kLong)), c10::Error);
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

// Against at::linear + cross_entropy in fp32: vocabularies that leave every vector tail (1, 7 and 33
// classes, 500 = 31 * 16 + 4, 4099), chunks of 1 token, 64 and all of them, and the plain loss;
// a fifth of the targets ignored. Tolerance: the loss within 2e-6 of max(|loss|, 1), each gradient
// within 1e-5 of its largest entry (the exponentials and the sums' order differ from ATen's).
TEST(ChunkedCrossEntropy, MatchesTheReferenceOverVocabulariesAndChunks) {
  torch::manual_seed(3);
  const int64_t N = 67, H = 24;
  Gaps worst;
  for (int64_t V : {1, 7, 33, 500, 4099}) {
    const at::Tensor hidden = at::randn({N, H});
    const at::Tensor weight = at::randn({V, H}) * 0.5;
    at::Tensor targets = at::randint(0, V, {N}, at::kLong);
    targets.index_put_({at::rand({N}) < 0.2}, -100);
    const Gaps g = sweep_against_reference(hidden, weight, targets, 2e-6, 1e-5);
    worst.loss = std::max(worst.loss, g.loss);
    worst.grad = std::max(worst.grad, g.grad);
  }
  std::printf("[ measured ] fp32: loss gap %.2e, gradient gap %.2e\n", worst.loss, worst.grad);
}

// With every target ignored the loss is what cross_entropy gives (the mean is 0 / 0: NaN; the sum
// 0) and every gradient is 0, as the reference's.
TEST(ChunkedCrossEntropy, AllTargetsIgnored) {
  const at::Tensor hidden = at::randn({10, 8}), weight = at::randn({13, 8}), bias = at::randn({13});
  const at::Tensor targets = at::full({10}, -100, at::kLong);
  for (Reduction reduction : {Reduction::mean, Reduction::sum}) {
    for (int64_t chunk : {int64_t{3}, int64_t{0}}) {
      SCOPED_TRACE(label(13, chunk, chunk == 0, true, reduction));
      const LossRun got = run_loss(hidden, weight, bias, targets, reduction, std::max<int64_t>(chunk, 1), chunk == 0, false);
      const LossRun want = run_loss(hidden, weight, bias, targets, reduction, 1, false, true);
      if (reduction == Reduction::mean) {
        EXPECT_TRUE(std::isnan(got.loss.item<double>()));
        EXPECT_TRUE(std::isnan(want.loss.item<double>()));
      } else {
        EXPECT_EQ(got.loss.item<double>(), 0.0);
      }
      for (size_t i = 0; i < got.grads.size(); ++i) {
        EXPECT_EQ(got.grads[i].abs().max().item<double>(), 0.0) << "input " << i;
        EXPECT_TRUE(at::equal(got.grads[i], want.grads[i])) << "input " << i;
      }
    }
  }
}

// bf16 hidden states, weight and bias: the products run in bf16 (logits rounded to bf16 before the
// fp32 softmax, the logits' gradient rounded to bf16 before its products), against the reference
// computed in fp32 from the same bf16 values. Tolerance: the loss within 1e-2 of max(|loss|, 1),
// each gradient within 3e-2 of its largest entry.
TEST(ChunkedCrossEntropy, Bf16WeightsMatchTheFp32Reference) {
  torch::manual_seed(4);
  const int64_t N = 67, H = 32;
  Gaps worst;
  for (int64_t V : {33, 500}) {
    const at::Tensor hidden = at::randn({N, H}).to(at::kBFloat16);
    const at::Tensor weight = (at::randn({V, H}) * 0.3).to(at::kBFloat16);
    at::Tensor targets = at::randint(0, V, {N}, at::kLong);
    targets.index_put_({at::rand({N}) < 0.2}, -100);
    const Gaps g = sweep_against_reference(hidden, weight, targets, 1e-2, 3e-2);
    worst.loss = std::max(worst.loss, g.loss);
    worst.grad = std::max(worst.grad, g.grad);
  }
  std::printf("[ measured ] bf16: loss gap %.2e, gradient gap %.2e\n", worst.loss, worst.grad);
}

// The plain loss's backward leaves the logits it kept as they were: with the graph retained, a
// second backward gives the same gradients again.
TEST(ChunkedCrossEntropy, PlainLossRunsBackwardTwice) {
  const at::Tensor hidden = at::randn({9, 8}).requires_grad_(), weight = at::randn({11, 8}).requires_grad_();
  const at::Tensor targets = at::randint(0, 11, {9}, at::kLong);
  const at::Tensor l = loss::linear_cross_entropy(hidden, weight, at::Tensor(), targets);
  const auto first = torch::autograd::grad({l}, {hidden, weight}, {}, /*retain_graph=*/true);
  const auto second = torch::autograd::grad({l}, {hidden, weight});
  for (size_t i = 0; i < first.size(); ++i) EXPECT_TRUE(at::equal(first[i], second[i])) << "input " << i;
}

// fp32, as the chunked loss's test: bf16 products on the CPU allocate workspaces of their own,
// which differ between LibTorch versions (the trainer's estimate tests cover bf16 runs).
TEST(ChunkedCrossEntropy, PlainBytesFormulaMatchesTheTracker) {
  const int64_t N = 64, H = 16, V = 200;
  const at::Tensor hidden = at::randn({N, H}).requires_grad_();
  const at::Tensor weight = at::randn({V, H}).requires_grad_();
  const at::Tensor targets = at::randint(0, V, {N}, at::kLong);
  const auto b = loss::linear_cross_entropy_bytes(N, H, V, at::kFloat);
  auto tracker = memory::Tracker::create();
  memory::TrackingGuard on(tracker);
  memory::mark_step(0);
  at::Tensor l;
  {
    memory::PhaseScope fw(memory::Phase::forward);
    l = loss::linear_cross_entropy(hidden, weight, at::Tensor(), targets);
  }
  const auto after_forward = tracker->step_summaries().back();
  const int64_t kept = tracker->live_by_category()[static_cast<int>(memory::Category::activation)];
  EXPECT_NEAR(static_cast<double>(kept), static_cast<double>(b.kept), 0.05 * static_cast<double>(b.kept) + 64);
  EXPECT_NEAR(static_cast<double>(after_forward.breakdown[static_cast<int>(memory::Category::temporary)]),
              static_cast<double>(b.forward_temporary), 0.10 * static_cast<double>(b.forward_temporary) + 64);
  memory::mark_step(1);
  {
    memory::PhaseScope bw(memory::Phase::backward);
    l.backward();
  }
  const auto backward = tracker->step_summaries().back();
  // hidden is a leaf here: its gradient stays, as 'other', like the weight's
  EXPECT_NEAR(static_cast<double>(backward.breakdown[static_cast<int>(memory::Category::temporary)] + N * H * 4),
              static_cast<double>(b.backward_temporary), 0.10 * static_cast<double>(b.backward_temporary));
  EXPECT_EQ(backward.breakdown[static_cast<int>(memory::Category::other)], b.weight_gradient + N * H * 4);
}

namespace {

// Rows of logits with room between them (stride > V), filled with `fill` there.
struct Rows {
  int64_t n, V, stride;
  std::vector<float> x;
  std::vector<int64_t> targets;
};

constexpr float kPad = 12345.0f;

Rows make_rows(int64_t V, uint64_t seed) {
  Rows r{6, V, V + 3, {}, {}};
  r.x.assign(static_cast<size_t>(r.n * r.stride), kPad);
  const at::Tensor values = at::randn({r.n, V}, at::TensorOptions().dtype(at::kFloat)) * 4.0;
  const float* v = values.data_ptr<float>();
  for (int64_t i = 0; i < r.n; ++i) {
    for (int64_t j = 0; j < V; ++j) r.x[i * r.stride + j] = v[i * V + j];
    r.targets.push_back(static_cast<int64_t>((seed * 7 + i * 13) % static_cast<uint64_t>(V)));
  }
  // row 1: far below its maximum, past the smallest normal exponential, and -inf
  for (int64_t j = 0; j < V; ++j) {
    if (j % 3 == 1) r.x[r.stride + j] = -90.0f - static_cast<float>(j);
    if (j % 5 == 2) r.x[r.stride + j] = -std::numeric_limits<float>::infinity();
  }
  r.x[r.stride + r.targets[1]] = 0.5f;  // the target itself finite
  r.targets[3] = -100;                  // row 3: ignored
  return r;
}

}  // namespace

// Each row kernel this processor runs (portable always; AVX2 and AVX-512 where present) against
// double precision, and against the portable one: the log-sum-exp within 4e-7 of max(|lse|, 1),
// the summed loss within 1e-6 relative, each gradient entry within 2e-6 of the scale; padding
// between rows untouched; an ignored row's gradient 0, in place or into another buffer.
TEST(CrossEntropyRows, EveryKernelAgreesWithDoublePrecision) {
  torch::manual_seed(5);
  double worst_lse = 0, worst_grad = 0, worst_vs_portable = 0;
  for (RowKernel kernel : {RowKernel::portable, RowKernel::avx2, RowKernel::avx512, RowKernel::automatic}) {
    if (!loss::row_kernel_available(kernel)) {
      std::printf("[ skipped  ] row kernel %d: not on this processor\n", static_cast<int>(kernel));
      continue;
    }
    for (int64_t V : {1, 2, 7, 8, 15, 16, 17, 31, 32, 33, 500, 4099}) {
      SCOPED_TRACE("kernel " + std::to_string(static_cast<int>(kernel)) + " V " + std::to_string(V));
      const Rows r = make_rows(V, static_cast<uint64_t>(V));
      std::vector<float> lse(static_cast<size_t>(r.n)), lse_portable(static_cast<size_t>(r.n));
      const double sum = loss::cross_entropy_rows_forward(r.x.data(), r.n, V, r.stride, r.targets.data(), -100, lse.data(), kernel);
      const double sum_portable =
          loss::cross_entropy_rows_forward(r.x.data(), r.n, V, r.stride, r.targets.data(), -100, lse_portable.data(), RowKernel::portable);
      const float scale = 0.37f;
      std::vector<float> in_place = r.x, out(r.x.size(), kPad), portable(r.x.size(), kPad);
      loss::cross_entropy_rows_backward(in_place.data(), in_place.data(), r.n, V, r.stride, r.targets.data(), -100, lse.data(), scale,
                                        kernel);
      loss::cross_entropy_rows_backward(r.x.data(), out.data(), r.n, V, r.stride, r.targets.data(), -100, lse.data(), scale, kernel);
      loss::cross_entropy_rows_backward(r.x.data(), portable.data(), r.n, V, r.stride, r.targets.data(), -100, lse_portable.data(), scale,
                                        RowKernel::portable);
      double want_sum = 0;
      for (int64_t i = 0; i < r.n; ++i) {
        const float* x = r.x.data() + i * r.stride;
        const int64_t t = r.targets[static_cast<size_t>(i)];
        if (t == -100) {
          EXPECT_EQ(lse[static_cast<size_t>(i)], 0.0f);
          for (int64_t j = 0; j < V; ++j) {
            EXPECT_EQ(in_place[i * r.stride + j], 0.0f);
            EXPECT_EQ(out[i * r.stride + j], 0.0f);
          }
          continue;
        }
        double m = -std::numeric_limits<double>::infinity(), s = 0;
        for (int64_t j = 0; j < V; ++j) m = std::max(m, static_cast<double>(x[j]));
        for (int64_t j = 0; j < V; ++j) s += std::exp(static_cast<double>(x[j]) - m);
        const double want_lse = m + std::log(s);
        want_sum += want_lse - x[t];
        const double lse_gap = std::abs(lse[static_cast<size_t>(i)] - want_lse) / std::max(std::abs(want_lse), 1.0);
        EXPECT_LE(lse_gap, 4e-7) << "row " << i;
        worst_lse = std::max(worst_lse, lse_gap);
        worst_vs_portable =
            std::max(worst_vs_portable, std::abs(static_cast<double>(lse[static_cast<size_t>(i)]) - lse_portable[static_cast<size_t>(i)]) /
                                            std::max(std::abs(want_lse), 1.0));
        for (int64_t j = 0; j < V; ++j) {
          const double want = (std::exp(static_cast<double>(x[j]) - want_lse) - (j == t ? 1.0 : 0.0)) * scale;
          const size_t k = static_cast<size_t>(i * r.stride + j);
          const double gap = std::abs(in_place[k] - want) / scale;
          EXPECT_LE(gap, 2e-6) << "row " << i << " class " << j;
          EXPECT_EQ(in_place[k], out[k]) << "row " << i << " class " << j;
          worst_grad = std::max(worst_grad, gap);
          worst_vs_portable = std::max(worst_vs_portable, std::abs(static_cast<double>(out[k]) - portable[k]) / scale);
        }
      }
      EXPECT_NEAR(sum, want_sum, 1e-6 * std::abs(want_sum));
      EXPECT_NEAR(sum, sum_portable, 1e-6 * std::abs(want_sum));
      for (int64_t i = 0; i < r.n; ++i) {
        for (int64_t j = V; j < r.stride; ++j) {
          EXPECT_EQ(in_place[i * r.stride + j], kPad);
          EXPECT_EQ(out[i * r.stride + j], kPad);
        }
      }
    }
  }
  std::printf("[ measured ] rows: lse gap %.2e, gradient gap %.2e (of the scale), kernel vs portable %.2e\n", worst_lse, worst_grad,
              worst_vs_portable);
}

// A NaN logit makes its row's loss and gradient NaN on every kernel, as it does in cross_entropy.
TEST(CrossEntropyRows, NaNPropagates) {
  for (RowKernel kernel : {RowKernel::portable, RowKernel::avx2, RowKernel::avx512}) {
    if (!loss::row_kernel_available(kernel)) continue;
    SCOPED_TRACE(static_cast<int>(kernel));
    std::vector<float> x(40, 0.25f);
    x[17] = std::numeric_limits<float>::quiet_NaN();
    const int64_t target = 3;
    float lse = 0;
    EXPECT_TRUE(std::isnan(loss::cross_entropy_rows_forward(x.data(), 1, 40, 40, &target, -100, &lse, kernel)));
    loss::cross_entropy_rows_backward(x.data(), x.data(), 1, 40, 40, &target, -100, &lse, 1.0f, kernel);
    EXPECT_TRUE(std::isnan(x[0]));
  }
}
