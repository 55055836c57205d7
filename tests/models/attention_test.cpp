// causal_attention against the textbook computation: outputs and gradients, and causality.
#include <gtest/gtest.h>

#include <ATen/ATen.h>
#include <torch/csrc/autograd/autograd.h>

#include <cmath>

#include "frugal/models/attention.h"

TEST(Attention, MatchesPlainMaskedSoftmaxAndIsCausal) {
  at::manual_seed(0);
  const int64_t B = 2, H = 3, T = 5, dh = 8;
  const at::Tensor q = at::randn({B, H, T, dh}).requires_grad_(true);
  const at::Tensor k = at::randn({B, H, T, dh}).requires_grad_(true);
  const at::Tensor v = at::randn({B, H, T, dh}).requires_grad_(true);
  const at::Tensor out = frugal::models::causal_attention(q, k, v);  // (B, H, T, dh)
  // plain: softmax over masked q k^T / sqrt(dh)
  const at::Tensor future = at::ones({T, T}, at::kBool).triu(1);
  const at::Tensor scores = at::matmul(q, k.transpose(-2, -1)) / std::sqrt(static_cast<double>(dh));
  const at::Tensor plain = at::matmul(at::softmax(scores.masked_fill(future, -INFINITY), -1), v);
  EXPECT_LE((out - plain).abs().max().item<double>(), 1e-6);
  // the first position sees only itself
  EXPECT_TRUE(at::allclose(out.select(2, 0), v.select(2, 0)));

  const at::Tensor g = at::randn_like(out);
  const auto grads = torch::autograd::grad({out}, {q, k, v}, {g});
  const auto ref = torch::autograd::grad({plain}, {q, k, v}, {g});
  for (size_t i = 0; i < grads.size(); ++i) EXPECT_LE((grads[i] - ref[i]).abs().max().item<double>(), 1e-5) << i;
}
