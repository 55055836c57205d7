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

// The last product of a residual branch: a block ending in `return h + tail_linear(z, w, b)`,
// whose product's output is read by nothing but that sum. Backward of the product needs z and w,
// never its output, so when such a block ends a checkpointed region (run_chain and run_plan say so
// with CheckpointOptions::skip_final_tail), the recompute builds the product's backward without
// multiplying: the region's last product runs once per step, not twice. Everywhere else (and in
// selective regions, which need not keep its output) it is at::linear.
at::Tensor tail_linear(const at::Tensor& z, const at::Tensor& weight, const at::Tensor& bias);

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

// The tail_linear calls of the region running on this thread (set by checkpoint()): the forward
// counts them, the recompute skips the product of call number `skip` (1-based; 0 skips none).
struct TailCalls {
  enum class Mode { count, recompute };
  Mode mode = Mode::count;
  int64_t calls = 0;
  int64_t skip = 0;
};
class TailCallsScope {
 public:
  explicit TailCallsScope(TailCalls* calls);
  ~TailCallsScope();
  TailCallsScope(const TailCallsScope&) = delete;
  TailCallsScope& operator=(const TailCallsScope&) = delete;

 private:
  TailCalls* previous_;
};
// Products tail_linear has not computed in recomputes, process-wide (tests read it).
int64_t tail_products_skipped();
// While one is alive on this thread, the seconds tail_linear spends multiplying add up in
// `seconds` (the planner times a block's tail apart from the rest of its forward).
class TailTimer {
 public:
  explicit TailTimer(double* seconds);
  ~TailTimer();
  TailTimer(const TailTimer&) = delete;
  TailTimer& operator=(const TailTimer&) = delete;

 private:
  double* previous_;
};
}  // namespace detail

}  // namespace checkpoint
}  // namespace frugal
