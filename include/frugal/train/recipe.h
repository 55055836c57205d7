// frugal/train/recipe.h — a training job in one YAML file, every knob a key, parsed once into typed options.
//
// Sections: model, data, train, optimizer, schedule, memory (see recipes/*.yaml). Any key can be
// overridden as section.key=value; an unknown key or a bad value is a RecipeError naming the key
// and what is allowed, and a check an override breaks names the override (the allowed values of an enum come from its layer's name table:
// optim::parse_clip, optim::parse_precision, checkpoint::CheckpointPolicy::parse, ...). The recipe
// holds the options the layers take (optim::OptimizerOptions, optim::ScheduleOptions,
// checkpoint::CheckpointPolicy, models::LossOptions, a c10::Device), so nothing downstream
// re-parses text. Every integer key has an upper bound and every size the job computes is
// overflow-checked; aliases that would expand without bound (self-reference, "billion laughs") are
// refused before the YAML is walked.
//
//   auto recipe = frugal::train::load_recipe("recipes/tiny.yaml", {"train.steps=20", "optimizer.in_backward=true"});
//   frugal::optim::Optimizer opt(model->named_parameters(), recipe.optimizer);
//   std::string yaml = frugal::train::recipe_to_yaml(recipe);   // what a checkpoint stores; parses back the same
#pragma once

#include <c10/core/Device.h>
#include <c10/core/ScalarType.h>

#include <array>
#include <optional>
#include <stdexcept>
#include <string>
#include <vector>

#include "frugal/checkpoint/policy.h"
#include "frugal/data/examples.h"
#include "frugal/models/decoder.h"
#include "frugal/optim/optimizer.h"
#include "frugal/optim/schedule.h"

namespace frugal {
namespace train {

struct RecipeError : std::invalid_argument {
  using std::invalid_argument::invalid_argument;
};

// model.compute_dtype: the precision of the matrix products (autocast) for fp32 parameters.
// auto: bf16 where the device multiplies bf16 in hardware (precision::fast_bf16), else fp32.
enum class ComputeDtype { fp32, bf16, automatic };
constexpr std::array<ComputeDtype, 3> kComputeDtypes = {ComputeDtype::fp32, ComputeDtype::bf16, ComputeDtype::automatic};
const char* compute_dtype_name(ComputeDtype c);  // "fp32", "bf16", "auto"
std::optional<ComputeDtype> parse_compute_dtype(const std::string& name);

// A training run as a recipe YAML describes it (load_recipe), one field per key; YAML keys in the comments.
struct Recipe {
  std::string name = "recipe";
  models::DecoderConfig model;                      // model.vocab_size 0: take it from the tokenizer
  at::ScalarType dtype = at::kFloat;                // model.dtype: fp32 or bf16 (dtype_name / parse_dtype)
  ComputeDtype compute_dtype = ComputeDtype::fp32;  // model.compute_dtype: fp32, bf16 or auto (resolve_compute_dtype)
  // A Hugging Face checkpoint folder to fine-tune from ("" = random init). Its config.json defines
  // the model: load_recipe resolves `model` from it (resolve_model_config), and an architecture
  // key the recipe set explicitly that contradicts the file is a RecipeError naming both values.
  std::string init_from;
  bool ignore_dropout = false;  // model.ignore_dropout: train without the init_from file's dropout
  // The model.* keys the YAML or an override set (the rest took their defaults), and where each
  // architecture key's value came from: "file" (init_from's config.json), "recipe" or "default".
  std::vector<std::string> explicit_model_keys;
  std::vector<std::pair<std::string, std::string>> model_sources;
  // data
  // data.format: "text" (nullopt: a corpus tokenized into one stream, cut into random windows) or
  // JSON Lines examples (alpaca, prompt_completion, messages: data/examples.h), batched by epochs.
  std::optional<data::ExampleFormat> example_format;
  // data.template, data.*_field, data.train_on_prompt, data.bad_examples (examples only; its
  // `format` is example_format's: example_options() fills it in).
  data::ExampleOptions examples;
  // A text file or folder; with examples, JSON Lines files or folders (a YAML list names several,
  // held here one per line).
  std::string corpus;
  std::string validation;      // data.validation: separate validation examples ("": the last val_fraction)
  bool packing = false;        // data.packing: several examples a row, attention kept within each
  bool drop_overlong = false;  // data.overlong: drop (true) or truncate (false) examples over train.seq_len
  // The data files follow train.out_dir: left empty ("") in the YAML, load_recipe sets them to
  // "<out_dir>/tokenizer.model" and "<out_dir>/corpus.tokens"; set explicitly, they stay as given.
  std::string tokenizer;         // a SentencePiece .model, a tokenizer.json or a folder; a .model is trained when missing
  bool train_tokenizer = false;  // with model.init_from: train a new tokenizer instead of the model's own
  // The token file (text; "<out_dir>/corpus.tokens" when empty) or the training examples file
  // (examples; "<out_dir>/train.examples", its validation examples beside it as <file>.val); made
  // from the corpus when missing or made with another tokenizer or example options.
  std::string tokens;
  double val_fraction = 0.05;
  // train
  int64_t batch_size = 8;  // rows per micro-batch; a step takes
                           // optimizer.accumulation_steps() (train.gradient_accumulation_steps) of them
  int64_t seq_len = 128;
  int64_t steps = 100;
  // train.epochs: > 0 (examples only) sets train.steps to that many passes over the training
  // examples once they are tokenized (resolve_epochs); 0: train.steps as given.
  int64_t epochs = 0;
  int64_t seed = 0;
  int64_t log_interval = 10;
  int64_t eval_interval = 50;
  int64_t eval_batches = 4;
  int64_t checkpoint_interval = 50;
  int64_t keep_checkpoints = 2;
  std::string out_dir = "out/run";
  c10::Device device = c10::kCPU;  // train.device: cpu, cuda or cuda:N
  std::string sample_prompt = "";
  int64_t sample_tokens = 48;
  // optimizer.*: algorithm, lr, weight_decay, beta1, beta2, eps, momentum (sgd only), in_backward
  // (mode), clip, max_grad_norm, state_precision / state_placement / state_dir (state()),
  // stochastic_rounding.
  optim::OptimizerOptions optimizer = optim::OptimizerOptions().lr(1e-3).weight_decay(0.1).beta1(0.9).beta2(0.95).eps(1e-8).momentum(0.9);
  // schedule.*: kind, warmup_steps, min_lr_ratio; total_steps is train.steps (set at load).
  optim::ScheduleOptions schedule =
      optim::ScheduleOptions().kind(optim::ScheduleKind::cosine).warmup_steps(10).total_steps(100).min_lr_ratio(0.1);
  // memory
  checkpoint::CheckpointPolicy checkpointing;  // memory.checkpointing: none, full, every_K, selective
  int64_t activation_budget = 0;               // bytes; > 0 plans the checkpointing to fit (overrides checkpointing)
  models::LossOptions loss;                    // memory.chunked_loss (chunked), memory.loss_chunk (chunk_size)

  // Whether the optimizer steps inside backward (optimizer.in_backward).
  bool in_backward() const { return optimizer.mode() == optim::Mode::in_backward; }
  // Whether the data is a text corpus (no data.format) rather than JSON Lines examples.
  bool text_data() const { return !example_format.has_value(); }
  data::ExampleOptions example_options() const;       // examples with format = *example_format
  std::vector<std::string> corpus_paths() const;      // corpus, one path per line
  std::vector<std::string> validation_paths() const;  // validation, one path per line (empty when none)
  // Tokens of one optimizer step: train.gradient_accumulation_steps micro-batches of
  // train.batch_size rows of train.seq_len (examples' rows may be padded to fewer).
  int64_t tokens_per_step() const { return optimizer.accumulation_steps() * batch_size * seq_len; }
  // The rows of every micro-batch each of `world` data-parallel ranks trains on; a RecipeError
  // when train.batch_size does not split evenly over them.
  int64_t rows_per_rank(int64_t world) const;
  // Whether the recipe can train on `world` data-parallel ranks: the batch splits evenly
  // (rows_per_rank) and nothing it asks for is one process's only (optimizer.update_threads); a
  // RecipeError naming the key otherwise.
  void check_data_parallel(int64_t world) const;
};

// The parameter dtypes a recipe accepts: "fp32" (at::kFloat) and "bf16" (at::kBFloat16).
const char* dtype_name(at::ScalarType dtype);
std::optional<at::ScalarType> parse_dtype(const std::string& name);

// The dtype the recipe's matrix products run in on its device: bf16 parameters compute in bf16;
// fp32 parameters in model.compute_dtype, auto resolved by the device. `why` (optional) gets a
// short reason ("this CPU has AVX512-BF16"). Autocast is on when this differs from model.dtype.
at::ScalarType resolve_compute_dtype(const Recipe& recipe, std::string* why = nullptr);

// The architecture keys (model.arch, model.vocab_size, model.dim, ...) that a checkpoint's config.json fixes.
const std::vector<std::string>& architecture_keys();
// The model the recipe trains: with init_from, the folder's config.json (every field, with the
// recipe's model.attention), each architecture key the recipe set explicitly checked against it;
// without, the recipe's model. Throws RecipeError for a contradiction, an unreadable or refused
// config.json, or a nonzero dropout in it without model.ignore_dropout.
struct ResolvedModel {
  models::DecoderConfig config;
  std::vector<std::pair<std::string, std::string>> sources;  // architecture key -> "file", "recipe" or "default"
};
ResolvedModel resolve_model_config(const Recipe& recipe);

// train.epochs resolved once the data is known: steps = epochs x steps_per_epoch, the schedule's
// length with it (its warm-up checked against it), and epochs 0 (the steps say it now, as the
// checkpoint's recipe stores it). A recipe without epochs is returned as it is.
Recipe resolve_epochs(const Recipe& recipe, int64_t steps_per_epoch);

// Reads the YAML file, applies key=value overrides, resolves the model (resolve_model_config),
// validates. Throws RecipeError.
Recipe load_recipe(const std::string& path, const std::vector<std::string>& overrides = {});
// The same from YAML text (path names the source in messages).
Recipe parse_recipe(const std::string& yaml_text, const std::string& source, const std::vector<std::string>& overrides = {});
std::string recipe_to_yaml(const Recipe& recipe);
// One key's value as recipe_to_yaml writes it ("model.dim" -> "256"); RecipeError for an unknown key.
std::string recipe_value(const Recipe& recipe, const std::string& key);
// A number as recipes write it (10 significant digits, no trailing zeros: 4, 1e-05).
std::string recipe_number(double value);
// Every key, as "section.key".
std::vector<std::string> recipe_keys();
// Every key with what it takes, its default (the value when a recipe leaves it out) and one line of meaning.
struct RecipeKey {
  std::string key, type, default_value, meaning;
};
std::vector<RecipeKey> recipe_key_docs();

}  // namespace train
}  // namespace frugal
