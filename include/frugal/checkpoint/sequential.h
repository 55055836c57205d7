// frugal/checkpoint/sequential.h — checkpoint a torch::nn::Sequential in segments.
//
// PyTorch's semantics: the modules are split into `segments` runs of len/segments modules (the
// last run takes the remainder); every run but the last is one checkpointed region, the last runs
// normally since its activations are needed at once by backward.
//
//   torch::nn::Sequential net(torch::nn::Linear(64, 64), torch::nn::ReLU(), torch::nn::Linear(64, 8));
//   at::Tensor y = frugal::checkpoint::checkpoint_sequential(net, /*segments=*/2, x);
#pragma once

#include <torch/nn/modules/container/sequential.h>

#include "frugal/checkpoint/checkpoint.h"

namespace frugal {
namespace checkpoint {

// Each module takes and returns one tensor. Throws when segments is not in [1, size].
// options apply to every region (name and buffers are filled in per segment).
at::Tensor checkpoint_sequential(torch::nn::Sequential sequential, int64_t segments, const at::Tensor& input,
                                 const CheckpointOptions& options = {});

}  // namespace checkpoint
}  // namespace frugal
