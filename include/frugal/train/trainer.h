// frugal/train/trainer.h — the training loop behind `frugal train`.
//
// Prepares the data (trains the tokenizer and tokenizes the corpus when their files are missing),
// builds the model (or loads init_from), applies the recipe's memory techniques, trains with
// progress output and metrics (out_dir/metrics.jsonl), evaluates, checkpoints (run_state.h),
// resumes exactly, and reports peak memory per category against the estimate.
//
//   auto recipe = frugal::train::load_recipe("recipes/tiny.yaml");
//   auto result = frugal::train::run_training(recipe, frugal::train::TrainOptions().resume(true));
#pragma once

#include <torch/arg.h>

#include <functional>
#include <string>
#include <vector>

#include "frugal/data/tokenizer.h"
#include "frugal/memory/tracker.h"
#include "frugal/train/estimate.h"
#include "frugal/train/recipe.h"

namespace frugal {
namespace train {

struct TrainOptions {
  TORCH_ARG(bool, resume) = false;        // continue from out_dir/latest when it exists
  TORCH_ARG(bool, progress_bar) = false;  // redraw one line (a terminal); else plain lines
  TORCH_ARG(bool, sample) = true;         // generate from train.sample_prompt at the end
  TORCH_ARG(int64_t, stop_after) = -1;    // stop (with a checkpoint) once this step is done; -1: train.steps
  TORCH_ARG(bool, keep_events) = false;   // keep the allocation timeline (exact categories; memory grows with the run)
  TORCH_ARG(int64_t, memory_limit) = 0;   // bytes; > 0: stop with an explanation once live memory exceeds it
  TORCH_ARG(std::vector<int64_t>, capture_steps) = {};  // with keep_events: full events only for these steps
};

// Thrown when the run crossed options.memory_limit or the allocator ran out; what() explains which
// categories held the memory and which techniques would fit.
struct MemoryLimitExceeded : std::runtime_error {
  using std::runtime_error::runtime_error;
};

struct TrainResult {
  int64_t first_step = 0;          // 0, or the step resumed from
  int64_t last_step = 0;
  std::vector<double> losses;      // of the steps run here
  double val_loss = 0;             // at the end
  double tokens_per_s = 0;
  int64_t n_params = 0;
  memory::PeakReport peak;         // over every step run here (memory::peak_over_steps; covers_* say which)
  MemoryEstimate estimate;         // this recipe
  MemoryEstimate estimate_plain;   // the same job with the techniques off
  std::string sample;              // generated text
  std::string checkpoint;          // the last checkpoint written
  std::shared_ptr<memory::Tracker> tracker;  // the run's allocation tracker
};

struct PreparedData {
  std::string tokenizer_path;
  std::string tokens_path;
  int64_t vocab_size = 0;
};

// Makes the tokenizer and the token file when missing; `log` gets progress lines.
PreparedData prepare_data(const Recipe& recipe, const std::function<void(const std::string&)>& log);

TrainResult run_training(const Recipe& recipe, const TrainOptions& options,
                         const std::function<void(const std::string&)>& log);

// Samples n_tokens after the prompt (temperature 0: greedy; top_k 0: the whole vocabulary).
std::string generate_text(models::DecoderImpl& model, const data::Tokenizer& tokenizer, const std::string& prompt,
                          int64_t n_tokens, double temperature, int64_t top_k, uint64_t seed);

}  // namespace train
}  // namespace frugal
