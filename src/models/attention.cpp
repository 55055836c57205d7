#include "frugal/models/attention.h"

#include <ATen/ATen.h>

#include <cmath>
#include <limits>

namespace frugal {
namespace models {

at::Tensor causal_attention(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v) {
  const int64_t T = q.size(2);
  const double scale = 1.0 / std::sqrt(static_cast<double>(q.size(3)));
  // scores: (B, H, T, T); the in-place scale and mask keep nothing extra for backward
  at::Tensor scores = at::matmul(q, k.transpose(-2, -1));
  scores.mul_(scale);
  const at::Tensor mask =
      at::full({T, T}, -std::numeric_limits<float>::infinity(), scores.options()).triu_(1);
  scores.add_(mask);
  const at::Tensor probs = at::softmax(scores, -1);  // kept: (B, H, T, T)
  return at::matmul(probs, v);                       // (B, H, T, dh)
}

}  // namespace models
}  // namespace frugal
