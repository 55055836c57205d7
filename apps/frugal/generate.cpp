// frugal generate — sample text from a trained checkpoint.
#include <sys/stat.h>

#include <iostream>

#include "args.h"
#include "commands.h"
#include "frugal/models/hf_checkpoint.h"
#include "frugal/train/run_state.h"
#include "frugal/train/trainer.h"

namespace frugal {
namespace cli {

int run_generate(int argc, char** argv) {
  std::string dir, prompt;
  int64_t tokens = 64, top_k = 40, seed = 0;
  double temperature = 0.8;
  Args args("generate", "Sample text from a checkpoint written by frugal train (a run's out_dir, or one step-N folder).");
  args.add_string("checkpoint", &dir, "a run folder (its latest checkpoint is used) or a checkpoint folder", "DIR");
  args.add_string("prompt", &prompt, "text to continue", "TEXT");
  args.add_int("tokens", &tokens, "how many tokens to generate", 1);
  args.add_double("temperature", &temperature, "sampling temperature (0: greedy)", 0.0);
  args.add_int("top-k", &top_k, "sample among the k likeliest tokens (0: all)", 0);
  args.add_int("seed", &seed, "random seed", 0);
  if (!args.parse(argc, argv, 2)) return 0;
  if (dir.empty()) throw UsageError("--checkpoint is required");
  struct stat st {};
  if (::stat(dir.c_str(), &st) != 0 || !S_ISDIR(st.st_mode)) throw UsageError("--checkpoint " + dir + " is not a folder");
  std::string step_dir = dir;
  if (::stat((dir + "/config.json").c_str(), &st) != 0) {
    try {
      step_dir = train::latest_checkpoint(dir);
    } catch (const std::invalid_argument& e) {
      throw UsageError(std::string("--checkpoint: ") + e.what());
    }
    if (step_dir.empty()) throw UsageError("--checkpoint " + dir + " holds no checkpoint (no config.json and no 'latest')");
  }
  models::Decoder model;
  data::Tokenizer tok;
  try {
    model = models::load_hf_checkpoint(step_dir);  // the config's sizes checked against the weights first
    tok = data::Tokenizer::load_folder(step_dir);  // tokenizer.json or tokenizer.model, and tokenizer_config.json
  } catch (const std::invalid_argument& e) {
    throw UsageError(e.what());
  }
  const train::Generation g = train::generate(*model, tok, prompt, tokens, temperature, top_k, static_cast<uint64_t>(seed));
  std::cout << g.text << "\n";
  // On stderr, so the text on stdout stays clean for pipes; an early stop is never silent.
  std::string why = train::generation_stop_name(g.stop);
  if (g.stop == train::GenerationStop::context_full) {
    why += " (max_seq_len " + std::to_string(model->config().max_seq_len) + " tokens, prompt included)";
  }
  std::cerr << "frugal generate: " << g.tokens.size() << " of " << tokens << " tokens; stopped: " << why << "\n";
  return 0;
}

}  // namespace cli
}  // namespace frugal
