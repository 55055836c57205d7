// io::all_finite and io::any_negative against the element-by-element answer, in every floating
// dtype, with the culprit at the start, the end, and across the 2^20-element pieces they check by.

#include <gtest/gtest.h>

#include <ATen/ATen.h>

#include <limits>

#include "frugal/io/tensor_values.h"

namespace frugal {
namespace {

TEST(TensorValues, AllFiniteFindsNanAndInfinityAnywhere) {
  const int64_t n = (int64_t{1} << 20) * 2 + 5;  // three pieces, the last short
  for (auto dtype : {at::kFloat, at::kDouble, at::kBFloat16, at::kHalf}) {
    SCOPED_TRACE(c10::toString(dtype));
    const at::Tensor base = at::randn({n}).to(dtype);
    EXPECT_TRUE(io::all_finite(base));
    EXPECT_TRUE(io::all_finite(base.narrow(0, 0, 0)));
    for (double bad :
         {std::numeric_limits<double>::quiet_NaN(), std::numeric_limits<double>::infinity(), -std::numeric_limits<double>::infinity()}) {
      for (int64_t at_index : {int64_t{0}, (int64_t{1} << 20) + 3, n - 1}) {
        at::Tensor t = base.clone();
        t[at_index] = bad;
        EXPECT_EQ(io::all_finite(t), at::isfinite(t).all().item<bool>()) << bad << " at " << at_index;
        EXPECT_FALSE(io::all_finite(t)) << bad << " at " << at_index;
        // A view with the culprit outside it is finite.
        if (at_index == 0) {
          EXPECT_TRUE(io::all_finite(t.narrow(0, 1, n - 1)));
        }
      }
    }
  }
  EXPECT_TRUE(io::all_finite(at::arange(10, at::kLong)));
  at::Tensor c = at::zeros({4}, at::kComplexFloat);
  EXPECT_TRUE(io::all_finite(c));
  c[2] = c10::complex<float>(0, std::numeric_limits<float>::infinity());
  EXPECT_FALSE(io::all_finite(c));
}

TEST(TensorValues, AnyNegativeFindsOneNegativeValue) {
  const int64_t n = (int64_t{1} << 20) + 7;
  for (auto dtype : {at::kFloat, at::kBFloat16, at::kInt}) {
    SCOPED_TRACE(c10::toString(dtype));
    const at::Tensor base = at::rand({n}).mul(100).to(dtype);
    EXPECT_FALSE(io::any_negative(base));
    for (int64_t at_index : {int64_t{0}, n - 1}) {
      at::Tensor t = base.clone();
      t[at_index] = -1;
      EXPECT_TRUE(io::any_negative(t)) << at_index;
    }
    at::Tensor z = base.clone();
    z[5] = 0;
    EXPECT_FALSE(io::any_negative(z));  // zero is not negative
  }
}

}  // namespace
}  // namespace frugal
