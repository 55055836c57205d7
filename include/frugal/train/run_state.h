// frugal/train/run_state.h — training checkpoints that survive a kill at any moment.
//
// Each checkpoint is a folder out_dir/step-NNNNNNNN with the model (config.json +
// model.safetensors, Hugging Face layout), the optimizer state (optimizer.safetensors, keyed by
// parameter name), trainer_state.json (step, schedule step, RNG state), the recipe and the
// tokenizer. It is written under a temporary name, every file fsync'ed, then renamed into place;
// only then is out_dir/latest (written atomically) pointed at it. A kill leaves the previous
// checkpoint intact and `latest` pointing at it.
//
//   frugal::train::save_run_state(out_dir, state, model, optimizer, recipe_yaml, tokenizer_path, /*keep=*/2);
//   auto latest = frugal::train::latest_checkpoint(out_dir);    // "" when none
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "frugal/dist/group.h"
#include "frugal/models/decoder.h"
#include "frugal/optim/optimizer.h"

namespace frugal {
namespace train {

// The counters of a run that a checkpoint saves besides the model and the optimizer.
struct RunState {
  int64_t step = 0;           // training steps completed
  int64_t schedule_step = 0;  // LRScheduler::last_step()
  std::string rng_state_hex;  // the CPU generator's state
  double last_loss = 0;
};

// Returns the folder written. With a group of N > 1 ranks every rank calls it: each writes the state
// of the parameters it owns as optimizer.rank-R-of-N.safetensors into rank 0's temporary folder,
// and rank 0 writes the rest, an index of those files (optimizer_index.json) and commits. A
// checkpoint resumes at any world size: each rank loads its own parameters' state from whichever
// file holds it.
std::string save_run_state(const std::string& out_dir, const RunState& state, models::DecoderImpl& model, const optim::Optimizer& optimizer,
                           const std::string& recipe_yaml, const std::string& tokenizer_path, int64_t keep, dist::Group* group = nullptr);

// The bytes one checkpoint takes: `tensor_bytes` (MemoryEstimate::checkpoint_tensor_bytes: the
// weights and the optimizer state) and the small files beside them (config.json, trainer_state.json,
// the recipe, the safetensors headers, the tokenizer), taken as twice tokenizer_path's size and 1 MiB.
int64_t checkpoint_bytes(int64_t tensor_bytes, const std::string& tokenizer_path);

// How much out_dir grows at most while a run saves checkpoints of `bytes` each after the steps
// `saves` (ascending), as save_run_state does it: each written whole before a folder of the same
// step is replaced and all but the newest `keep` are pruned; the step folders already there (their
// files' sizes) are pruned among them and free what they take.
int64_t checkpoint_space_needed(const std::string& out_dir, const std::vector<int64_t>& saves, int64_t bytes, int64_t keep);

// Removes out_dir's checkpoint folders still under their temporary name (".step-N.tmp-PID") whose
// writer is dead, as a kill mid-save leaves them; a live process's are left alone. Returns how many.
int remove_stale_checkpoint_temps(const std::string& out_dir);

// The folder `latest` points at, or "" when there is none. Throws std::invalid_argument when it
// points at a folder that is missing.
std::string latest_checkpoint(const std::string& out_dir);

// Loads the model weights and optimizer state from a checkpoint folder and returns its state. The
// checkpoint is validated whole (trainer_state.json's fields against max_step, the folder's name and
// the generator; an optimizer state for every parameter once step > 0) or refused with
// std::invalid_argument naming the file and the field.
RunState load_run_state(const std::string& checkpoint_dir, models::DecoderImpl& model, optim::Optimizer& optimizer, int64_t max_step);
// trainer_state.json alone, with the checks above.
RunState read_trainer_state(const std::string& checkpoint_dir, int64_t max_step = INT64_MAX);

// The optimizer's state as one safetensors file (keyed as Optimizer::state_dict), written from the
// live state tensor by tensor, and read back one parameter at a time (Optimizer::load_state): at
// most one parameter's saved state is in memory beside the optimizer's. Loading throws
// std::invalid_argument for a malformed file or state that does not fit the optimizer.
void save_optimizer_state(const std::string& path, const optim::Optimizer& optimizer);
// require_state: refuse a file with no state at all (a checkpoint after step 0).
void load_optimizer_state(const std::string& path, optim::Optimizer& optimizer, bool require_state = false);
// A checkpoint folder's optimizer state, from optimizer.safetensors or, when the folder has
// optimizer_index.json, from the per-rank files it lists (a folder name each, nothing else).
void load_checkpoint_optimizer_state(const std::string& checkpoint_dir, optim::Optimizer& optimizer, bool require_state);

std::string rng_state_to_hex();
// Throws std::invalid_argument unless hex is exactly the CPU generator's state (rng_state_bytes()).
void rng_state_from_hex(const std::string& hex);
int64_t rng_state_bytes();

}  // namespace train
}  // namespace frugal
