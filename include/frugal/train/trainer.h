// frugal/train/trainer.h — the training job behind `frugal train`, as named stages.
//
// run_training reads top to bottom: set up the data (trains the tokenizer and tokenizes the corpus
// when their files are missing), track memory, build the model (or load init_from) and optimizer,
// apply the recipe's memory techniques, resume exactly, then per step train, report, evaluate and
// checkpoint (run_state.h), and finish (peak memory per category against the estimate, a sample).
// The library prints nothing: messages go to `log`, and every step's progress to
// TrainOptions::on_progress (the CLI draws a bar or plain lines from it). Metrics are appended to
// out_dir/metrics.jsonl.
//
//   auto recipe = frugal::train::load_recipe("recipes/tiny.yaml");
//   auto show = [](const frugal::train::StepProgress& p) { std::printf("step %lld loss %.3f\n", (long long)p.step, p.loss); };
//   auto result = frugal::train::run_training(recipe, frugal::train::TrainOptions().resume(true).on_progress(show), log);
#pragma once

#include <torch/arg.h>

#include <functional>
#include <string>
#include <vector>

#include "frugal/data/tokenizer.h"
#include "frugal/dist/group.h"
#include "frugal/memory/process.h"
#include "frugal/memory/tracker.h"
#include "frugal/train/estimate.h"
#include "frugal/train/recipe.h"

namespace frugal {
namespace train {

// Where the run stands after a step, for a progress display.
struct StepProgress {
  int64_t step = 0;                  // steps done (the step just run, counted from 1)
  int64_t total_steps = 0;           // train.steps (train.epochs resolved)
  double loss = 0;                   // of the step just run
  double lr = 0;                     // the learning rate now (the next step's)
  double tokens_per_s = 0;           // since this run started (or resumed); with examples, tokens that are not padding
  double interval_tokens_per_s = 0;  // since the previous step at the log interval
  int64_t live_bytes = 0;            // tracked memory now
  int64_t peak_bytes = 0;            // the tracker's peak so far
  double eta_s = 0;                  // to total_steps, at tokens_per_s
  bool at_log_interval = false;      // step is a multiple of train.log_interval, or the last
};

using LogFn = std::function<void(const std::string&)>;
using ProgressFn = std::function<void(const StepProgress&)>;

// How run_training runs a recipe: resuming, progress, stopping early, memory tracking and limits, data parallelism.
struct TrainOptions {
  TORCH_ARG(bool, resume) = false;                      // continue from out_dir/latest when it exists
  TORCH_ARG(ProgressFn, on_progress) = nullptr;         // called after every step; null: no progress
  TORCH_ARG(bool, sample) = true;                       // generate from train.sample_prompt at the end
  TORCH_ARG(int64_t, stop_after) = -1;                  // stop (with a checkpoint) once this step is done; -1: train.steps
  TORCH_ARG(bool, keep_events) = false;                 // keep the allocation timeline (exact categories; memory grows with the run)
  TORCH_ARG(int64_t, memory_limit) = 0;                 // bytes; > 0: stop with an explanation once live memory exceeds it
  TORCH_ARG(std::vector<int64_t>, capture_steps) = {};  // with keep_events: full events only for these steps
  // Data parallel: this process is one rank of the group. Each rank trains on its share of every
  // batch (train.batch_size / world size rows), gradients are averaged, optimizer state is sharded
  // (dist/sharded_exchange.h); rank 0 alone writes metrics, evaluates, samples and writes the
  // checkpoint's shared files. The losses are the whole batch's, as one process would compute them.
  TORCH_ARG(std::shared_ptr<dist::Group>, group) = nullptr;
};

// Thrown when the run crossed options.memory_limit or the allocator ran out; what() explains which
// categories held the memory and which techniques would fit.
struct MemoryLimitExceeded : std::runtime_error {
  using std::runtime_error::runtime_error;
};

// Where one step's time went. In in-backward mode the optimizer's updates run inside backward;
// they are counted in optimizer_s (state decode, update and encode, and for host or mapped state
// its transfers and page faults) and left out of backward_s.
struct StepTiming {
  double forward_s = 0;
  double backward_s = 0;   // backward with the recompute of checkpointed blocks
  double optimizer_s = 0;  // every parameter update of the step, wherever it ran
  double state_io_s = 0;   // of optimizer_s: moving state chunks between their place and the device
  // optimizer.update_threads: the updates ran on their own thread beside backward, so optimizer_s
  // overlaps backward_s rather than adding to it; of backward_s, update_wait_s waited for them.
  bool updates_overlapped = false;
  double update_wait_s = 0;
  int64_t major_faults = 0;  // pages the step read from disk (mapped state paged in, among others)
  double total_s = 0;        // the whole step, batch and bookkeeping included
  int64_t tokens = 0;        // the step's tokens (every rank's); with examples, those that are not padding
};

// What an examples run read and how it batches them (empty for text).
struct ExampleReport {
  int64_t train_examples = 0, val_examples = 0;
  int64_t skipped = 0;                 // bad examples skipped (data.bad_examples: skip) when the files were made
  int64_t truncated = 0, dropped = 0;  // training examples over train.seq_len, per epoch
  int64_t steps_per_epoch = 0;
  double padding_share = 0;      // of the training rows' tokens over an epoch
  int64_t label_tokens = 0;      // tokens with loss over the steps run here
  int64_t real_tokens = 0;       // tokens that are not padding over the steps run here
  int64_t processed_tokens = 0;  // the rows' tokens, padding included, over the steps run here (what the model computed)
};

// What a training run did and measured: steps, losses, timings, memory peaks and estimates, outputs.
struct TrainResult {
  int64_t first_step = 0;  // 0, or the step resumed from
  int64_t last_step = 0;
  int64_t total_steps = 0;  // train.steps, or train.epochs x the steps of an epoch
  ExampleReport examples;   // data.format examples only
  // Tokens a second over the steps run here: with examples, the tokens that are not padding.
  std::vector<double> losses;       // of the steps run here
  std::vector<StepTiming> timings;  // of the steps run here
  double val_loss = 0;              // at the end
  double tokens_per_s = 0;
  int64_t n_params = 0;
  int64_t vocab_size = 0;                     // the model's (the tokenizer's when the recipe says 0)
  at::ScalarType compute_dtype = at::kFloat;  // the matrix products' precision (resolve_compute_dtype)
  int64_t recomputed_blocks = 0;              // blocks whose forward backward runs again (policy or budget plan)
  memory::PeakReport peak;                    // over every step run here (memory::peak_over_steps; covers_* say which)
  MemoryEstimate estimate;                    // this recipe
  MemoryEstimate estimate_plain;              // the same job with the techniques off
  std::string sample;                         // generated text
  std::string checkpoint;                     // the last checkpoint written (or resumed from)
  bool already_complete = false;              // resumed at or past the stop step: nothing was run or written
  std::shared_ptr<memory::Tracker> tracker;   // the run's allocation tracker
  // The kernel's count right after the last step (model and state still alive), and the tracker's
  // live bytes at that moment: what the tracker does not see is the difference.
  memory::ProcessMemory process_after_steps;
  int64_t tracked_after_steps = 0;
  // Data parallel: the world size, and every rank's measured peak by category (rank order; this
  // rank's is `peak`), gathered at the end. Empty in one process.
  int64_t world_size = 1;
  std::vector<memory::CategoryBytes> peak_by_rank;
  std::vector<int64_t> peak_bytes_by_rank;
  dist::Traffic traffic;  // this rank's collectives
};

// What prepare_data made or found: the tokenizer and data files, and the vocabulary size.
struct PreparedData {
  std::string tokenizer_path;
  std::string tokens_path;        // the token file, or the training examples file
  std::string val_examples_path;  // examples with data.validation: its examples file ("": held out of tokens_path)
  int64_t vocab_size = 0;
  data::ExampleStats made, val_made;                // examples tokenized by this call (zero when the files were current)
  std::optional<data::ChatTemplate> chat_template;  // examples: the template they were rendered with
};

// Makes the tokenizer and the token file (or the examples files) when missing or made with another
// tokenizer or other example options; `log` gets progress lines.
PreparedData prepare_data(const Recipe& recipe, const LogFn& log);

// Trains as the recipe says. Throws RecipeError (a mistake in the recipe or its files),
// MemoryLimitExceeded, or std::runtime_error; the metrics file is closed on every path.
TrainResult run_training(const Recipe& recipe, const TrainOptions& options, const LogFn& log);

// Matrix-product FLOPs of one of the run's steps: forward, backward (twice the forward) and, with
// recompute, one more forward of every recomputed block: what `frugal train` and `frugal bench
// train` divide by the step time to report achieved GFLOP/s.
double step_matmul_flops(const Recipe& recipe, const TrainResult& result, bool with_recompute = true);

}  // namespace train
}  // namespace frugal
