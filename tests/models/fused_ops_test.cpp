// The decoder's fused RMSNorm, rotary and SwiGLU kernels (src/models/fused_ops.h) on every path this
// processor runs, in fp32 and bf16, against the plain computation in double: fp32 results within a
// few units in the last place of values of order one, bf16 results within one bf16 rounding of it.
#include <gtest/gtest.h>

#include <ATen/ATen.h>
#include <torch/csrc/autograd/autograd.h>

#include <limits>
#include <vector>

#include "models/fused_ops.h"

namespace frugal {
namespace {

using models::fused::Path;

std::vector<Path> paths() {
  std::vector<Path> out;
  for (Path p : {Path::portable, Path::avx2, Path::avx512}) {
    if (models::fused::path_available(p)) out.push_back(p);
  }
  return out;
}

// |got - want| <= tol * (1 + |want|), elementwise; want in double.
void expect_close(const at::Tensor& got, const at::Tensor& want, double tol, const std::string& what) {
  ASSERT_EQ(got.sizes(), want.sizes()) << what;
  const at::Tensor err = (got.to(at::kDouble) - want).abs() / (want.abs() + 1);
  EXPECT_LE(err.max().item<double>(), tol) << what;
}

// fp32: a few roundings of order-one values; bf16: one rounding (2^-8 relative) of the exact result
// plus the inputs' own (they are bf16 already, so exact) and fp32 arithmetic.
double tol_for(at::ScalarType t) { return t == at::kFloat ? 4e-6 : 1.0 / 256 + 1e-5; }

TEST(FusedOps, RMSNormMatchesThePlainComputationOnEveryPath) {
  for (Path p : paths()) {
    for (at::ScalarType xt : {at::kFloat, at::kBFloat16}) {
      for (at::ScalarType yt : {at::kFloat, at::kBFloat16}) {
        for (int64_t d : {1, 37, 320}) {
          const std::string what =
              std::string(models::fused::path_name(p)) + " x " + c10::toString(xt) + " y " + c10::toString(yt) + " d " + std::to_string(d);
          at::manual_seed(d);
          const at::Tensor x = at::randn({3, 5, d}).to(xt), w = at::rand({d}).add_(0.5).to(xt), g = at::randn({3, 5, d}).to(yt);
          const double eps = 1e-5;
          const auto [y, r] = models::fused::rms_norm_forward(x, w, eps, yt, p);
          EXPECT_EQ(y.scalar_type(), yt) << what;
          EXPECT_EQ(r.sizes(), (std::vector<int64_t>{3, 5, 1})) << what;
          // the reference, with autograd in double
          const at::Tensor xd = x.to(at::kDouble).requires_grad_(), wd = w.to(at::kDouble).requires_grad_();
          const at::Tensor rd = (xd.pow(2).mean(-1, true) + eps).rsqrt();
          const at::Tensor yd = xd * rd * wd;
          expect_close(r, rd.detach(), 4e-6, what + ": r");
          expect_close(y, yd.detach(), tol_for(yt), what + ": y");
          const auto grads = torch::autograd::grad({yd}, {xd, wd}, {g.to(at::kDouble)});
          const auto [gx, gw] = models::fused::rms_norm_backward(x, w, r, g, true, true, p);
          EXPECT_EQ(gx.scalar_type(), xt) << what;
          EXPECT_EQ(gw.scalar_type(), xt) << what;
          // gx is small where its two terms cancel: its error is relative to the terms' scale
          expect_close(gx, grads[0], xt == at::kFloat ? 2e-5 : 1.0 / 128, what + ": gx");
          // gw sums 15 rows (fp32 partial sums; bf16: one rounding of the sum)
          expect_close(gw, grads[1], xt == at::kFloat ? 2e-5 : 1.0 / 128, what + ": gw");
          // each gradient alone is the same as both together
          const auto only_x = models::fused::rms_norm_backward(x, w, r, g, true, false, p);
          const auto only_w = models::fused::rms_norm_backward(x, w, r, g, false, true, p);
          EXPECT_TRUE(at::equal(only_x.first, gx) && !only_x.second.defined()) << what;
          EXPECT_TRUE(!only_w.first.defined() && at::allclose(only_w.second.to(at::kFloat), gw.to(at::kFloat), 1e-6, 1e-6)) << what;
        }
      }
    }
  }
}

TEST(FusedOps, RotaryMatchesThePlainComputationWithStridedGradientsAndPerTokenTables) {
  const int64_t B = 2, T = 7, H = 3, hd = 40, h = hd / 2;
  for (Path p : paths()) {
    for (at::ScalarType xt : {at::kFloat, at::kBFloat16}) {
      for (bool per_batch : {false, true}) {
        const std::string what = std::string(models::fused::path_name(p)) + " " + c10::toString(xt) + (per_batch ? " per batch" : "");
        at::manual_seed(3);
        const at::Tensor x = at::randn({B, T, H, hd}).to(xt);
        const at::Tensor angles = per_batch ? at::rand({B, T, hd}) * 6 : at::rand({T, hd}) * 6;
        const at::Tensor cos = angles.cos(), sin = angles.sin();
        // the reference in double: x cos + rotate_half(x) sin, tables broadcast over heads
        auto plain = [&](const at::Tensor& v) {
          const at::Tensor vd = v.to(at::kDouble);
          const at::Tensor c = cos.to(at::kDouble).unsqueeze(-2), s = sin.to(at::kDouble).unsqueeze(-2);
          const at::Tensor rot = at::cat({-vd.narrow(-1, h, h), vd.narrow(-1, 0, h)}, -1);
          return vd * c + rot * s;
        };
        const at::Tensor y = models::fused::rotary_forward(x, cos, sin, p);
        EXPECT_TRUE(y.is_contiguous() && y.scalar_type() == xt) << what;
        expect_close(y, plain(x), tol_for(xt), what + ": forward");
        // the gradient arrives as the transpose of a (B, H, T, hd) tensor
        const at::Tensor g = at::randn({B, H, T, hd}).to(xt).transpose(1, 2);
        ASSERT_FALSE(g.is_contiguous());
        const at::Tensor xd = x.to(at::kDouble).requires_grad_();
        const at::Tensor want = torch::autograd::grad({plain(xd)}, {xd}, {g.to(at::kDouble)})[0];
        expect_close(models::fused::rotary_backward(g, cos, sin, p), want, tol_for(xt), what + ": backward");
      }
    }
  }
}

TEST(FusedOps, SwiGLUMatchesThePlainComputationIncludingTheTails) {
  for (Path p : paths()) {
    for (at::ScalarType t : {at::kFloat, at::kBFloat16}) {
      const std::string what = std::string(models::fused::path_name(p)) + " " + c10::toString(t);
      at::manual_seed(5);
      // values across silu's range: large negative (exp underflows), around zero, large positive
      at::Tensor gate = at::cat({at::randn({4, 77}) * 4, at::linspace(-100, 100, 77).unsqueeze(0)}).to(t);
      const at::Tensor up = at::randn(gate.sizes()).to(t), g = at::randn(gate.sizes()).to(t);
      const at::Tensor gd = gate.to(at::kDouble).requires_grad_(), ud = up.to(at::kDouble).requires_grad_();
      const at::Tensor zd = gd * at::sigmoid(gd) * ud;
      const at::Tensor z = models::fused::swiglu_forward(gate, up, p);
      EXPECT_EQ(z.scalar_type(), t) << what;
      // fp32: the exponential's polynomial and the division add a few roundings
      const double tol = t == at::kFloat ? 1e-5 : tol_for(t);
      expect_close(z, zd.detach(), tol, what + ": forward");
      const auto want = torch::autograd::grad({zd}, {gd, ud}, {g.to(at::kDouble)});
      const auto [dgate, dup] = models::fused::swiglu_backward(gate, up, g, true, true, p);
      expect_close(dgate, want[0], tol, what + ": d gate");
      expect_close(dup, want[1], tol, what + ": d up");
      const auto only_up = models::fused::swiglu_backward(gate, up, g, false, true, p);
      EXPECT_TRUE(!only_up.first.defined() && at::equal(only_up.second, dup)) << what;
    }
  }
}

TEST(FusedOps, SwiGLUKeepsSiluOfInfinitiesAndNaN) {
  const float inf = std::numeric_limits<float>::infinity(), nan = std::numeric_limits<float>::quiet_NaN();
  const at::Tensor gate = at::tensor({inf, -inf, nan, -90.0f, 90.0f, 0.0f});
  const at::Tensor up = at::ones({6});
  const at::Tensor want = at::silu(gate);  // inf, nan (-inf / inf), nan, -0, 90, 0
  for (Path p : paths()) {
    const at::Tensor z = models::fused::swiglu_forward(gate, up, p);
    EXPECT_TRUE(at::allclose(z, want, 1e-6, 0, /*equal_nan=*/true)) << models::fused::path_name(p) << ": " << z << " vs " << want;
  }
}

TEST(FusedOps, Bf16OutputRoundsToNearestEvenLikeATen) {
  // values halfway between two bf16 numbers, and a NaN: the cast's rounding, not truncation
  at::manual_seed(7);
  const at::Tensor x = at::randn({64, 96});
  const at::Tensor w = at::ones({96});
  for (Path p : paths()) {
    const auto fp32 = models::fused::rms_norm_forward(x, w, 1e-6, at::kFloat, p);
    const auto bf16 = models::fused::rms_norm_forward(x, w, 1e-6, at::kBFloat16, p);
    EXPECT_TRUE(at::equal(bf16.first, fp32.first.to(at::kBFloat16))) << models::fused::path_name(p);
  }
}

}  // namespace
}  // namespace frugal
