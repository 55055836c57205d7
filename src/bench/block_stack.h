// The model the benchmarks measure: `layers` pre-LN transformer blocks run as a checkpoint chain.
// One definition for `frugal account` (memory_account.cpp) and `frugal bench optim-in-backward`
// (optim_benchmark.cpp), so both measure the same thing.
#pragma once

#include <torch/nn/module.h>

#include <string>
#include <vector>

#include "frugal/checkpoint/policy.h"
#include "frugal/models/transformer_block.h"

namespace frugal {
namespace bench {

// The blocks (registered as block0, block1, ...), their chain, and their parameters in that order.
// Initialised from `seed` on the CPU, each block moved to `device` as it is made.
struct BlockStack : torch::nn::Module {
  std::vector<models::PreLNBlock> blocks;
  std::vector<checkpoint::ChainBlock> chain;
  std::vector<at::Tensor> params;

  BlockStack(int64_t layers, int64_t width, int64_t heads, uint64_t seed, c10::Device device) {
    torch::manual_seed(seed);
    for (int64_t i = 0; i < layers; ++i) {
      blocks.push_back(register_module("block" + std::to_string(i), models::PreLNBlock(width, heads)));
      blocks.back()->to(device);  // one block at a time: never the whole stack twice
    }
    chain = checkpoint::make_chain(blocks);
    params = parameters();
  }
};

}  // namespace bench
}  // namespace frugal
