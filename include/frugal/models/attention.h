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
// Packed sequences (several examples in one row, told apart by a segments tensor): a "may attend"
// mask (B, 1, T, T) replaces the causal triangle. Build it once per forward, in the form the kernel
// keeps least of (attention_mask_for), and share it with every layer, so no layer keeps its own:
//   explicit: at::where(mask, scores, -inf) in place of the triangle: autograd keeps the
//             probabilities, as without a mask, and where's condition, the shared bool mask
//             (B * T * T bytes once per forward, not per layer).
//   sdpa:     measured with the tracker on LibTorch 2.15's CPU (packing_test): with a mask sdpa does
//             not fall back to the math kernel; the flash kernel runs and keeps no (T, T)
//             probabilities, but it keeps the mask for backward, and converts a bool mask to an
//             additive one in q's dtype on every call: B * T * T * sizeof(q) bytes more per layer
//             (B 2, H 4, T 64, fp32: 32 KiB per call, the probabilities would be 128 KiB). An
//             additive mask already in q's dtype (the compute dtype under autocast, which would
//             cast an fp32 one per call) is kept as it is: one shared tensor, and each layer keeps
//             what the unmasked kernel keeps (q, k, v, output, log-sum-exp). CUDA: not measured.
//
//   at::Tensor q, k, v;                                          // each (B, H, T, dh)
//   at::Tensor att = frugal::models::causal_attention(q, k, v, frugal::models::AttentionKernel::sdpa);
//   at::Tensor merged = att.transpose(1, 2).reshape({B, T, H * dh});
//   at::Tensor mask = frugal::models::attention_mask_for(kernel, frugal::models::segment_attention_mask(segments),
//                                                        q.scalar_type());           // once per forward
//   at::Tensor packed = frugal::models::causal_attention(q, k, v, kernel, mask);    // in every layer
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
// mask (optional): (B or 1, 1, T, S), the whole mask in place of the causal triangle (so it must be
// causal itself): bool, true where query i may attend key j, or additive (0 there, -inf elsewhere)
// in q's dtype. Every query must be allowed at least one key (its own, for packed sequences).
at::Tensor causal_attention(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                            AttentionKernel kernel = AttentionKernel::explicit_softmax, const at::Tensor& mask = {});

// segments: (B, T) integers, each row non-decreasing -> (B, 1, T, T) bool, true where token i may
// attend token j: j <= i and both in the same run of equal values (one packed example).
at::Tensor segment_attention_mask(const at::Tensor& segments);

// The form of a bool "may attend" mask (B, 1, T, S) that `kernel` keeps least of when one tensor is
// shared by every layer of a forward: explicit, the bool mask itself; sdpa, an additive mask (0 or
// -inf) in `dtype`, the dtype q will have (the compute dtype under autocast): sdpa keeps a mask of
// q's dtype as it is and would convert a bool one on every call (see above).
at::Tensor attention_mask_for(AttentionKernel kernel, const at::Tensor& allowed, at::ScalarType dtype);

}  // namespace models
}  // namespace frugal
