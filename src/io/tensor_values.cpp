#include "frugal/io/tensor_values.h"

#include <algorithm>
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
  if (!at::isFloatingType(t.scalar_type()) && !at::isComplexType(t.scalar_type())) return true;
  return !any_piece(t, [](const at::Tensor& piece) { return !at::isfinite(piece).all().item<bool>(); });
}

bool any_negative(const at::Tensor& t) {
  return any_piece(t, [](const at::Tensor& piece) { return (piece < 0).any().item<bool>(); });
}

}  // namespace io
}  // namespace frugal
