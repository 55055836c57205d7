// frugal/train/estimate.h — a recipe's training memory, predicted without allocating the model.
//
// Adds up the byte formulas the layers publish next to the code that allocates the bytes
// (optim::state_bytes_for_parameter, models::decoder_activation_bytes, loss's chunk sizes) at each
// candidate moment of a step (the loss's forward and backward, each block's backward, the optimizer
// step) and reports the largest, in the tracker's categories. Throws RecipeError when a size
// passes models::kMaxSizeBytes (2^56 bytes, 64 PiB).
//
//   auto est = frugal::train::estimate_training_memory(recipe, /*vocab_size=*/32000);
//   auto plain = frugal::train::estimate_training_memory(frugal::train::without_techniques(recipe), 32000);
#pragma once

#include <cstdint>
#include <string>

#include "frugal/memory/category.h"
#include "frugal/memory/tracker.h"
#include "frugal/checkpoint/planner.h"
#include "frugal/train/recipe.h"

namespace frugal {
namespace train {

// estimate_training_memory's answer: a training step's predicted peak in bytes, by category, and where it is.
struct MemoryEstimate {
  memory::CategoryBytes by_category{};  // at the estimated peak, in the tracker's categories (category.h)
  int64_t peak_bytes = 0;
  std::string peak_at;  // the moment of the step it is at: "backward of block 7", ...
  int64_t n_params = 0;
  int64_t activation_per_layer = 0;    // one block's kept bytes without checkpointing
  int64_t state_in_files_bytes = 0;    // optimizer state in mapped files (mmap and file placement); file
                                       // placement's is not in optimizer_state, but for one window:
  int64_t state_window_bytes = 0;      // the window's buffers it is read into and written from (file placement)
  int64_t state_off_device_bytes = 0;  // optimizer state in host memory or files while training on a GPU
  // One checkpoint's weights and optimizer state as saved (every rank's share): what a save adds
  // to train.out_dir, less its small files (run_state.h: checkpoint_bytes).
  int64_t checkpoint_tensor_bytes = 0;
  // 8- or 4-bit state asked for, fp32 kept: the tensors (this rank's parts of them) under
  // optim::StateOptions::min_quantized_numel elements, whose block scales would cost more than
  // the codes save (optim::effective_precision), and their elements.
  int64_t state_fp32_fallback_tensors = 0;
  int64_t state_fp32_fallback_params = 0;
};

// One rank of a data-parallel job (dist/): its share of each batch (batch_size / world_size rows),
// the optimizer state of the parameters it owns (dist::assign_owners), and in in-backward mode the
// gradients waiting for their averages (up to optimizer.bytes_in_flight plus the newest).
struct DataParallel {
  int64_t world_size = 1;
  int64_t rank = 0;
};

// With memory.activation_budget the estimate plans on the formula's block costs (equal blocks,
// equal times); `plan` (the segments the trainer chose from measured blocks) replaces that plan.
MemoryEstimate estimate_training_memory(const Recipe& recipe, int64_t vocab_size, const DataParallel& dp = {},
                                        const std::vector<checkpoint::Segment>* plan = nullptr);

// The refusal of a memory.activation_budget no plan meets: the trainer's on its measured blocks and
// the estimate's (a dry run) on the formula's, in one sentence, so a dry run refuses what the run
// would rather than estimate a plan the run cannot make.
RecipeError unmet_activation_budget(int64_t budget, const std::vector<checkpoint::BlockCost>& costs);

// The same job with every memory technique off: no checkpointing, plain loss, optimizer after
// backward, fp32 optimizer state on the device.
Recipe without_techniques(const Recipe& recipe);

// What to say when a run crosses a memory limit: what each category held at that moment, and each
// of frugal's techniques not yet on (and all of them together) with the estimated peak it would
// give, marked when it fits under the limit.
std::string explain_memory_limit(const Recipe& recipe, int64_t vocab_size, const memory::Tracker::LimitReport& report, int64_t limit_bytes);

}  // namespace train
}  // namespace frugal
