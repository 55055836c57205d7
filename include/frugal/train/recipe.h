// frugal/train/recipe.h — a training job in one YAML file, every knob a key.
//
// Sections: model, data, train, optimizer, schedule, memory (see recipes/*.yaml). Any key can be
// overridden as section.key=value; an unknown key or a bad value is a RecipeError naming the key
// and what is allowed.
//
//   auto recipe = frugal::train::load_recipe("recipes/tiny.yaml", {"train.steps=20", "optimizer.in_backward=true"});
//   std::string yaml = frugal::train::recipe_to_yaml(recipe);   // what a checkpoint stores
#pragma once

#include <stdexcept>
#include <string>
#include <vector>

#include "frugal/models/decoder.h"

namespace frugal {
namespace train {

struct RecipeError : std::invalid_argument {
  using std::invalid_argument::invalid_argument;
};

struct Recipe {
  std::string name = "recipe";
  models::DecoderConfig model;  // model.vocab_size 0: take it from the tokenizer
  std::string dtype = "fp32";   // fp32 or bf16
  std::string init_from;        // a Hugging Face checkpoint folder to fine-tune from ("" = random init)
  // data
  std::string corpus;           // a text file or folder
  std::string tokenizer;        // a SentencePiece .model; trained on the corpus when missing
  std::string tokens;           // the token file; made from the corpus when missing
  double val_fraction = 0.05;
  // train
  int64_t batch_size = 8;
  int64_t seq_len = 128;
  int64_t steps = 100;
  int64_t seed = 0;
  int64_t log_interval = 10;
  int64_t eval_interval = 50;
  int64_t eval_batches = 4;
  int64_t checkpoint_interval = 50;
  int64_t keep_checkpoints = 2;
  std::string out_dir = "out/run";
  std::string device = "cpu";
  std::string sample_prompt = "";
  int64_t sample_tokens = 48;
  // optimizer
  std::string algorithm = "adamw";  // sgd, adam, adamw
  double lr = 1e-3;
  double weight_decay = 0.1;
  double beta1 = 0.9, beta2 = 0.95, eps = 1e-8, momentum = 0.9;
  bool in_backward = false;
  std::string clip = "none";        // none, global_norm, global_norm_two_pass, per_param_norm
  double max_grad_norm = 1.0;
  std::string state_precision = "fp32";  // fp32, bf16, int8, int4 (Adam(W) moments)
  std::string state_placement = "device";  // device, host (streamed to the device), mmap (paged files)
  std::string state_dir = "/tmp";          // where mmap placement keeps its files
  bool stochastic_rounding = false;        // bf16 parameters
  // schedule
  std::string schedule = "cosine";  // constant, linear_warmup, cosine, linear_decay, step
  int64_t warmup_steps = 10;
  double min_lr_ratio = 0.1;
  // memory
  std::string checkpointing = "none";  // none, full, every_K, selective
  int64_t activation_budget = 0;       // bytes; > 0 plans the checkpointing to fit (overrides checkpointing)
  bool chunked_loss = false;
  int64_t loss_chunk = 1024;
};

// Reads the YAML file, applies key=value overrides, validates. Throws RecipeError.
Recipe load_recipe(const std::string& path, const std::vector<std::string>& overrides = {});
// The same from YAML text (path names the source in messages).
Recipe parse_recipe(const std::string& yaml_text, const std::string& source, const std::vector<std::string>& overrides = {});
std::string recipe_to_yaml(const Recipe& recipe);
// Every key, as "section.key".
std::vector<std::string> recipe_keys();

}  // namespace train
}  // namespace frugal
