#include "frugal/models/attention.h"

#include <ATen/ATen.h>
#include <torch/version.h>

#include <cmath>
#include <limits>

namespace frugal {
namespace models {
namespace {

// scores: (B, H, T, S); the in-place scale and mask keep nothing extra for backward. The T queries
// are the last T of the S keys' positions: query i sees keys 0..S-T+i.
at::Tensor explicit_attention(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v) {
  const int64_t T = q.size(2), S = k.size(2);
  const double scale = 1.0 / std::sqrt(static_cast<double>(q.size(3)));
  at::Tensor scores = at::matmul(q, k.transpose(-2, -1));
  scores.mul_(scale);
  const at::Tensor mask =
      at::full({T, S}, -std::numeric_limits<float>::infinity(), scores.options()).triu_(S - T + 1);
  scores.add_(mask);
  const at::Tensor probs = at::softmax(scores, -1);  // kept: (B, H, T, S)
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
  TORCH_CHECK(k.size(2) >= q.size(2) && v.size(2) == k.size(2), "causal_attention: ", q.size(2), " queries need as many keys or more, got ",
              k.size(2), " keys and ", v.size(2), " values");
  if (kernel == AttentionKernel::explicit_softmax) return explicit_attention(q, k, v);
#if TORCH_VERSION_MAJOR >= 2
  const int64_t T = q.size(2), S = k.size(2);
  if (S != T) {
    // Queries after cached keys: is_causal would align the mask top-left, so a single query
    // (decoding) takes no mask at all and several take an explicit boolean one (true: may attend).
    if (T == 1) return at::scaled_dot_product_attention(q, k, v);
    const at::Tensor allowed = at::ones({T, S}, q.options().dtype(at::kBool)).tril_(S - T);
    return at::scaled_dot_product_attention(q, k, v, allowed);
  }
  // No dropout (the models have none) and no mask tensor: is_causal lets the fused kernels skip
  // the future keys. Its output is laid out as (B, T, H, dh), so merging the heads is a view.
  return at::scaled_dot_product_attention(q, k, v, /*attn_mask=*/{}, /*dropout_p=*/0.0, /*is_causal=*/true);
#else
  TORCH_CHECK(false, "causal_attention: sdpa ", attention_kernel_unavailable(kernel));
#endif
}

}  // namespace models
}  // namespace frugal
