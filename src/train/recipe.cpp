#include "frugal/train/recipe.h"

#include <yaml-cpp/eventhandler.h>
#include <yaml-cpp/parser.h>
#include <yaml-cpp/yaml.h>

#include <algorithm>
#include <array>
#include <cmath>
#include <cstdlib>
#include <fstream>
#include <functional>
#include <map>
#include <set>
#include <string>
#include <utility>
#include <limits>
#include <sstream>
#include <vector>

#include "frugal/precision/autocast.h"
#include "frugal/io/files.h"
#include "frugal/io/numbers.h"
#include "frugal/io/units.h"
#include "frugal/models/activation_bytes.h"
#include "frugal/models/hf_checkpoint.h"
#include "frugal/train/estimate.h"
#include "frugal/train/run_state.h"

namespace frugal {
namespace train {
namespace {

struct Field {
  std::string key;
  std::function<void(Recipe&, const std::string&)> set;  // throws a "what is allowed" message
  std::function<std::string(const Recipe&)> get;
  std::string type = "text";  // what --list-keys shows
  std::string meaning;        // one line for --list-keys (Recipe.EveryKeyIsDocumented checks none is empty)
};

// A recipe value refused here becomes "KEY must be <what this throws>, got 'VALUE'" (set_key).
int64_t to_int(const std::string& v, int64_t min, int64_t max) {
  const std::optional<int64_t> x = io::to_int(v);
  if (!x || *x < min || *x > max) throw std::invalid_argument(io::int_range(min, max));
  return *x;
}

// Upper bounds of the integer keys: far past any real job, and small enough that loops over them
// end and that their products are checked (models::kMaxSizeBytes) rather than wrapped.
constexpr int64_t kMaxLayers = 4096;
constexpr int64_t kMaxDim = (int64_t{1} << 31) - 1;  // widths, heads, vocabulary (SentencePiece ids are 32-bit)
constexpr int64_t kMaxTokens = int64_t{1} << 24;     // sequence lengths, batch, generated tokens, eval batches
constexpr int64_t kMaxCount = int64_t{1} << 40;      // steps, intervals, chunk sizes
constexpr int64_t kMaxSeed = std::numeric_limits<int64_t>::max();
// Upper bounds of the real-valued keys: past any recipe that trains, and finite.
constexpr double kMaxRopeTheta = 1e12;
constexpr double kMaxRate = 100;  // learning rate, weight decay
constexpr double kMaxGradNorm = 1e12;

double to_double(const std::string& v, double min, double max) {
  const std::optional<double> x = io::to_double(v);
  if (!x || *x < min || *x > max) throw std::invalid_argument(io::double_range(min, max));
  return *x;
}

bool to_bool(const std::string& v) {
  if (v == "true" || v == "yes" || v == "on" || v == "1") return true;
  if (v == "false" || v == "no" || v == "off" || v == "0") return false;
  throw std::invalid_argument("true or false");
}

std::string one_of(const std::string& v, std::initializer_list<const char*> allowed) {
  std::string list;
  for (const char* a : allowed) {
    if (v == a) return v;
    list += (list.empty() ? "" : ", ") + std::string(a);
  }
  throw std::invalid_argument("one of " + list);
}

// The enum value `parsed` (what the enum's parse_X made of v), or "one of <every name>".
template <typename E, size_t N>
E one_of(std::optional<E> parsed, const std::array<E, N>& all, const char* (*name)(E)) {
  if (parsed) return *parsed;
  std::string list;
  for (E e : all) list += (list.empty() ? "" : ", ") + std::string(name(e));
  throw std::invalid_argument("one of " + list);
}

constexpr std::array<at::ScalarType, 2> kRecipeDtypes = {at::kFloat, at::kBFloat16};

// cpu, cuda or cuda:N (N a device index).
c10::Device to_device(const std::string& v) {
  if (v == "cpu") return c10::Device(c10::kCPU);
  if (v == "cuda") return c10::Device(c10::kCUDA);
  const std::string prefix = "cuda:";
  const std::string digits = v.rfind(prefix, 0) == 0 ? v.substr(prefix.size()) : "";
  const std::optional<int64_t> index = digits.empty() || digits[0] == '-' ? std::nullopt : io::to_int(digits);
  if (index && *index <= std::numeric_limits<c10::DeviceIndex>::max()) {
    return c10::Device(c10::kCUDA, static_cast<c10::DeviceIndex>(*index));
  }
  throw std::invalid_argument("cpu, cuda or cuda:N");
}

std::string fmt(double d) {
  std::ostringstream s;
  s.precision(10);
  s << d;
  return s.str();
}

// "one of a, b, c": what a parser that refuses "" says is allowed.
template <typename F>
std::string allowed_text(F parse) {
  try {
    parse("");
  } catch (const std::invalid_argument& e) {
    return e.what();
  }
  return "text";
}

// Each macro takes the recipe member as an expression of `r` (TORCH_ARG accessors included):
// assigned when the key is read, read when the recipe is written back.
// clang-format off
#define INT_FIELD(key, expr, min, max, meaning) \
  {key, [](Recipe& r, const std::string& v) { expr = to_int(v, min, max); }, [](const Recipe& r) { return std::to_string(expr); }, \
   "integer " + std::to_string(min) + ".." + std::to_string(max), meaning}
#define DOUBLE_FIELD(key, expr, min, max, meaning) \
  {key, [](Recipe& r, const std::string& v) { expr = to_double(v, min, max); }, [](const Recipe& r) { return fmt(expr); }, \
   "number " + fmt(min) + ".." + fmt(max), meaning}
#define BOOL_FIELD(key, expr, meaning) \
  {key, [](Recipe& r, const std::string& v) { expr = to_bool(v); }, [](const Recipe& r) { return std::string(expr ? "true" : "false"); }, \
   "true or false", meaning}
#define STRING_FIELD(key, expr, meaning) \
  {key, [](Recipe& r, const std::string& v) { expr = v; }, [](const Recipe& r) { return expr; }, "text", meaning}
#define CHOICE_FIELD(key, expr, meaning, ...) \
  {key, [](Recipe& r, const std::string& v) { expr = one_of(v, {__VA_ARGS__}); }, [](const Recipe& r) { return expr; }, \
   allowed_text([](const std::string& v) { return one_of(v, {__VA_ARGS__}); }), meaning}
// An enum with its layer's name table: parse (text -> optional), name (value -> text), all (every value).
#define ENUM_FIELD(key, expr, parse, name, all, meaning) \
  {key, [](Recipe& r, const std::string& v) { expr = one_of(parse(v), all, name); }, \
   [](const Recipe& r) { return std::string(name(expr)); }, \
   allowed_text([](const std::string& v) { return one_of(parse(v), all, name); }), meaning}
// clang-format on

// The enum value of v, nullopt for the word `none` names (data.format's text, data.template's auto),
// or "one of <none>, <every name>".
template <typename E, size_t N>
std::optional<E> optional_one_of(const std::string& v, const char* none, std::optional<E> parsed, const std::array<E, N>& all,
                                 const char* (*name)(E)) {
  if (v == none) return std::nullopt;
  if (parsed) return parsed;
  std::string list = none;
  for (E e : all) list += ", " + std::string(name(e));
  throw std::invalid_argument("one of " + list);
}
// clang-format off
#define OPTIONAL_ENUM_FIELD(key, expr, none, parse, name, all, meaning) \
  {key, [](Recipe& r, const std::string& v) { expr = optional_one_of(v, none, parse(v), all, name); }, \
   [](const Recipe& r) { return std::string(expr ? name(*expr) : none); }, \
   allowed_text([](const std::string& v) { return optional_one_of(v, none, parse(v), all, name); }), meaning}
// clang-format on

const std::vector<Field>& fields() {
  static const std::vector<Field> table = {
      STRING_FIELD("name", r.name, "the run's name, shown in summaries"),
      CHOICE_FIELD("model.arch", r.model.arch, "decoder family: Llama (RMSNorm, rotary, SwiGLU) or GPT-2", "llama", "gpt2"),
      INT_FIELD("model.vocab_size", r.model.vocab_size, 0, kMaxDim, "vocabulary size; 0 takes the tokenizer's"),
      INT_FIELD("model.dim", r.model.dim, 1, kMaxDim, "model width d_model"),
      INT_FIELD("model.n_layers", r.model.n_layers, 1, kMaxLayers, "number of Transformer blocks"),
      INT_FIELD("model.n_heads", r.model.n_heads, 1, kMaxDim, "attention heads (divides model.dim)"),
      INT_FIELD("model.n_kv_heads", r.model.n_kv_heads, 1, kMaxDim, "key/value heads for grouped-query attention (divides model.n_heads)"),
      INT_FIELD("model.ffn_dim", r.model.ffn_dim, 1, kMaxDim, "hidden width of each block's MLP"),
      INT_FIELD("model.max_seq_len", r.model.max_seq_len, 1, kMaxTokens, "longest sequence the model accepts (train.seq_len at most this)"),
      DOUBLE_FIELD("model.rope_theta", r.model.rope_theta, 1.0, kMaxRopeTheta, "base of the rotary position embeddings"),
      DOUBLE_FIELD("model.norm_eps", r.model.norm_eps, 0.0, 1.0, "epsilon of the normalisation layers"),
      BOOL_FIELD("model.tie_embeddings", r.model.tie_embeddings, "share the token embedding with the output head"),
      ENUM_FIELD("model.attention", r.model.attention, models::parse_attention_kernel, models::attention_kernel_name,
                 models::kAllAttentionKernels,
                 "attention kernel: explicit softmax(q k^T) v keeps the (B, H, T, T) probabilities for backward; sdpa "
                 "(LibTorch 2.0 or later) runs at::scaled_dot_product_attention's fused kernels, which keep one fp32 "
                 "log-sum-exp per query instead"),
      ENUM_FIELD("model.dtype", r.dtype, parse_dtype, dtype_name, kRecipeDtypes, "dtype of parameters and activations"),
      ENUM_FIELD(
          "model.compute_dtype", r.compute_dtype, parse_compute_dtype, compute_dtype_name, kComputeDtypes,
          "precision of the matrix products for fp32 parameters (autocast; auto: bf16 where the device has bf16 matrix instructions)"),
      STRING_FIELD("model.init_from", r.init_from,
                   "a Hugging Face checkpoint folder to fine-tune from (empty: random init); its config.json defines the model"),
      BOOL_FIELD("model.ignore_dropout", r.ignore_dropout,
                 "train without the dropout init_from's config.json asks for (frugal has none; false refuses a nonzero one)"),
      OPTIONAL_ENUM_FIELD(
          "data.format", r.example_format, "text", data::parse_example_format, data::example_format_name, data::kExampleFormats,
          "text: the corpus is one stream of tokens cut into random windows (pretraining); alpaca (instruction, input, output), "
          "prompt_completion or messages (a chat: system, user, assistant): one JSON object a line, an example each, the loss on the "
          "answers"),
      OPTIONAL_ENUM_FIELD(
          "data.template", r.examples.chat_template, "auto", data::parse_chat_template, data::chat_template_name, data::kChatTemplates,
          "how an example becomes text: alpaca's prompt, plain (prompt then answer), or a chat template (llama2, llama3, chatml); auto: "
          "alpaca for alpaca, plain for prompt_completion, the tokenizer's own chat_template (recognised) for messages"),
      STRING_FIELD("data.instruction_field", r.examples.fields.instruction, "alpaca: the key of the instruction"),
      STRING_FIELD("data.input_field", r.examples.fields.input, "alpaca: the key of the optional input"),
      STRING_FIELD("data.output_field", r.examples.fields.output, "alpaca: the key of the answer"),
      STRING_FIELD("data.prompt_field", r.examples.fields.prompt, "prompt_completion: the key of the prompt"),
      STRING_FIELD("data.completion_field", r.examples.fields.completion, "prompt_completion: the key of the answer"),
      STRING_FIELD("data.messages_field", r.examples.fields.messages, "messages: the key of the list of turns"),
      STRING_FIELD("data.role_field", r.examples.fields.role, "messages: the key of a turn's role (system, user or assistant)"),
      STRING_FIELD("data.content_field", r.examples.fields.content, "messages: the key of a turn's text"),
      BOOL_FIELD("data.train_on_prompt", r.examples.train_on_prompt,
                 "examples: take the loss on the prompts too (false: on the answers only, the prompts masked)"),
      {"data.bad_examples",
       [](Recipe& r, const std::string& v) {
         r.examples.skip_bad = one_of(v, {"error", "skip"}) == "skip";
       },
       [](const Recipe& r) { return std::string(r.examples.skip_bad ? "skip" : "error"); }, "one of error, skip",
       "examples: a malformed example stops the run naming file, line and field (error), or is counted and skipped (skip)"},
      BOOL_FIELD("data.packing", r.packing,
                 "examples: pack several into each row (attention and positions kept within each example) instead of one a row padded to "
                 "the longest"),
      {"data.overlong",
       [](Recipe& r, const std::string& v) {
         r.drop_overlong = one_of(v, {"truncate", "drop"}) == "drop";
       },
       [](const Recipe& r) { return std::string(r.drop_overlong ? "drop" : "truncate"); }, "one of truncate, drop",
       "examples longer than train.seq_len: truncated (their answer cut) or dropped; the run reports how many"},
      STRING_FIELD(
          "data.corpus", r.corpus,
          "text file or folder the tokenizer and tokens are made from; with examples, JSON Lines files or folders (a list names several)"),
      STRING_FIELD("data.validation", r.validation,
                   "examples: JSON Lines file(s) held out for validation (empty: the last data.val_fraction of the examples)"),
      STRING_FIELD("data.tokenizer", r.tokenizer,
                   "SentencePiece .model, tokenizer.json or model folder; a .model is trained when missing (empty: "
                   "<out_dir>/tokenizer.model; with model.init_from: the model's own)"),
      STRING_FIELD("data.tokens", r.tokens,
                   "token file, made when missing (empty: <out_dir>/corpus.tokens); with examples the examples file (empty: "
                   "<out_dir>/train.examples, validation beside it as .val)"),
      BOOL_FIELD("data.train_tokenizer", r.train_tokenizer,
                 "with model.init_from: train a new tokenizer rather than use the model's (its ids then differ from the model's)"),
      DOUBLE_FIELD("data.val_fraction", r.val_fraction, 0.0, 1.0,
                   "share of the tokens (or examples) held out for validation, above 0 and below 1"),
      INT_FIELD("train.batch_size", r.batch_size, 1, kMaxTokens,
                "sequences per micro-batch (a step takes train.gradient_accumulation_steps of them)"),
      INT_FIELD("train.gradient_accumulation_steps", r.optimizer.accumulation_steps(), 1, kMaxTokens,
                "micro-batches of train.batch_size rows per optimizer step (standard mode only)"),
      INT_FIELD("train.seq_len", r.seq_len, 1, kMaxTokens, "tokens per sequence"),
      INT_FIELD("train.steps", r.steps, 1, kMaxCount, "optimizer steps of the run (the schedule's length)"),
      INT_FIELD("train.epochs", r.epochs, 0, kMaxTokens,
                "examples: passes over the training examples, which set train.steps once they are tokenized (0: train.steps as given)"),
      INT_FIELD("train.seed", r.seed, 0, kMaxSeed, "seed of initialisation, batches and dropout"),
      INT_FIELD("train.log_interval", r.log_interval, 1, kMaxCount, "steps between metric lines"),
      INT_FIELD("train.eval_interval", r.eval_interval, 0, kMaxCount, "steps between validation losses (0: never)"),
      INT_FIELD("train.eval_batches", r.eval_batches, 1, kMaxTokens, "batches per validation loss"),
      INT_FIELD("train.checkpoint_interval", r.checkpoint_interval, 0, kMaxCount, "steps between checkpoints (0: only at the end)"),
      INT_FIELD("train.keep_checkpoints", r.keep_checkpoints, 1, kMaxTokens, "checkpoints kept in train.out_dir (older ones are pruned)"),
      STRING_FIELD("train.out_dir", r.out_dir, "folder for checkpoints, metrics and (by default) the data files"),
      {"train.device", [](Recipe& r, const std::string& v) { r.device = to_device(v); }, [](const Recipe& r) { return r.device.str(); },
       "cpu, cuda or cuda:N", "where the model trains"},
      STRING_FIELD("train.sample_prompt", r.sample_prompt, "text continued after training to show a sample"),
      INT_FIELD("train.sample_tokens", r.sample_tokens, 0, kMaxTokens, "tokens generated for the sample (0: none)"),
      ENUM_FIELD("optimizer.algorithm", r.optimizer.algorithm(), optim::parse_algorithm, optim::algorithm_name, optim::kAllAlgorithms,
                 "the update rule"),
      DOUBLE_FIELD("optimizer.lr", r.optimizer.lr(), 0.0, kMaxRate, "peak learning rate"),
      DOUBLE_FIELD("optimizer.weight_decay", r.optimizer.weight_decay(), 0.0, kMaxRate, "decoupled weight decay (adamw) or L2 penalty"),
      DOUBLE_FIELD("optimizer.beta1", r.optimizer.beta1(), 0.0, 1.0, "Adam's first-moment decay, below 1"),
      DOUBLE_FIELD("optimizer.beta2", r.optimizer.beta2(), 0.0, 1.0, "Adam's second-moment decay, below 1"),
      DOUBLE_FIELD("optimizer.eps", r.optimizer.eps(), 0.0, 1.0, "Adam's denominator epsilon"),
      DOUBLE_FIELD("optimizer.momentum", r.optimizer.momentum(), 0.0, 1.0, "SGD momentum"),
      {"optimizer.in_backward",
       [](Recipe& r, const std::string& v) { r.optimizer.mode(to_bool(v) ? optim::Mode::in_backward : optim::Mode::standard); },
       [](const Recipe& r) { return std::string(r.in_backward() ? "true" : "false"); }, "true or false",
       "update each parameter inside backward and free its gradient at once"},
      ENUM_FIELD("optimizer.clip", r.optimizer.clip(), optim::parse_clip, optim::clip_name, optim::kAllClips, "gradient clipping"),
      DOUBLE_FIELD("optimizer.max_grad_norm", r.optimizer.max_grad_norm(), 0.0, kMaxGradNorm, "the clipping threshold"),
      ENUM_FIELD("optimizer.state_precision", r.optimizer.state().precision(), optim::parse_precision, optim::precision_name,
                 optim::kAllStatePrecisions, "precision of Adam's moments"),
      ENUM_FIELD("optimizer.state_placement", r.optimizer.state().placement(), optim::parse_placement, optim::placement_name,
                 optim::kAllStatePlacements, "where Adam's moments live"),
      STRING_FIELD("optimizer.state_dir", r.optimizer.state().mmap_dir(), "folder of the state files (state_placement mmap or file)"),
      {"optimizer.state_window",
       [](Recipe& r, const std::string& v) {
         const auto b = io::parse_bytes(v);
         if (!b || *b < 4096 || *b > models::kMaxSizeBytes) {
           throw std::invalid_argument(io::bytes_range(4096, models::kMaxSizeBytes) + " such as 67108864 or 256MiB");
         }
         r.optimizer.state().window_bytes(*b);
       },
       [](const Recipe& r) { return std::to_string(r.optimizer.state().window_bytes()); }, "bytes (67108864, 256MiB)",
       "state bytes mapped in at once under state_placement file"},
      BOOL_FIELD("optimizer.stochastic_rounding", r.optimizer.stochastic_rounding(), "round bf16 parameter updates stochastically"),
      INT_FIELD("optimizer.update_threads", r.optimizer.update_threads(), 0, 1024,
                "with optimizer.in_backward: 0 updates inside backward's hooks; N updates on a thread of their own with N "
                "intra-op threads while backward goes on (one process only)"),
      {"optimizer.bytes_in_flight",
       [](Recipe& r, const std::string& v) {
         const auto b = io::parse_bytes(v);
         if (!b || *b < 0 || *b > models::kMaxSizeBytes) {
           throw std::invalid_argument(io::bytes_range(0, models::kMaxSizeBytes) + " such as 4194304 or 512MiB");
         }
         r.optimizer.bytes_in_flight(*b);
       },
       [](const Recipe& r) { return std::to_string(r.optimizer.bytes_in_flight()); }, "bytes (4194304, 512MiB)",
       "with optimizer.in_backward: gradients waiting for their update (update_threads) or average (data parallel) "
       "before backward waits"},
      ENUM_FIELD("schedule.kind", r.schedule.kind(), optim::parse_schedule, optim::schedule_name, optim::kAllScheduleKinds,
                 "learning-rate schedule"),
      INT_FIELD("schedule.warmup_steps", r.schedule.warmup_steps(), 0, kMaxCount,
                "steps of linear warm-up (below train.steps for cosine and linear_decay)"),
      DOUBLE_FIELD("schedule.min_lr_ratio", r.schedule.min_lr_ratio(), 0.0, 1.0, "final learning rate as a share of optimizer.lr"),
      {"memory.checkpointing",
       [](Recipe& r, const std::string& v) {
         try {
           r.checkpointing = checkpoint::CheckpointPolicy::parse(v);
         } catch (const std::invalid_argument&) {
           throw std::invalid_argument(std::string("one of ") + checkpoint::CheckpointPolicy::allowed_names());
         }
       },
       [](const Recipe& r) { return r.checkpointing.name(); }, std::string("one of ") + checkpoint::CheckpointPolicy::allowed_names(),
       "activation checkpointing policy"},
      {"memory.activation_budget",
       [](Recipe& r, const std::string& v) {
         const auto b = io::parse_bytes(v);
         if (!b || *b > models::kMaxSizeBytes) {
           throw std::invalid_argument(io::bytes_range(0, models::kMaxSizeBytes) + " such as 0, 500000000 or 2GiB");
         }
         r.activation_budget = *b;
       },
       [](const Recipe& r) { return std::to_string(r.activation_budget); }, "bytes (500000000, 2GiB)",
       "bytes of activations to fit by planning the checkpointing (0: use memory.checkpointing)"},
      BOOL_FIELD("memory.chunked_loss", r.loss.chunked(), "compute the loss in token chunks, never all logits at once"),
      INT_FIELD("memory.loss_chunk", r.loss.chunk_size(), 1, kMaxCount, "tokens per chunk of the chunked loss"),
  };
  return table;
}

const Field* find_field(const std::string& key) {
  for (const auto& f : fields()) {
    if (f.key == key) return &f;
  }
  return nullptr;
}

void apply(Recipe& r, const std::string& key, const std::string& value, const std::string& where) {
  const Field* f = find_field(key);
  if (!f) throw RecipeError(where + ": unknown key '" + key + "' (run 'frugal train --list-keys' for the allowed keys)");
  try {
    f->set(r, value);
  } catch (const std::invalid_argument& e) {
    throw RecipeError(where + ": " + key + " must be " + e.what() + ", got '" + value + "'");
  }
}

// yaml-cpp turns an alias into a shared node: one inside its own anchor makes a cycle (walking it
// never ends) and nested aliases ("billion laughs") expand exponentially when walked. This counts,
// from the parser's events and before any node is built, the nodes a walk would visit, and refuses
// a recursive alias, deep nesting or more nodes than any recipe needs.
class ExpansionCheck : public YAML::EventHandler {
 public:
  static constexpr int64_t kMaxNodes = 10000;  // a full recipe has about 70
  static constexpr size_t kMaxDepth = 32;      // a recipe nests 2 deep
  explicit ExpansionCheck(std::string source) : source_(std::move(source)) {}

  void OnDocumentStart(const YAML::Mark&) override {}
  void OnDocumentEnd() override {}
  void OnNull(const YAML::Mark& m, YAML::anchor_t anchor) override { leaf(m, anchor); }
  void OnScalar(const YAML::Mark& m, const std::string&, YAML::anchor_t anchor, const std::string&) override { leaf(m, anchor); }
  void OnAlias(const YAML::Mark& m, YAML::anchor_t anchor) override {
    for (const Open& o : open_) {
      if (o.anchor == anchor && anchor != YAML::NullAnchor) fail(m, "an alias refers to the node that contains it");
    }
    const auto it = sizes_.find(anchor);
    add(m, it == sizes_.end() ? 1 : it->second);
  }
  void OnSequenceStart(const YAML::Mark& m, const std::string&, YAML::anchor_t anchor, YAML::EmitterStyle::value) override {
    start(m, anchor);
  }
  void OnSequenceEnd() override { end(); }
  void OnMapStart(const YAML::Mark& m, const std::string&, YAML::anchor_t anchor, YAML::EmitterStyle::value) override { start(m, anchor); }
  void OnMapEnd() override { end(); }

 private:
  struct Open {
    YAML::anchor_t anchor;
    int64_t nodes;  // this collection and everything under it, aliases expanded
  };
  [[noreturn]] void fail(const YAML::Mark& m, const std::string& what) const {
    throw RecipeError(source_ + ": " + what + " (line " + std::to_string(m.line + 1) + ")");
  }
  void add(const YAML::Mark& m, int64_t nodes) {
    total_ += nodes;  // stays below 2 * kMaxNodes: checked as it grows, and no anchor is bigger
    if (!open_.empty()) open_.back().nodes += nodes;
    if (total_ > kMaxNodes) {
      fail(m, "expands to more than " + std::to_string(kMaxNodes) + " values (aliases nested in aliases?)");
    }
  }
  void leaf(const YAML::Mark& m, YAML::anchor_t anchor) {
    if (anchor != YAML::NullAnchor) sizes_[anchor] = 1;
    add(m, 1);
  }
  void start(const YAML::Mark& m, YAML::anchor_t anchor) {
    if (open_.size() >= kMaxDepth) fail(m, "nests deeper than " + std::to_string(kMaxDepth) + " levels");
    open_.push_back({anchor, 1});
    ++total_;
  }
  void end() {
    const Open done = open_.back();
    open_.pop_back();
    if (done.anchor != YAML::NullAnchor) sizes_[done.anchor] = done.nodes;
    if (!open_.empty()) open_.back().nodes += done.nodes;  // total_ counted them as they came
  }
  std::string source_;
  std::vector<Open> open_;
  std::map<YAML::anchor_t, int64_t> sizes_;
  int64_t total_ = 0;
};

// The keys that take a list of paths.
bool is_list_key(const std::string& key) { return key == "data.corpus" || key == "data.validation"; }

std::vector<std::string> split_lines(const std::string& text) {
  std::vector<std::string> out;
  std::istringstream in(text);
  for (std::string line; std::getline(in, line);) {
    if (!line.empty()) out.push_back(line);
  }
  return out;
}

// Flattens nested maps into section.key -> scalar text.
void flatten(const YAML::Node& node, const std::string& prefix, std::vector<std::pair<std::string, std::string>>& out,
             const std::string& source) {
  if (node.IsMap()) {
    for (const auto& item : node) {
      if (!item.first.IsScalar())
        throw RecipeError(source + ": the keys of " + (prefix.empty() ? "the recipe" : prefix) + " must be names");
      const std::string key = item.first.Scalar();
      flatten(item.second, prefix.empty() ? key : prefix + "." + key, out, source);
    }
  } else if (node.IsScalar()) {
    out.emplace_back(prefix, node.Scalar());
  } else if (node.IsNull()) {
    out.emplace_back(prefix, "");
  } else if (node.IsSequence() && is_list_key(prefix)) {
    // Several paths, held one per line (Recipe::corpus_paths).
    std::string joined;
    for (const auto& item : node) {
      if (!item.IsScalar() || item.Scalar().empty() || item.Scalar().find('\n') != std::string::npos) {
        throw RecipeError(source + ": every item of " + prefix + " must be a path");
      }
      joined += (joined.empty() ? "" : "\n") + item.Scalar();
    }
    out.emplace_back(prefix, joined);
  } else {
    throw RecipeError(source + ": " + prefix + " must be a single value, not a list");
  }
}

// Where each key set on the command line came from, so a check it breaks names the override.
using Overridden = std::map<std::string, std::string>;  // key -> value

// The data keys: the example keys need examples (text windows have no prompts, answers or
// epochs), and train.epochs replaces train.steps rather than joining it.
template <typename Shown, typename Bad>
void validate_data(const Recipe& r, const Shown& shown, const std::set<std::string>& set_keys, const Bad& bad) {
  if (r.text_data()) {
    // An example key set to anything but its default (a saved recipe writes every key).
    const Recipe defaults;
    for (const std::string& key : set_keys) {
      const bool example_key =
          (key.rfind("data.", 0) == 0 && key.size() > 6 &&
           (key.compare(key.size() - 6, 6, "_field") == 0 || key == "data.template" || key == "data.train_on_prompt" ||
            key == "data.bad_examples" || key == "data.packing" || key == "data.overlong" || key == "data.validation")) ||
          key == "train.epochs";
      if (example_key && find_field(key)->get(r) != find_field(key)->get(defaults)) {
        bad(shown(key) + " applies to examples only, and " + shown("data.format") +
            " is text (set data.format to alpaca, prompt_completion or messages)");
      }
    }
    if (r.corpus.find('\n') != std::string::npos)
      bad("data.corpus: a list of paths needs data.format examples; text takes one file or folder");
    return;
  }
  if (!r.sample_prompt.empty()) {
    bad(shown("train.sample_prompt") + ": with examples the sample answers the first validation example's prompt; leave it empty");
  }
  if (r.epochs > 0 && set_keys.count("train.steps")) {  // (parse_recipe let an override of one replace the file's other)
    bad(shown("train.epochs") + " and " + shown("train.steps") + " both say how long to train: set one");
  }
  if (!r.validation.empty() && set_keys.count("data.val_fraction")) {
    bad(shown("data.val_fraction") + " holds out a share of the examples, but " + shown("data.validation") +
        " names the validation examples: set one");
  }
  if (r.corpus.empty() && r.tokens.empty()) bad("data.corpus (the JSON Lines examples) must be set");
  const data::ExampleFields& f = r.examples.fields;
  for (const auto& [key, value] : {std::make_pair("data.instruction_field", &f.instruction),
                                   {"data.input_field", &f.input},
                                   {"data.output_field", &f.output},
                                   {"data.prompt_field", &f.prompt},
                                   {"data.completion_field", &f.completion},
                                   {"data.messages_field", &f.messages},
                                   {"data.role_field", &f.role},
                                   {"data.content_field", &f.content}}) {
    if (value->empty()) bad(std::string(key) + " must name a key of the examples' objects");
  }
}

void validate(Recipe& r, const std::string& source, const Overridden& overridden, const std::set<std::string>& set_keys) {
  // "train.steps=3 (from the command line)" for an override, "train.steps 3" for the file's value.
  auto shown = [&](const std::string& key) {
    const auto it = overridden.find(key);
    if (it != overridden.end()) return key + "=" + it->second + " (from the command line)";
    return key + " " + find_field(key)->get(r);
  };
  auto bad = [&](const std::string& m) { throw RecipeError(source + ": " + m); };
  auto bad_model = [&](const std::string& invalid) {
    // DecoderConfig names its fields; say which of them the command line set.
    std::string from;
    for (const auto& [key, value] : overridden) {
      if (key.rfind("model.", 0) == 0 && invalid.find(key.substr(6)) != std::string::npos) {
        from += (from.empty() ? " (" : ", ") + key + "=" + value;
      }
    }
    bad("model: " + invalid + (from.empty() ? "" : from + " from the command line)"));
  };
  // A kernel this LibTorch lacks is refused before anything is built or read.
  const std::string no_kernel = models::attention_kernel_unavailable(r.model.attention);
  if (!no_kernel.empty()) bad(shown("model.attention") + " " + no_kernel + "; use model.attention=explicit");
  models::DecoderConfig probe = r.model;
  if (probe.vocab_size == 0) probe.vocab_size = 1;  // the tokenizer's, checked again once known
  const std::string invalid = probe.validate();
  if (!invalid.empty()) bad_model(invalid);
  if (r.seq_len > r.model.max_seq_len) bad(shown("train.seq_len") + " exceeds " + shown("model.max_seq_len"));
  if (!(r.val_fraction > 0) || r.val_fraction >= 1) {
    bad(shown("data.val_fraction") + ": it must be above 0 and below 1 (the share of the tokens held out for validation)");
  }
  if (r.optimizer.beta1() >= 1) bad(shown("optimizer.beta1") + ": it must be below 1");
  if (r.optimizer.beta2() >= 1) bad(shown("optimizer.beta2") + ": it must be below 1");
  if (r.in_backward() && r.optimizer.accumulation_steps() > 1) {
    bad("train.gradient_accumulation_steps " + std::to_string(r.optimizer.accumulation_steps()) +
        " needs optimizer.in_backward=false: stepping in backward uses each gradient and frees it at once, so "
        "there is nothing to accumulate into; accumulate in standard mode, or raise train.batch_size (with "
        "memory.checkpointing to keep the activations small)");
  }
  if (r.optimizer.update_threads() > 0 && !r.device.is_cpu()) {
    bad(shown("optimizer.update_threads") + " runs the updates on a CPU thread beside backward; on " + r.device.str() +
        " they are kernels queued beside backward's already: set it to 0");
  }
  if (!r.in_backward() && r.optimizer.update_threads() > 0) {
    bad(shown("optimizer.update_threads") +
        " needs optimizer.in_backward=true: it runs the updates inside backward on a thread "
        "of their own (standard mode updates after backward, with every core)");
  }
  if (r.in_backward() && r.optimizer.clip() == optim::Clip::global_norm) {
    bad(shown("optimizer.clip") + " cannot run inside backward (" + shown("optimizer.in_backward") +
        ") in one pass; use global_norm_two_pass or per_param_norm");
  }
  const optim::ScheduleKind kind = r.schedule.kind();
  if ((kind == optim::ScheduleKind::cosine || kind == optim::ScheduleKind::linear_decay) && r.schedule.warmup_steps() >= r.steps &&
      r.epochs == 0) {  // with epochs: checked by resolve_epochs
    bad(shown("schedule.warmup_steps") + " must be below " + shown("train.steps"));
  }
  r.schedule.total_steps(r.steps);
  if (r.corpus.empty() && r.tokens.empty()) bad("data.corpus or data.tokens must be set");
  validate_data(r, shown, set_keys, bad);
  if (r.out_dir.empty()) bad("train.out_dir must be set (the folder for checkpoints and metrics)");
  // Every size the job computes must fit: refuse the keys that make them pass 2^56 bytes.
  Recipe sizes = r;
  sizes.activation_budget = 0;  // the planner's choice does not change which sizes overflow
  try {
    estimate_training_memory(sizes, probe.vocab_size);
  } catch (const RecipeError& e) {
    bad(e.what());
  }
  int64_t tokens = 0;
  if (__builtin_mul_overflow(r.steps, r.batch_size * r.seq_len, &tokens)) {
    bad(shown("train.steps") + " x " + shown("train.batch_size") + " x " + shown("train.seq_len") + ": the tokens of the run pass 2^63");
  }
  // The data files follow train.out_dir unless set (see recipe.h).
  if (r.tokenizer.empty()) r.tokenizer = r.out_dir + "/tokenizer.model";
  if (r.tokens.empty()) r.tokens = r.out_dir + (r.text_data() ? "/corpus.tokens" : "/train.examples");
}

}  // namespace

void Recipe::check_data_parallel(int64_t world) const {
  rows_per_rank(world);
  if (world > 1 && optimizer.update_threads() > 0) {
    throw RecipeError("optimizer.update_threads " + std::to_string(optimizer.update_threads()) + " cannot be used with " +
                      std::to_string(world) + " ranks: data parallel averages each gradient in the hook before its update; set it to 0");
  }
}

int64_t Recipe::rows_per_rank(int64_t world) const {
  if (world < 1 || batch_size % world != 0) {
    throw RecipeError("train.batch_size " + std::to_string(batch_size) + " does not split evenly over " + std::to_string(world) +
                      " ranks: each rank trains on an equal share of every batch");
  }
  return batch_size / world;
}

const char* dtype_name(at::ScalarType dtype) { return dtype == at::kBFloat16 ? "bf16" : "fp32"; }

std::optional<at::ScalarType> parse_dtype(const std::string& name) {
  for (at::ScalarType t : kRecipeDtypes) {
    if (name == dtype_name(t)) return t;
  }
  return std::nullopt;
}

const char* compute_dtype_name(ComputeDtype c) {
  switch (c) {
    case ComputeDtype::bf16: return "bf16";
    case ComputeDtype::automatic: return "auto";
    case ComputeDtype::fp32: break;
  }
  return "fp32";
}

std::optional<ComputeDtype> parse_compute_dtype(const std::string& name) {
  for (ComputeDtype c : kComputeDtypes) {
    if (name == compute_dtype_name(c)) return c;
  }
  return std::nullopt;
}

at::ScalarType resolve_compute_dtype(const Recipe& r, std::string* why) {
  auto say = [&](const std::string& text) {
    if (why != nullptr) *why = text;
  };
  if (r.dtype != at::kFloat) {
    say(std::string("the parameters are ") + dtype_name(r.dtype));
    return r.dtype;
  }
  switch (r.compute_dtype) {
    case ComputeDtype::fp32: say("model.compute_dtype fp32"); return at::kFloat;
    case ComputeDtype::bf16: say("model.compute_dtype bf16"); return at::kBFloat16;
    case ComputeDtype::automatic: break;
  }
  std::string reason;
  const bool fast = precision::fast_bf16(r.device.type(), &reason);
  say("model.compute_dtype auto: " + reason);
  return fast ? at::kBFloat16 : at::kFloat;
}

std::vector<RecipeKey> recipe_key_docs() {
  const Recipe defaults;
  std::vector<RecipeKey> out;
  for (const auto& f : fields()) out.push_back({f.key, f.type, f.get(defaults), f.meaning});
  return out;
}

std::vector<std::string> recipe_keys() {
  std::vector<std::string> keys;
  for (const auto& f : fields()) keys.push_back(f.key);
  return keys;
}

const std::vector<std::string>& architecture_keys() {
  static const std::vector<std::string> keys = {"model.arch",       "model.vocab_size", "model.dim",           "model.n_layers",
                                                "model.n_heads",    "model.n_kv_heads", "model.ffn_dim",       "model.max_seq_len",
                                                "model.rope_theta", "model.norm_eps",   "model.tie_embeddings"};
  return keys;
}

ResolvedModel resolve_model_config(const Recipe& r) {
  ResolvedModel out{r.model, {}};
  auto is_explicit = [&](const std::string& key) {
    return std::find(r.explicit_model_keys.begin(), r.explicit_model_keys.end(), key) != r.explicit_model_keys.end();
  };
  if (r.init_from.empty()) {
    for (const std::string& key : architecture_keys()) out.sources.emplace_back(key, is_explicit(key) ? "recipe" : "default");
    return out;
  }
  const std::string path = r.init_from + "/config.json";
  if (!io::path_exists(r.init_from) || io::is_regular_file(r.init_from)) {
    throw RecipeError("model.init_from " + r.init_from + " is not a folder (a Hugging Face checkpoint folder is needed)");
  }
  if (!io::path_exists(path)) throw RecipeError("model.init_from " + r.init_from + " has no config.json");
  models::DecoderConfig file;
  try {
    file = models::read_hf_config(path);
  } catch (const std::invalid_argument& e) {
    throw RecipeError(std::string("model.init_from: ") + e.what());
  }
  file.attention = r.model.attention;  // how attention is computed is the recipe's choice
  Recipe from_file = r;
  from_file.model = file;
  for (const std::string& key : architecture_keys()) {
    const Field* f = find_field(key);
    const std::string mine = f->get(r), theirs = f->get(from_file);
    const bool from_tokenizer = key == "model.vocab_size" && mine == "0";
    if (is_explicit(key) && mine != theirs && !from_tokenizer) {
      throw RecipeError(key + " " + mine + " (set in the recipe) contradicts model.init_from " + path + ", which says " + theirs +
                        " (leave " + key + " out to take the file's)");
    }
    out.sources.emplace_back(key, "file");
  }
  if (file.dropout > 0 && !r.ignore_dropout) {
    throw RecipeError("model.init_from " + path + " has " + file.dropout_field + " " + fmt(file.dropout) +
                      ": frugal trains without dropout; set model.ignore_dropout=true to train without it");
  }
  out.config = file;
  return out;
}

Recipe parse_recipe(const std::string& yaml_text, const std::string& source, const std::vector<std::string>& overrides) {
  YAML::Node root;
  try {
    ExpansionCheck check(source);
    std::istringstream events(yaml_text);
    YAML::Parser parser(events);
    while (parser.HandleNextDocument(check)) {
    }
    root = YAML::Load(yaml_text);
  } catch (const YAML::Exception& e) {
    throw RecipeError(source + ": not valid YAML (" + e.msg + " at line " + std::to_string(e.mark.line + 1) + ")");
  }
  if (!root.IsMap() && !root.IsNull()) throw RecipeError(source + ": the recipe must be a map of sections");
  std::vector<std::pair<std::string, std::string>> flat;
  if (root.IsMap()) flatten(root, "", flat, source);
  Recipe r;
  for (const auto& [key, value] : flat) apply(r, key, value, source);
  std::set<std::string> set_keys;
  for (const auto& item : flat) set_keys.insert(item.first);
  Overridden overridden;
  for (const std::string& o : overrides) {
    const auto eq = o.find('=');
    if (eq == std::string::npos || eq == 0) throw RecipeError("override '" + o + "' must look like section.key=value");
    apply(r, o.substr(0, eq), o.substr(eq + 1), "override");
    overridden[o.substr(0, eq)] = o.substr(eq + 1);
    set_keys.insert(o.substr(0, eq));
  }
  for (const std::string& key : set_keys) {
    if (key.rfind("model.", 0) == 0) r.explicit_model_keys.push_back(key);
  }
  // How long to train: train.steps or train.epochs. One of them set on the command line replaces the
  // file's other (train.steps=5 on a recipe of epochs runs 5 steps); both at one level are refused.
  const bool steps_over = overridden.count("train.steps") > 0, epochs_over = overridden.count("train.epochs") > 0;
  if (steps_over && !epochs_over && r.epochs > 0) {
    r.epochs = 0;
    set_keys.erase("train.epochs");
  } else if (epochs_over && !steps_over && set_keys.count("train.steps")) {
    set_keys.erase("train.steps");
  }
  // frugal's GPT-2 has always tied its head to the embedding: the arch's default, unless set.
  if (r.model.arch == "gpt2" && !set_keys.count("model.tie_embeddings")) r.model.tie_embeddings = true;
  // A frugal run folder (train.out_dir of an earlier run) stands for its latest checkpoint.
  if (!r.init_from.empty() && !io::is_regular_file(r.init_from) && !io::path_exists(r.init_from + "/config.json") &&
      io::path_exists(r.init_from + "/latest")) {
    try {
      const std::string latest = latest_checkpoint(r.init_from);
      if (!latest.empty()) r.init_from = latest;
    } catch (const std::invalid_argument& e) {
      throw RecipeError(std::string("model.init_from: ") + e.what());
    }
  }
  ResolvedModel resolved = resolve_model_config(r);
  r.model = resolved.config;
  r.model_sources = resolved.sources;
  validate(r, source, overridden, set_keys);
  return r;
}

Recipe load_recipe(const std::string& path, const std::vector<std::string>& overrides) {
  std::string text;
  try {
    text = io::read_file(path, io::kMetadataFileBytes, "recipe");  // a FIFO or a device is refused by name
  } catch (const std::invalid_argument& e) {
    throw RecipeError(e.what());
  }
  return parse_recipe(text, path, overrides);
}

data::ExampleOptions Recipe::example_options() const {
  data::ExampleOptions o = examples;
  if (example_format) o.format = *example_format;
  return o;
}

std::vector<std::string> Recipe::corpus_paths() const { return split_lines(corpus); }
std::vector<std::string> Recipe::validation_paths() const { return split_lines(validation); }

Recipe resolve_epochs(const Recipe& recipe, int64_t steps_per_epoch) {
  if (recipe.epochs <= 0) return recipe;
  Recipe r = recipe;
  if (steps_per_epoch < 1 || __builtin_mul_overflow(recipe.epochs, steps_per_epoch, &r.steps) || r.steps > kMaxCount) {
    throw RecipeError("train.epochs " + std::to_string(recipe.epochs) + " x " + std::to_string(steps_per_epoch) +
                      " steps an epoch is not a number of steps frugal runs");
  }
  const optim::ScheduleKind kind = r.schedule.kind();
  if ((kind == optim::ScheduleKind::cosine || kind == optim::ScheduleKind::linear_decay) && r.schedule.warmup_steps() >= r.steps) {
    throw RecipeError("schedule.warmup_steps " + std::to_string(r.schedule.warmup_steps()) + " must be below the run's " +
                      std::to_string(r.steps) + " steps (train.epochs " + std::to_string(r.epochs) + " x " +
                      std::to_string(steps_per_epoch) + " steps an epoch)");
  }
  r.schedule.total_steps(r.steps);
  r.epochs = 0;  // the steps say it now, as the checkpoint's recipe stores it (both would be refused)
  return r;
}

std::string recipe_number(double value) { return fmt(value); }

std::string recipe_value(const Recipe& r, const std::string& key) {
  const Field* f = find_field(key);
  if (f == nullptr) throw RecipeError("unknown recipe key '" + key + "'");
  return f->get(r);
}

std::string recipe_to_yaml(const Recipe& r) {
  std::map<std::string, std::vector<std::pair<std::string, std::string>>> sections;
  std::vector<std::string> order;
  std::ostringstream out;
  for (const auto& f : fields()) {
    const auto dot = f.key.find('.');
    if (dot == std::string::npos) {
      out << f.key << ": " << YAML::Node(f.get(r)) << "\n";
      continue;
    }
    const std::string section = f.key.substr(0, dot);
    if (!sections.count(section)) order.push_back(section);
    sections[section].emplace_back(f.key.substr(dot + 1), f.get(r));
  }
  for (const auto& s : order) {
    out << s << ":\n";
    for (const auto& [k, v] : sections[s]) {
      YAML::Emitter e;
      e << YAML::DoubleQuoted << v;
      out << "  " << k << ": " << e.c_str() << "\n";
    }
  }
  return out.str();
}

}  // namespace train
}  // namespace frugal
