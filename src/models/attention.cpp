#include "frugal/models/attention.h"

#include <ATen/ATen.h>
#include <torch/version.h>

#include <cmath>
#include <limits>

namespace frugal {
namespace models {
namespace {

// scores: (B, H, T, T); the in-place scale and mask keep nothing extra for backward
at::Tensor explicit_attention(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v) {
  const int64_t T = q.size(2);
  const double scale = 1.0 / std::sqrt(static_cast<double>(q.size(3)));
  at::Tensor scores = at::matmul(q, k.transpose(-2, -1));
  scores.mul_(scale);
  const at::Tensor mask =
      at::full({T, T}, -std::numeric_limits<float>::infinity(), scores.options()).triu_(1);
  scores.add_(mask);
  const at::Tensor probs = at::softmax(scores, -1);  // kept: (B, H, T, T)
  return at::matmul(probs, v);                       // (B, H, T, dh)
}

}  // namespace

const char* attention_kernel_name(AttentionKernel kernel) {
  return kernel == AttentionKernel::sdpa ? "sdpa" : "explicit";
}

std::optional<AttentionKernel> parse_attention_kernel(const std::string& name) {
  for (AttentionKernel k : kAllAttentionKernels) {
    if (name == attention_kernel_name(k)) return k;
  }
  return std::nullopt;
}

std::string attention_kernel_unavailable(AttentionKernel kernel) {
#if TORCH_VERSION_MAJOR >= 2
  (void)kernel;
  return "";
#else
  if (kernel != AttentionKernel::sdpa) return "";
  return "needs LibTorch 2.0 or later (at::scaled_dot_product_attention); this frugal is built against LibTorch " TORCH_VERSION;
#endif
}

std::vector<AttentionKernel> available_attention_kernels() {
  std::vector<AttentionKernel> out;
  for (AttentionKernel k : kAllAttentionKernels) {
    if (attention_kernel_unavailable(k).empty()) out.push_back(k);
  }
  return out;
}

at::Tensor causal_attention(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, AttentionKernel kernel) {
  if (kernel == AttentionKernel::explicit_softmax) return explicit_attention(q, k, v);
#if TORCH_VERSION_MAJOR >= 2
  // No dropout (the models have none) and no mask tensor: is_causal lets the fused kernels skip
  // the future keys. Its output is laid out as (B, T, H, dh), so merging the heads is a view.
  return at::scaled_dot_product_attention(q, k, v, /*attn_mask=*/{}, /*dropout_p=*/0.0, /*is_causal=*/true);
#else
  TORCH_CHECK(false, "causal_attention: sdpa ", attention_kernel_unavailable(kernel));
#endif
}

}  // namespace models
}  // namespace frugal
