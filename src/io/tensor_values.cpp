#include "frugal/io/tensor_values.h"

#include <algorithm>
#include <cmath>
#include <cstdint>

namespace frugal {
namespace io {
namespace {

// Elements per piece: a 1 MiB bool temporary at most.
constexpr int64_t kPiece = int64_t{1} << 20;

template <typename Test>
bool any_piece(const at::Tensor& t, Test test) {
  if (t.numel() == 0) return false;
  at::NoGradGuard no_grad;
  const at::Tensor flat = t.detach().reshape({-1});
  for (int64_t b = 0; b < flat.numel(); b += kPiece) {
    if (test(flat.narrow(0, b, std::min(kPiece, flat.numel() - b)))) return true;
  }
  return false;
}

}  // namespace

bool all_finite(const at::Tensor& t) {
  if (at::isComplexType(t.scalar_type())) {
    return !any_piece(t, [](const at::Tensor& piece) { return !at::isfinite(piece).all().item<bool>(); });
  }
  if (!at::isFloatingType(t.scalar_type())) return true;
  // The smallest and largest value, NaN when any is (min and max propagate it): finite when both
  // are. Reductions hold no per-element temporary, where isfinite() makes four (|x|, and three
  // bool tensors: 7 bytes an fp32 element).
  return !any_piece(t, [](const at::Tensor& piece) {
    // (LibTorch 1.13 has no fp16 aminmax on the CPU: fp16 goes through a 4 MiB fp32 copy.)
    const auto [lo, hi] = at::aminmax(piece.scalar_type() == at::kHalf ? piece.to(at::kFloat) : piece);
    return !std::isfinite(lo.item<double>()) || !std::isfinite(hi.item<double>());
  });
}

bool any_negative(const at::Tensor& t) {
  if (t.numel() == 0 || t.scalar_type() == at::kBool || at::isComplexType(t.scalar_type())) return false;
  // A NaN minimum is not below zero, as NaN < 0 is false element by element.
  return any_piece(t, [](const at::Tensor& piece) { return piece.min().item<double>() < 0; });
}

}  // namespace io
}  // namespace frugal
