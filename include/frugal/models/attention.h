// frugal/models/attention.h — causal multi-head attention, shared by the decoders and the pre-LN block.
//
// softmax(q k^T / sqrt(dh) + causal mask) v, in plain ATen operations: autograd keeps the
// (B, H, T, T) probabilities for backward and nothing else (the scale and the mask are in place).
// Callers split heads before and merge them after; grouped-query heads are repeated beforehand.
//
//   at::Tensor q, k, v;                                          // each (B, H, T, dh)
//   at::Tensor att = frugal::models::causal_attention(q, k, v);  // (B, H, T, dh)
//   at::Tensor merged = att.transpose(1, 2).reshape({B, T, H * dh});
#pragma once

#include <ATen/core/Tensor.h>

namespace frugal {
namespace models {

// Causal multi-head attention that keeps the (B, H, T, T) probabilities for backward.
// q, k, v: (B, H, T, dh) -> (B, H, T, dh)
at::Tensor causal_attention(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v);

}  // namespace models
}  // namespace frugal
