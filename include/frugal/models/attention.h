// frugal/models/attention.h — causal multi-head attention, shared by the decoders and the pre-LN block.
//
// Two kernels compute softmax(q k^T / sqrt(dh) + causal mask) v:
//   explicit: plain ATen operations; autograd keeps the (B, H, T, T) probabilities for backward
//             (the scale and the mask are in place, so nothing else).
//   sdpa:     at::scaled_dot_product_attention (LibTorch >= 2.0): on the CPU a flash kernel, on CUDA
//             flash or memory-efficient kernels; autograd keeps q, k, v, the output and one fp32
//             log-sum-exp per query (B, H, T), never a (T, T) matrix.
// Callers split heads before and merge them after; grouped-query heads are repeated beforehand.
//
//   at::Tensor q, k, v;                                          // each (B, H, T, dh)
//   at::Tensor att = frugal::models::causal_attention(q, k, v, frugal::models::AttentionKernel::sdpa);
//   at::Tensor merged = att.transpose(1, 2).reshape({B, T, H * dh});
#pragma once

#include <ATen/core/Tensor.h>

#include <array>
#include <optional>
#include <string>
#include <vector>

namespace frugal {
namespace models {

enum class AttentionKernel { explicit_softmax, sdpa };
constexpr std::array<AttentionKernel, 2> kAllAttentionKernels = {AttentionKernel::explicit_softmax, AttentionKernel::sdpa};
// "explicit" or "sdpa" (the recipe's model.attention), and back.
const char* attention_kernel_name(AttentionKernel kernel);
std::optional<AttentionKernel> parse_attention_kernel(const std::string& name);

// Empty when this build can run the kernel; otherwise why not, to follow the kernel's name
// ("needs LibTorch 2.0 or later ..."): 1.13 has only a private math fallback for sdpa, which keeps
// the probabilities too, so frugal does not offer it there.
std::string attention_kernel_unavailable(AttentionKernel kernel);
// The kernels this build can run, explicit first.
std::vector<AttentionKernel> available_attention_kernels();

// Causal multi-head attention with the given kernel (throws c10::Error when it is unavailable).
// q: (B, H, T, dh), k, v: (B, H, S, dh) with S >= T -> (B, H, T, dh). The queries sit at the last T
// of the S positions (S > T after a KV cache), so query i attends to keys 0..S-T+i.
at::Tensor causal_attention(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                            AttentionKernel kernel = AttentionKernel::explicit_softmax);

}  // namespace models
}  // namespace frugal
