// frugal/checkpoint/policy.h — which blocks of a chain to checkpoint, and running a chain that way.
//
// A chain is a list of blocks applied one after the other (a Transformer's layers). A policy says
// which of them run as checkpointed regions: none, full (all), every_k (blocks 0, k, 2k, ...), or
// selective (all, keeping their Linear outputs).
//
//   auto policy = frugal::checkpoint::CheckpointPolicy::parse("every_2");
//   auto chain = frugal::checkpoint::make_chain(blocks);          // std::vector of module holders
//   at::Tensor y = frugal::checkpoint::run_chain(chain, x, policy);
#pragma once

#include <ATen/ATen.h>

#include <functional>
#include <string>
#include <vector>

#include "frugal/checkpoint/checkpoint.h"

namespace frugal {
namespace checkpoint {

enum class PolicyKind { none, full, every_k, selective };

// Which blocks of a chain run as checkpointed regions (see the kinds above).
struct CheckpointPolicy {
  PolicyKind kind = PolicyKind::none;
  int64_t k = 1;  // for every_k

  // No block checkpointed.
  static CheckpointPolicy none() { return {PolicyKind::none, 1}; }
  // Every block checkpointed.
  static CheckpointPolicy full() { return {PolicyKind::full, 1}; }
  static CheckpointPolicy every(int64_t k);  // blocks 0, k, 2k, ...; throws std::invalid_argument when k < 1
  // Every block checkpointed, keeping its Linear outputs.
  static CheckpointPolicy selective() { return {PolicyKind::selective, 1}; }
  // "none", "full", "every_K" (1 <= K < 2^31), "selective"; throws std::invalid_argument naming the text.
  static CheckpointPolicy parse(const std::string& text);
  // What parse() accepts, for messages: "none, full, every_K (K from 1 to 2147483647), selective".
  static const char* allowed_names();

  std::string name() const;                     // the text parse() accepts
  bool checkpoints(int64_t block_index) const;  // whether block `block_index` (from 0) runs checkpointed
  CheckpointOptions options() const;            // for one block; run_chain adds the name and buffers
};

// One block of a chain: its forward and the tensors it reads and updates.
struct ChainBlock {
  UnaryFn forward;                  // x: (B, T, d) -> (B, T, d) for a Transformer layer
  std::vector<at::Tensor> params;   // what forward reads besides x
  std::vector<at::Tensor> buffers;  // what forward may update (BatchNorm statistics)
};

// Applies the blocks in order, checkpointing those the policy names.
at::Tensor run_chain(const std::vector<ChainBlock>& chain, at::Tensor x, const CheckpointPolicy& policy);

// A chain from module holders (or shared_ptrs) with forward(Tensor) -> Tensor.
template <typename ModulePtr>
std::vector<ChainBlock> make_chain(const std::vector<ModulePtr>& blocks) {
  std::vector<ChainBlock> chain;
  chain.reserve(blocks.size());
  for (const ModulePtr& b : blocks) {
    chain.push_back({[b = ModulePtr(b)](const at::Tensor& x) mutable { return b->forward(x); }, b->parameters(), b->buffers()});
  }
  return chain;
}

}  // namespace checkpoint
}  // namespace frugal
