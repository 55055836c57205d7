#include "frugal/train/recipe.h"

#include <yaml-cpp/yaml.h>

#include <array>
#include <cerrno>
#include <cmath>
#include <cstdlib>
#include <fstream>
#include <functional>
#include <limits>
#include <map>
#include <sstream>

#include "frugal/io/units.h"

namespace frugal {
namespace train {
namespace {

struct Field {
  std::string key;
  std::function<void(Recipe&, const std::string&)> set;  // throws a "what is allowed" message
  std::function<std::string(const Recipe&)> get;
};

int64_t to_int(const std::string& v, int64_t min) {
  errno = 0;
  char* end = nullptr;
  const long long x = std::strtoll(v.c_str(), &end, 10);
  if (v.empty() || *end || errno == ERANGE) throw std::invalid_argument("an integer");
  if (x < min) throw std::invalid_argument("an integer >= " + std::to_string(min));
  return x;
}

double to_double(const std::string& v, double min) {
  errno = 0;
  char* end = nullptr;
  const double x = std::strtod(v.c_str(), &end);
  if (v.empty() || *end || errno == ERANGE || !std::isfinite(x)) throw std::invalid_argument("a number");
  if (x < min) throw std::invalid_argument("a number >= " + std::to_string(min));
  return x;
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
  if (!digits.empty() && digits.size() <= 3 && digits.find_first_not_of("0123456789") == std::string::npos &&
      std::stoi(digits) <= std::numeric_limits<c10::DeviceIndex>::max()) {
    return c10::Device(c10::kCUDA, static_cast<c10::DeviceIndex>(std::stoi(digits)));
  }
  throw std::invalid_argument("cpu, cuda or cuda:N");
}

std::string fmt(double d) {
  std::ostringstream s;
  s.precision(10);
  s << d;
  return s.str();
}

// Each macro takes the recipe member as an expression of `r` (TORCH_ARG accessors included):
// assigned when the key is read, read when the recipe is written back.
#define INT_FIELD(key, expr, min) \
  {key, [](Recipe& r, const std::string& v) { expr = to_int(v, min); }, [](const Recipe& r) { return std::to_string(expr); }}
#define DOUBLE_FIELD(key, expr, min) \
  {key, [](Recipe& r, const std::string& v) { expr = to_double(v, min); }, [](const Recipe& r) { return fmt(expr); }}
#define BOOL_FIELD(key, expr) \
  {key, [](Recipe& r, const std::string& v) { expr = to_bool(v); }, [](const Recipe& r) { return std::string(expr ? "true" : "false"); }}
#define STRING_FIELD(key, expr) \
  {key, [](Recipe& r, const std::string& v) { expr = v; }, [](const Recipe& r) { return expr; }}
#define CHOICE_FIELD(key, expr, ...) \
  {key, [](Recipe& r, const std::string& v) { expr = one_of(v, {__VA_ARGS__}); }, [](const Recipe& r) { return expr; }}
// An enum with its layer's name table: parse (text -> optional), name (value -> text), all (every value).
#define ENUM_FIELD(key, expr, parse, name, all) \
  {key, [](Recipe& r, const std::string& v) { expr = one_of(parse(v), all, name); }, [](const Recipe& r) { return std::string(name(expr)); }}

const std::vector<Field>& fields() {
  static const std::vector<Field> table = {
      STRING_FIELD("name", r.name),
      CHOICE_FIELD("model.arch", r.model.arch, "llama", "gpt2"),
      INT_FIELD("model.vocab_size", r.model.vocab_size, 0),
      INT_FIELD("model.dim", r.model.dim, 1),
      INT_FIELD("model.n_layers", r.model.n_layers, 1),
      INT_FIELD("model.n_heads", r.model.n_heads, 1),
      INT_FIELD("model.n_kv_heads", r.model.n_kv_heads, 1),
      INT_FIELD("model.ffn_dim", r.model.ffn_dim, 1),
      INT_FIELD("model.max_seq_len", r.model.max_seq_len, 1),
      DOUBLE_FIELD("model.rope_theta", r.model.rope_theta, 1.0),
      DOUBLE_FIELD("model.norm_eps", r.model.norm_eps, 0.0),
      BOOL_FIELD("model.tie_embeddings", r.model.tie_embeddings),
      ENUM_FIELD("model.dtype", r.dtype, parse_dtype, dtype_name, kRecipeDtypes),
      STRING_FIELD("model.init_from", r.init_from),
      STRING_FIELD("data.corpus", r.corpus),
      STRING_FIELD("data.tokenizer", r.tokenizer),
      STRING_FIELD("data.tokens", r.tokens),
      DOUBLE_FIELD("data.val_fraction", r.val_fraction, 0.0),
      INT_FIELD("train.batch_size", r.batch_size, 1),
      INT_FIELD("train.gradient_accumulation_steps", r.optimizer.accumulation_steps(), 1),
      INT_FIELD("train.seq_len", r.seq_len, 1),
      INT_FIELD("train.steps", r.steps, 1),
      INT_FIELD("train.seed", r.seed, 0),
      INT_FIELD("train.log_interval", r.log_interval, 1),
      INT_FIELD("train.eval_interval", r.eval_interval, 0),
      INT_FIELD("train.eval_batches", r.eval_batches, 1),
      INT_FIELD("train.checkpoint_interval", r.checkpoint_interval, 0),
      INT_FIELD("train.keep_checkpoints", r.keep_checkpoints, 1),
      STRING_FIELD("train.out_dir", r.out_dir),
      {"train.device", [](Recipe& r, const std::string& v) { r.device = to_device(v); },
       [](const Recipe& r) { return r.device.str(); }},
      STRING_FIELD("train.sample_prompt", r.sample_prompt),
      INT_FIELD("train.sample_tokens", r.sample_tokens, 0),
      ENUM_FIELD("optimizer.algorithm", r.optimizer.algorithm(), optim::parse_algorithm, optim::algorithm_name,
                 optim::kAllAlgorithms),
      DOUBLE_FIELD("optimizer.lr", r.optimizer.lr(), 0.0),
      DOUBLE_FIELD("optimizer.weight_decay", r.optimizer.weight_decay(), 0.0),
      DOUBLE_FIELD("optimizer.beta1", r.optimizer.beta1(), 0.0),
      DOUBLE_FIELD("optimizer.beta2", r.optimizer.beta2(), 0.0),
      DOUBLE_FIELD("optimizer.eps", r.optimizer.eps(), 0.0),
      DOUBLE_FIELD("optimizer.momentum", r.optimizer.momentum(), 0.0),
      {"optimizer.in_backward",
       [](Recipe& r, const std::string& v) { r.optimizer.mode(to_bool(v) ? optim::Mode::in_backward : optim::Mode::standard); },
       [](const Recipe& r) { return std::string(r.in_backward() ? "true" : "false"); }},
      ENUM_FIELD("optimizer.clip", r.optimizer.clip(), optim::parse_clip, optim::clip_name, optim::kAllClips),
      DOUBLE_FIELD("optimizer.max_grad_norm", r.optimizer.max_grad_norm(), 0.0),
      ENUM_FIELD("optimizer.state_precision", r.optimizer.state().precision(), optim::parse_precision,
                 optim::precision_name, optim::kAllStatePrecisions),
      ENUM_FIELD("optimizer.state_placement", r.optimizer.state().placement(), optim::parse_placement,
                 optim::placement_name, optim::kAllStatePlacements),
      STRING_FIELD("optimizer.state_dir", r.optimizer.state().mmap_dir()),
      BOOL_FIELD("optimizer.stochastic_rounding", r.optimizer.stochastic_rounding()),
      ENUM_FIELD("schedule.kind", r.schedule.kind(), optim::parse_schedule, optim::schedule_name,
                 optim::kAllScheduleKinds),
      INT_FIELD("schedule.warmup_steps", r.schedule.warmup_steps(), 0),
      DOUBLE_FIELD("schedule.min_lr_ratio", r.schedule.min_lr_ratio(), 0.0),
      {"memory.checkpointing",
       [](Recipe& r, const std::string& v) {
         try {
           r.checkpointing = checkpoint::CheckpointPolicy::parse(v);
         } catch (const std::invalid_argument&) {
           throw std::invalid_argument(std::string("one of ") + checkpoint::CheckpointPolicy::allowed_names());
         }
       },
       [](const Recipe& r) { return r.checkpointing.name(); }},
      {"memory.activation_budget",
       [](Recipe& r, const std::string& v) {
         const auto b = io::parse_bytes(v);
         if (!b) throw std::invalid_argument("a byte count such as 0, 500000000 or 2GiB");
         r.activation_budget = *b;
       },
       [](const Recipe& r) { return std::to_string(r.activation_budget); }},
      BOOL_FIELD("memory.chunked_loss", r.loss.chunked()),
      INT_FIELD("memory.loss_chunk", r.loss.chunk_size(), 1),
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

// Flattens nested maps into section.key -> scalar text.
void flatten(const YAML::Node& node, const std::string& prefix, std::vector<std::pair<std::string, std::string>>& out,
             const std::string& source) {
  if (node.IsMap()) {
    for (const auto& item : node) {
      const std::string key = item.first.as<std::string>();
      flatten(item.second, prefix.empty() ? key : prefix + "." + key, out, source);
    }
  } else if (node.IsScalar()) {
    out.emplace_back(prefix, node.Scalar());
  } else if (node.IsNull()) {
    out.emplace_back(prefix, "");
  } else {
    throw RecipeError(source + ": " + prefix + " must be a single value, not a list");
  }
}

void validate(Recipe& r, const std::string& source) {
  auto bad = [&](const std::string& m) { throw RecipeError(source + ": " + m); };
  if (r.model.vocab_size != 0) {
    const std::string invalid = r.model.validate();
    if (!invalid.empty()) bad("model: " + invalid);
  } else {
    models::DecoderConfig probe = r.model;
    probe.vocab_size = 1;
    const std::string invalid = probe.validate();
    if (!invalid.empty()) bad("model: " + invalid);
  }
  if (r.seq_len > r.model.max_seq_len) {
    bad("train.seq_len " + std::to_string(r.seq_len) + " exceeds model.max_seq_len " + std::to_string(r.model.max_seq_len));
  }
  if (r.val_fraction >= 1) bad("data.val_fraction must be below 1");
  if (r.optimizer.beta1() >= 1 || r.optimizer.beta2() >= 1) bad("optimizer.beta1 and optimizer.beta2 must be below 1");
  if (r.in_backward() && r.optimizer.accumulation_steps() > 1) {
    bad("train.gradient_accumulation_steps " + std::to_string(r.optimizer.accumulation_steps()) +
        " needs optimizer.in_backward=false: stepping in backward uses each gradient and frees it at once, so "
        "there is nothing to accumulate into; accumulate in standard mode, or raise train.batch_size (with "
        "memory.checkpointing to keep the activations small)");
  }
  if (r.in_backward() && r.optimizer.clip() == optim::Clip::global_norm) {
    bad("optimizer.clip global_norm cannot run inside backward in one pass; use global_norm_two_pass or per_param_norm");
  }
  const optim::ScheduleKind kind = r.schedule.kind();
  if ((kind == optim::ScheduleKind::cosine || kind == optim::ScheduleKind::linear_decay) &&
      r.schedule.warmup_steps() >= r.steps) {
    bad("schedule.warmup_steps (" + std::to_string(r.schedule.warmup_steps()) + ") must be below train.steps (" +
        std::to_string(r.steps) + ")");
  }
  r.schedule.total_steps(r.steps);
  if (r.corpus.empty() && r.tokens.empty()) bad("data.corpus or data.tokens must be set");
}

}  // namespace

const char* dtype_name(at::ScalarType dtype) { return dtype == at::kBFloat16 ? "bf16" : "fp32"; }

std::optional<at::ScalarType> parse_dtype(const std::string& name) {
  for (at::ScalarType t : kRecipeDtypes) {
    if (name == dtype_name(t)) return t;
  }
  return std::nullopt;
}

std::vector<std::string> recipe_keys() {
  std::vector<std::string> keys;
  for (const auto& f : fields()) keys.push_back(f.key);
  return keys;
}

Recipe parse_recipe(const std::string& yaml_text, const std::string& source, const std::vector<std::string>& overrides) {
  YAML::Node root;
  try {
    root = YAML::Load(yaml_text);
  } catch (const YAML::Exception& e) {
    throw RecipeError(source + ": not valid YAML (" + e.msg + " at line " + std::to_string(e.mark.line + 1) + ")");
  }
  if (!root.IsMap() && !root.IsNull()) throw RecipeError(source + ": the recipe must be a map of sections");
  std::vector<std::pair<std::string, std::string>> flat;
  if (root.IsMap()) flatten(root, "", flat, source);
  Recipe r;
  for (const auto& [key, value] : flat) apply(r, key, value, source);
  for (const std::string& o : overrides) {
    const auto eq = o.find('=');
    if (eq == std::string::npos || eq == 0) throw RecipeError("override '" + o + "' must look like section.key=value");
    apply(r, o.substr(0, eq), o.substr(eq + 1), "override");
  }
  validate(r, source);
  return r;
}

Recipe load_recipe(const std::string& path, const std::vector<std::string>& overrides) {
  std::ifstream in(path);
  if (!in) throw RecipeError("recipe " + path + " cannot be read (no such file?)");
  std::stringstream text;
  text << in.rdbuf();
  return parse_recipe(text.str(), path, overrides);
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
