// causal_attention against the textbook computation: outputs and gradients, and causality; the
// sdpa kernel against the explicit one (fp32 and bf16, grouped-query heads), or its refusal on
// LibTorch 1.13.
#include <gtest/gtest.h>

#include <ATen/ATen.h>
#include <torch/csrc/autograd/autograd.h>
#include <torch/version.h>

#include <cmath>

#include "frugal/models/attention.h"
#include "../support/common.h"

using frugal::models::AttentionKernel;

namespace {

using frugal::testing::max_diff;

// softmax over masked q k^T / sqrt(dh), then v: the plain computation, in q's dtype
at::Tensor plain_attention(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v) {
  const int64_t T = q.size(2);
  const at::Tensor future = at::ones({T, T}, at::kBool).triu(1);
  const at::Tensor scores = at::matmul(q, k.transpose(-2, -1)) / std::sqrt(static_cast<double>(q.size(3)));
  return at::matmul(at::softmax(scores.masked_fill(future, -INFINITY), -1), v);
}

// (B, KV, T, dh) -> (B, KV * rep, T, dh), as the Llama decoder repeats grouped-query heads
at::Tensor repeat_heads(const at::Tensor& x, int64_t rep) {
  const auto s = x.sizes();
  return x.unsqueeze(2).expand({s[0], s[1], rep, s[2], s[3]}).reshape({s[0], s[1] * rep, s[2], s[3]});
}

struct AttentionRun {
  at::Tensor out;
  std::vector<at::Tensor> grads;  // of q, k, v (k and v before the heads are repeated)
  at::Tensor values;              // v with its heads repeated: (B, H, T, dh)
};

// Attention over q (B, H, T, dh) and grouped k, v (B, KV, T, dh) in dtype, with the gradients of a
// fixed upstream gradient; the same inputs (from seed) for every kernel.
AttentionRun run_attention(AttentionKernel kernel, at::ScalarType dtype, bool plain = false) {
  at::manual_seed(7);
  const int64_t B = 2, H = 6, KV = 2, T = 33, dh = 16;
  const at::Tensor q = at::randn({B, H, T, dh}).to(dtype).requires_grad_(true);
  const at::Tensor k = at::randn({B, KV, T, dh}).to(dtype).requires_grad_(true);
  const at::Tensor v = at::randn({B, KV, T, dh}).to(dtype).requires_grad_(true);
  const at::Tensor g = at::randn({B, H, T, dh}).to(dtype);
  const at::Tensor kr = repeat_heads(k, H / KV), vr = repeat_heads(v, H / KV);
  AttentionRun r;
  r.out = plain ? plain_attention(q, kr, vr) : frugal::models::causal_attention(q, kr, vr, kernel);
  r.grads = torch::autograd::grad({r.out}, {q, k, v}, {g});
  r.values = vr.detach();
  return r;
}

}  // namespace

TEST(Attention, MatchesPlainMaskedSoftmaxAndIsCausal) {
  at::manual_seed(0);
  const int64_t B = 2, H = 3, T = 5, dh = 8;
  const at::Tensor q = at::randn({B, H, T, dh}).requires_grad_(true);
  const at::Tensor k = at::randn({B, H, T, dh}).requires_grad_(true);
  const at::Tensor v = at::randn({B, H, T, dh}).requires_grad_(true);
  const at::Tensor out = frugal::models::causal_attention(q, k, v);  // (B, H, T, dh)
  const at::Tensor plain = plain_attention(q, k, v);
  EXPECT_LE((out - plain).abs().max().item<double>(), 1e-6);
  // the first position sees only itself
  EXPECT_TRUE(at::allclose(out.select(2, 0), v.select(2, 0)));

  const at::Tensor g = at::randn_like(out);
  const auto grads = torch::autograd::grad({out}, {q, k, v}, {g});
  const auto ref = torch::autograd::grad({plain}, {q, k, v}, {g});
  for (size_t i = 0; i < grads.size(); ++i) EXPECT_LE((grads[i] - ref[i]).abs().max().item<double>(), 1e-5) << i;
}

TEST(Attention, KernelNamesRoundTrip) {
  for (AttentionKernel k : frugal::models::kAllAttentionKernels) {
    EXPECT_EQ(frugal::models::parse_attention_kernel(frugal::models::attention_kernel_name(k)), k);
  }
  EXPECT_EQ(frugal::models::parse_attention_kernel("explicit"), AttentionKernel::explicit_softmax);
  EXPECT_FALSE(frugal::models::parse_attention_kernel("flash").has_value());
  EXPECT_EQ(frugal::models::attention_kernel_unavailable(AttentionKernel::explicit_softmax), "");
}

// On LibTorch 1.13 sdpa is refused with the reason; on 2.x it is there.
TEST(Attention, SdpaIsAvailableExactlyFromLibTorch2) {
  const std::string why = frugal::models::attention_kernel_unavailable(AttentionKernel::sdpa);
#if TORCH_VERSION_MAJOR >= 2
  EXPECT_EQ(why, "");
#else
  EXPECT_NE(why.find("needs LibTorch 2.0 or later"), std::string::npos) << why;
  const at::Tensor x = at::randn({1, 1, 4, 8});
  try {
    frugal::models::causal_attention(x, x, x, AttentionKernel::sdpa);
    FAIL() << "sdpa ran on LibTorch 1.13";
  } catch (const c10::Error& e) {
    EXPECT_NE(std::string(e.what()).find("sdpa needs LibTorch 2.0 or later"), std::string::npos) << e.what();
  }
#endif
}

// fp32, grouped-query heads (6 query heads over 2 kv heads), causal: the fused kernel's output and
// gradients (through the repeat, so the kv heads' sums too) equal the explicit kernel's and the
// plain computation's to 1e-5 (fp32 rounding of sums over 33 keys and 16 channels).
TEST(Attention, SdpaMatchesExplicitInFloat32WithGroupedQueryHeads) {
  const std::string why = frugal::models::attention_kernel_unavailable(AttentionKernel::sdpa);
  if (!why.empty()) GTEST_SKIP() << "sdpa " << why;
  const AttentionRun sdpa = run_attention(AttentionKernel::sdpa, at::kFloat);
  const AttentionRun explicit_run = run_attention(AttentionKernel::explicit_softmax, at::kFloat);
  const AttentionRun plain = run_attention(AttentionKernel::explicit_softmax, at::kFloat, /*plain=*/true);
  EXPECT_LE(max_diff(sdpa.out, explicit_run.out), 1e-5);
  EXPECT_LE(max_diff(sdpa.out, plain.out), 1e-5);
  for (size_t i = 0; i < 3; ++i) {
    EXPECT_LE(max_diff(sdpa.grads[i], explicit_run.grads[i]), 1e-5) << "gradient " << i;
    EXPECT_LE(max_diff(sdpa.grads[i], plain.grads[i]), 1e-5) << "gradient " << i;
  }
  // causal: the first query sees only the first key, so its output is that key's value
  EXPECT_LE(max_diff(sdpa.out.select(2, 0), sdpa.values.select(2, 0)), 1e-6);
}

// bf16: both kernels against the plain computation in fp32 on the same (bf16-rounded) inputs. Each
// is within 2e-2 of it (outputs near 1, bf16 keeps 8 bits: 4e-3 relative per rounding), and the
// fused kernel, which accumulates in fp32, is no further from it than twice the explicit one's
// error plus one bf16 step.
TEST(Attention, SdpaMatchesExplicitInBFloat16) {
  const std::string why = frugal::models::attention_kernel_unavailable(AttentionKernel::sdpa);
  if (!why.empty()) GTEST_SKIP() << "sdpa " << why;
  const AttentionRun sdpa = run_attention(AttentionKernel::sdpa, at::kBFloat16);
  const AttentionRun explicit_run = run_attention(AttentionKernel::explicit_softmax, at::kBFloat16);
  // the reference: the same bf16 values, computed in fp32
  at::manual_seed(7);
  const int64_t B = 2, H = 6, KV = 2, T = 33, dh = 16;
  const at::Tensor q = at::randn({B, H, T, dh}).to(at::kBFloat16).to(at::kFloat).requires_grad_(true);
  const at::Tensor k = at::randn({B, KV, T, dh}).to(at::kBFloat16).to(at::kFloat).requires_grad_(true);
  const at::Tensor v = at::randn({B, KV, T, dh}).to(at::kBFloat16).to(at::kFloat).requires_grad_(true);
  const at::Tensor g = at::randn({B, H, T, dh}).to(at::kBFloat16).to(at::kFloat);
  const at::Tensor ref = plain_attention(q, repeat_heads(k, H / KV), repeat_heads(v, H / KV));
  const auto ref_grads = torch::autograd::grad({ref}, {q, k, v}, {g});
  EXPECT_EQ(sdpa.out.scalar_type(), at::kBFloat16);
  const double step = 1.0 / 128;  // one bf16 step at magnitude 1..2
  const double e_sdpa = max_diff(sdpa.out, ref), e_expl = max_diff(explicit_run.out, ref);
  EXPECT_LE(e_sdpa, 2e-2);
  EXPECT_LE(e_expl, 2e-2);
  EXPECT_LE(e_sdpa, 2 * e_expl + step);
  for (size_t i = 0; i < 3; ++i) {
    const double scale = ref_grads[i].abs().max().item<double>();
    EXPECT_EQ(sdpa.grads[i].scalar_type(), at::kBFloat16);
    EXPECT_LE(max_diff(sdpa.grads[i], ref_grads[i]), 3e-2 * scale) << "gradient " << i;
    EXPECT_LE(max_diff(explicit_run.grads[i], ref_grads[i]), 3e-2 * scale) << "gradient " << i;
  }
}
