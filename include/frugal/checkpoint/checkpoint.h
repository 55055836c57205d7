// frugal/checkpoint/checkpoint.h — activation checkpointing for any function over tensors.
//
// The region runs once in forward without keeping its intermediates (only its inputs are kept),
// and again inside backward to rebuild them. The region's parameters are inputs of the autograd
// Function, so their gradients leave it like any other input's: they accumulate exactly once per
// backward (weight sharing stays right) and flow even when no input requires grad.
//
//   auto y = frugal::checkpoint::checkpoint(block, x);                       // a torch::nn module
//   auto outs = frugal::checkpoint::checkpoint(
//       [&](const std::vector<at::Tensor>& in) { return std::vector<at::Tensor>{f(in[0], in[1])}; },
//       {a, b}, params);                                                     // any callable
//
// Safe by default: the random-number generators are restored for the recompute (dropout masks
// match), the forward's autocast state is re-entered for it (autocast.h: bf16 products stay bf16
// when backward() runs outside the autocast scope), buffers the region updates in forward (BatchNorm's running statistics) end the step
// with exactly the plain run's values, and the recompute's outputs are checked against the forward's (shape, dtype, device; values too with
// .strict(true)).
//
// The region is called twice per training step: once in forward, once in backward. Non-tensor
// arguments are captured by the callable. Use options to keep matrix-product outputs instead of
// recomputing them (selective.h).
#pragma once

#include <ATen/ATen.h>
#include <torch/arg.h>

#include <functional>
#include <string>
#include <vector>

namespace frugal {
namespace checkpoint {

// How checkpoint() runs a region: what to keep, what to restore, and what to check.
struct CheckpointOptions {
  // Keep the outputs of the region's matrix products made through checkpoint::linear and
  // recompute everything else ("selective" checkpointing).
  TORCH_ARG(bool, keep_linear_outputs) = false;
  // Restore the CPU generator (and the CUDA generators of the devices the region's tensors are on)
  // to their forward-time state for the recompute, then put them back.
  TORCH_ARG(bool, preserve_rng_state) = true;
  // Buffers the region may update in forward (BatchNorm running_mean, running_var,
  // num_batches_tracked): the recompute starts from their forward-time values and its updates are
  // undone, so the step updates them once. The module overload fills this in.
  TORCH_ARG(std::vector<at::Tensor>, buffers) = {};
  // The region ends with a block whose last product is checkpoint::tail_linear (selective.h) and
  // whose output is the region's output, as in run_chain and run_plan: the recompute builds that
  // product's backward without multiplying. Off under strict (the values are compared).
  TORCH_ARG(bool, skip_final_tail) = false;
  // Also compare the recompute's output values with the forward's (a checksum per output).
  TORCH_ARG(bool, strict) = false;
  // Relative tolerance of the strict comparison.
  TORCH_ARG(double, strict_rtol) = 1e-5;
  // Named in error messages.
  TORCH_ARG(std::string, name) = "checkpoint region";
};

using RegionFn = std::function<std::vector<at::Tensor>(const std::vector<at::Tensor>&)>;
using UnaryFn = std::function<at::Tensor(const at::Tensor&)>;

// Runs fn(inputs) as a checkpointed region. `params` are the tensors fn reads besides its inputs
// (usually a module's parameters()); their gradients come out of the region.
std::vector<at::Tensor> checkpoint(RegionFn fn, const std::vector<at::Tensor>& inputs, const std::vector<at::Tensor>& params,
                                   const CheckpointOptions& options = {});

// While one is alive (process-wide), checkpointed regions keep what they need for another
// backward through the same graph: use around a backward(retain_graph=true) that will be repeated,
// as two-pass gradient clipping does. Without it, a selective region releases its kept Linear
// outputs after its first backward.
class KeepForAnotherBackward {
 public:
  KeepForAnotherBackward();
  ~KeepForAnotherBackward();
  KeepForAnotherBackward(const KeepForAnotherBackward&) = delete;
  KeepForAnotherBackward& operator=(const KeepForAnotherBackward&) = delete;
};

// One tensor in, one tensor out.
at::Tensor checkpoint(UnaryFn fn, const at::Tensor& input, const std::vector<at::Tensor>& params, const CheckpointOptions& options = {});

// A module with forward(Tensor) -> Tensor (a ModuleHolder such as torch::nn::Linear, or a
// std::shared_ptr to a module). The module is held until backward has run.
template <typename ModulePtr>
at::Tensor checkpoint(ModulePtr module, const at::Tensor& input, CheckpointOptions options = {}) {
  std::vector<at::Tensor> params = module->parameters();
  if (options.buffers().empty()) options.buffers(module->buffers());
  return checkpoint(UnaryFn([module](const at::Tensor& x) mutable { return module->forward(x); }), input, params, options);
}

}  // namespace checkpoint
}  // namespace frugal
