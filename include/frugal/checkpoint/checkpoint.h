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
// The region must compute the same thing when re-run: it is called twice per training step (use
// options to keep matrix-product outputs instead of recomputing them, see selective.h).
#pragma once

#include <ATen/ATen.h>
#include <torch/arg.h>

#include <functional>
#include <vector>

namespace frugal {
namespace checkpoint {

struct CheckpointOptions {
  // Keep the outputs of the region's matrix products made through checkpoint::linear and
  // recompute everything else ("selective" checkpointing).
  TORCH_ARG(bool, keep_linear_outputs) = false;
};

using RegionFn = std::function<std::vector<at::Tensor>(const std::vector<at::Tensor>&)>;
using UnaryFn = std::function<at::Tensor(const at::Tensor&)>;

// Runs fn(inputs) as a checkpointed region. `params` are the tensors fn reads besides its inputs
// (usually a module's parameters()); their gradients come out of the region.
std::vector<at::Tensor> checkpoint(RegionFn fn, const std::vector<at::Tensor>& inputs,
                                   const std::vector<at::Tensor>& params,
                                   const CheckpointOptions& options = {});

// One tensor in, one tensor out.
at::Tensor checkpoint(UnaryFn fn, const at::Tensor& input, const std::vector<at::Tensor>& params,
                      const CheckpointOptions& options = {});

// A module with forward(Tensor) -> Tensor (a ModuleHolder such as torch::nn::Linear, or a
// std::shared_ptr to a module). The module is held until backward has run.
template <typename ModulePtr>
at::Tensor checkpoint(ModulePtr module, const at::Tensor& input, const CheckpointOptions& options = {}) {
  std::vector<at::Tensor> params = module->parameters();
  return checkpoint(UnaryFn([module](const at::Tensor& x) mutable { return module->forward(x); }), input,
                    params, options);
}

}  // namespace checkpoint
}  // namespace frugal
