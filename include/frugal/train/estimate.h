// frugal/train/estimate.h — a recipe's training memory, predicted without allocating the model.
//
// Per category: parameters, optimizer state, gradients (all of them in standard mode; one backward
// node's worth in in-backward mode), activations kept for backward (per layer, from a count of the
// tensors this implementation saves, under the recipe's checkpointing), inputs, and the
// temporaries alive at the peak (the loss's and the optimizer's). The peak is the larger of the
// start of backward and the optimizer step.
//
//   auto est = frugal::train::estimate_training_memory(recipe, /*vocab_size=*/32000);
//   auto plain = frugal::train::estimate_training_memory(frugal::train::without_techniques(recipe), 32000);
#pragma once

#include <cstdint>
#include <string>

#include "frugal/memory/category.h"
#include "frugal/memory/tracker.h"
#include "frugal/train/recipe.h"

namespace frugal {
namespace train {

struct MemoryEstimate {
  memory::CategoryBytes by_category{};  // at the estimated peak
  int64_t peak_bytes = 0;
  int64_t n_params = 0;
  int64_t activation_per_layer = 0;     // one block's kept bytes without checkpointing
};

MemoryEstimate estimate_training_memory(const Recipe& recipe, int64_t vocab_size);

// The same job with every memory technique off: no checkpointing, plain loss, optimizer after
// backward, fp32 optimizer state on the device.
Recipe without_techniques(const Recipe& recipe);

// What to say when a run crosses a memory limit: what each category held at that moment, and each
// of frugal's techniques not yet on (and all of them together) with the estimated peak it would
// give, marked when it fits under the limit.
std::string explain_memory_limit(const Recipe& recipe, int64_t vocab_size, const memory::Tracker::LimitReport& report,
                                 int64_t limit_bytes);

}  // namespace train
}  // namespace frugal
