#include "frugal/models/attention.h"

#include <ATen/ATen.h>
#include <torch/version.h>

#include <cmath>
#include <limits>

namespace frugal {
namespace models {
namespace {

// scores: (B, H, T, S); the in-place scale and mask keep nothing extra for backward. The T queries
// are the last T of the S keys' positions: query i sees keys 0..S-T+i. With a mask (B or 1, 1, T, S)
// given: a bool one selects the scores (where keeps only the mask, its condition, which the caller
// shares across layers: no (B, H, T, S) copy beside the probabilities, and the unmasked scores are
// freed at once, so forward's peak is the in-place path's; masked_fill_ would need the mask
// inverted, a (B, 1, T, S) tensor made and kept by every layer); an additive one is added in place,
// keeping nothing.
at::Tensor explicit_attention(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const at::Tensor& mask) {
  const int64_t T = q.size(2), S = k.size(2);
  const double scale = 1.0 / std::sqrt(static_cast<double>(q.size(3)));
  at::Tensor scores = at::matmul(q, k.transpose(-2, -1));
  scores.mul_(scale);
  if (!mask.defined()) {
    scores.add_(at::full({T, S}, -std::numeric_limits<float>::infinity(), scores.options()).triu_(S - T + 1));
  } else if (mask.scalar_type() == at::kBool) {
    scores = at::where(mask, scores, -std::numeric_limits<double>::infinity());  // the unmasked scores are freed here
  } else {
    scores.add_(mask);
  }
  const at::Tensor probs = at::softmax(scores, -1);  // kept: (B, H, T, S)
  return at::matmul(probs, v);                       // (B, H, T, dh)
}

}  // namespace

const char* attention_kernel_name(AttentionKernel kernel) { return kernel == AttentionKernel::sdpa ? "sdpa" : "explicit"; }

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

at::Tensor causal_attention(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, AttentionKernel kernel, const at::Tensor& mask) {
  TORCH_CHECK(k.size(2) >= q.size(2) && v.size(2) == k.size(2), "causal_attention: ", q.size(2), " queries need as many keys or more, got ",
              k.size(2), " keys and ", v.size(2), " values");
  if (mask.defined()) {
    TORCH_CHECK(mask.dim() == 4 && (mask.size(0) == 1 || mask.size(0) == q.size(0)) && mask.size(1) == 1 && mask.size(2) == q.size(2) &&
                    mask.size(3) == k.size(2),
                "causal_attention: the mask must be (", q.size(0), " or 1, 1, ", q.size(2), ", ", k.size(2), "), got ", mask.sizes());
    TORCH_CHECK(mask.scalar_type() == at::kBool || at::isFloatingType(mask.scalar_type()),
                "causal_attention: the mask must be bool or floating point (additive), got ", mask.scalar_type());
  }
  if (kernel == AttentionKernel::explicit_softmax) return explicit_attention(q, k, v, mask);
#if TORCH_VERSION_MAJOR >= 2
  const int64_t T = q.size(2), S = k.size(2);
  // A mask, bool or additive: the CPU flash kernel takes it (LibTorch 2.15) and keeps it for
  // backward, as given when it is of q's dtype (attention.h).
  if (mask.defined()) return at::scaled_dot_product_attention(q, k, v, mask);
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

at::Tensor segment_attention_mask(const at::Tensor& segments) {
  TORCH_CHECK(segments.dim() == 2 && !at::isFloatingType(segments.scalar_type()) && segments.scalar_type() != at::kBool,
              "segment_attention_mask: segments must be (B, T) integers, got ", segments.sizes(), " ", segments.scalar_type());
  const int64_t T = segments.size(1);
  // runs: (B, T) int64, the index of each token's run of equal values (a value that comes back
  // after another is a new example, so the mask and the positions agree on what an example is)
  at::Tensor starts = at::ones(segments.sizes(), segments.options().dtype(at::kBool));
  if (T > 1) {
    at::Tensor later = starts.narrow(1, 1, T - 1);
    at::ne_out(later, segments.narrow(1, 1, T - 1), segments.narrow(1, 0, T - 1));
  }
  const at::Tensor runs = starts.cumsum(1);
  return runs.unsqueeze(2).eq(runs.unsqueeze(1)).tril_().unsqueeze(1);  // (B, 1, T, T)
}

at::Tensor attention_mask_for(AttentionKernel kernel, const at::Tensor& allowed, at::ScalarType dtype) {
  TORCH_CHECK(allowed.scalar_type() == at::kBool, "attention_mask_for: the mask must be bool, got ", allowed.scalar_type());
  if (kernel == AttentionKernel::explicit_softmax) return allowed;
  return at::zeros(allowed.sizes(), allowed.options().dtype(dtype))
      .masked_fill_(allowed.logical_not(), -std::numeric_limits<double>::infinity());
}

}  // namespace models
}  // namespace frugal
