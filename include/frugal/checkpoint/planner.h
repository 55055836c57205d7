// frugal/checkpoint/planner.h — choose which blocks of a chain to checkpoint to fit a memory budget.
//
// Measure each block once (the activation bytes it keeps for backward, its output's bytes, its
// forward time), then pick the segmentation of the chain that keeps the predicted activation peak
// within the budget with the least recompute time: an exact dynamic program over the chain.
//
//   auto costs = frugal::checkpoint::measure_chain(chain, x);
//   auto plan = frugal::checkpoint::plan_for_budget(costs, 64 << 20);   // std::nullopt if impossible
//   at::Tensor y = frugal::checkpoint::run_plan(chain, x, *plan);
//
// Cost model. A plain block b keeps kept[b] bytes (its saved tensors and its output). A checkpointed
// segment [i, j) keeps only its output, out[j-1] (its input is the previous segment's output). So the
// activations live at the end of forward are K = sum of those contributions. In backward, when the
// segment [i, j) is recomputed, everything after it has been freed and everything before it is
// still kept: live = prefix(i) + sum(kept[i..j)). The predicted peak is the largest of K and these.
// Recompute time is the forward time of every block in a checkpointed segment but the segment's
// last tail product (a block's closing projection, which the recompute never multiplies again).
#pragma once

#include <ATen/ATen.h>

#include <optional>
#include <string>
#include <vector>

#include "frugal/checkpoint/policy.h"

namespace frugal {
namespace checkpoint {

// What measure_chain found for one block of the chain.
struct BlockCost {
  int64_t kept_bytes = 0;    // activation bytes kept for backward when the block runs plainly
  int64_t output_bytes = 0;  // bytes of its output
  double forward_s = 0;      // forward time with autograd recording
  double tail_s = 0;         // of which its tail_linear product (selective.h): not recomputed when it ends a segment
};

// A run of consecutive blocks, checkpointed as one region or run plainly.
struct Segment {
  int64_t begin = 0, end = 0;  // blocks [begin, end)
  bool checkpointed = false;
};

// A segmentation of the whole chain, with its predicted activation peak and recompute time.
struct ActivationPlan {
  std::vector<Segment> segments;
  int64_t predicted_bytes = 0;  // predicted activation peak over forward and backward
  double recompute_s = 0;       // forward time spent again in backward

  // "0-3 ckpt | 4 | 5 | 6-8 ckpt"
  std::string describe() const;
  int64_t checkpointed_blocks() const;  // the number of blocks in checkpointed segments
};

// The cost model above, for any segmentation.
int64_t predicted_peak_bytes(const std::vector<BlockCost>& costs, const std::vector<Segment>& segments);
double recompute_seconds(const std::vector<BlockCost>& costs, const std::vector<Segment>& segments);
ActivationPlan make_plan(const std::vector<BlockCost>& costs, std::vector<Segment> segments);

// The least recompute time whose predicted peak fits budget_bytes (ties: the smaller peak);
// std::nullopt when no segmentation fits.
std::optional<ActivationPlan> plan_for_budget(const std::vector<BlockCost>& costs, int64_t budget_bytes);
// The smallest predicted peak any segmentation reaches (the least budget plan_for_budget accepts).
int64_t min_achievable_bytes(const std::vector<BlockCost>& costs);
// Chen et al. (2016): segments of about sqrt(n) blocks, each checkpointed.
ActivationPlan sqrt_n_plan(const std::vector<BlockCost>& costs);
ActivationPlan no_checkpoint_plan(const std::vector<BlockCost>& costs);

// Runs the chain once plainly under its own allocation tracker to measure what each block keeps,
// then times each block's forward and its tail product (medians of timing_runs).
std::vector<BlockCost> measure_chain(const std::vector<ChainBlock>& chain, const at::Tensor& x, int timing_runs = 3);

// Applies the chain with the plan's segments checkpointed (options: name and buffers are filled in).
at::Tensor run_plan(const std::vector<ChainBlock>& chain, at::Tensor x, const ActivationPlan& plan, const CheckpointOptions& options = {});

}  // namespace checkpoint
}  // namespace frugal
