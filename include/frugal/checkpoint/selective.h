// frugal/checkpoint/selective.h — matrix products that selective checkpointing can keep.
//
// Models call checkpoint::linear instead of at::linear. Outside a selective region it is at::linear.
// Inside one, the first (no-grad) forward keeps its output; the recompute in backward reuses that
// output instead of multiplying again, while still building the graph for the product's backward.
// So a selective region keeps its input plus its Linear outputs, and recomputes the cheap rest
// (layer norms, attention scores and softmax, activations).
//
//   auto qkv = frugal::checkpoint::linear(h, qkv_proj->weight, qkv_proj->bias);   // h: (B, T, d)
#pragma once

#include <ATen/ATen.h>

namespace frugal {
namespace checkpoint {

// x: (..., in), weight: (out, in), bias: (out) or undefined -> (..., out)
at::Tensor linear(const at::Tensor& x, const at::Tensor& weight, const at::Tensor& bias);

namespace detail {
// The record/replay state of the selective region running on this thread (set by checkpoint()).
struct LinearCache {
  enum class Mode { record, replay };
  Mode mode = Mode::record;
  std::vector<at::Tensor> outputs;
  size_t next = 0;
};
// Makes `cache` current on this thread until destroyed, restoring the previous one (regions nest).
class LinearCacheScope {
 public:
  explicit LinearCacheScope(LinearCache* cache);
  ~LinearCacheScope();
  LinearCacheScope(const LinearCacheScope&) = delete;
  LinearCacheScope& operator=(const LinearCacheScope&) = delete;

 private:
  LinearCache* previous_;
};
// True while a KeepForAnotherBackward is alive.
bool keep_for_another_backward();
}  // namespace detail

}  // namespace checkpoint
}  // namespace frugal
