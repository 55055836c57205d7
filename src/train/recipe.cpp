#include "frugal/train/recipe.h"

#include <yaml-cpp/yaml.h>

#include <cerrno>
#include <cmath>
#include <cstdlib>
#include <fstream>
#include <functional>
#include <map>
#include <sstream>

#include "frugal/checkpoint/policy.h"
#include "frugal/io/units.h"
#include "frugal/optim/optimizer.h"
#include "frugal/optim/schedule.h"

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

std::string fmt(double d) {
  std::ostringstream s;
  s.precision(10);
  s << d;
  return s.str();
}

#define INT_FIELD(key, member, min) \
  {key, [](Recipe& r, const std::string& v) { r.member = to_int(v, min); }, [](const Recipe& r) { return std::to_string(r.member); }}
#define DOUBLE_FIELD(key, member, min) \
  {key, [](Recipe& r, const std::string& v) { r.member = to_double(v, min); }, [](const Recipe& r) { return fmt(r.member); }}
#define BOOL_FIELD(key, member) \
  {key, [](Recipe& r, const std::string& v) { r.member = to_bool(v); }, [](const Recipe& r) { return std::string(r.member ? "true" : "false"); }}
#define STRING_FIELD(key, member) \
  {key, [](Recipe& r, const std::string& v) { r.member = v; }, [](const Recipe& r) { return r.member; }}
#define CHOICE_FIELD(key, member, ...) \
  {key, [](Recipe& r, const std::string& v) { r.member = one_of(v, {__VA_ARGS__}); }, [](const Recipe& r) { return r.member; }}

const std::vector<Field>& fields() {
  static const std::vector<Field> table = {
      STRING_FIELD("name", name),
      CHOICE_FIELD("model.arch", model.arch, "llama", "gpt2"),
      INT_FIELD("model.vocab_size", model.vocab_size, 0),
      INT_FIELD("model.dim", model.dim, 1),
      INT_FIELD("model.n_layers", model.n_layers, 1),
      INT_FIELD("model.n_heads", model.n_heads, 1),
      INT_FIELD("model.n_kv_heads", model.n_kv_heads, 1),
      INT_FIELD("model.ffn_dim", model.ffn_dim, 1),
      INT_FIELD("model.max_seq_len", model.max_seq_len, 1),
      DOUBLE_FIELD("model.rope_theta", model.rope_theta, 1.0),
      DOUBLE_FIELD("model.norm_eps", model.norm_eps, 0.0),
      BOOL_FIELD("model.tie_embeddings", model.tie_embeddings),
      CHOICE_FIELD("model.dtype", dtype, "fp32", "bf16"),
      STRING_FIELD("model.init_from", init_from),
      STRING_FIELD("data.corpus", corpus),
      STRING_FIELD("data.tokenizer", tokenizer),
      STRING_FIELD("data.tokens", tokens),
      DOUBLE_FIELD("data.val_fraction", val_fraction, 0.0),
      INT_FIELD("train.batch_size", batch_size, 1),
      INT_FIELD("train.seq_len", seq_len, 1),
      INT_FIELD("train.steps", steps, 1),
      INT_FIELD("train.seed", seed, 0),
      INT_FIELD("train.log_interval", log_interval, 1),
      INT_FIELD("train.eval_interval", eval_interval, 0),
      INT_FIELD("train.eval_batches", eval_batches, 1),
      INT_FIELD("train.checkpoint_interval", checkpoint_interval, 0),
      INT_FIELD("train.keep_checkpoints", keep_checkpoints, 1),
      STRING_FIELD("train.out_dir", out_dir),
      STRING_FIELD("train.device", device),
      STRING_FIELD("train.sample_prompt", sample_prompt),
      INT_FIELD("train.sample_tokens", sample_tokens, 0),
      CHOICE_FIELD("optimizer.algorithm", algorithm, "sgd", "adam", "adamw"),
      DOUBLE_FIELD("optimizer.lr", lr, 0.0),
      DOUBLE_FIELD("optimizer.weight_decay", weight_decay, 0.0),
      DOUBLE_FIELD("optimizer.beta1", beta1, 0.0),
      DOUBLE_FIELD("optimizer.beta2", beta2, 0.0),
      DOUBLE_FIELD("optimizer.eps", eps, 0.0),
      DOUBLE_FIELD("optimizer.momentum", momentum, 0.0),
      BOOL_FIELD("optimizer.in_backward", in_backward),
      CHOICE_FIELD("optimizer.clip", clip, "none", "global_norm", "global_norm_two_pass", "per_param_norm"),
      DOUBLE_FIELD("optimizer.max_grad_norm", max_grad_norm, 0.0),
      CHOICE_FIELD("optimizer.state_precision", state_precision, "fp32", "bf16", "int8", "int4"),
      CHOICE_FIELD("optimizer.state_placement", state_placement, "device", "host", "mmap"),
      STRING_FIELD("optimizer.state_dir", state_dir),
      BOOL_FIELD("optimizer.stochastic_rounding", stochastic_rounding),
      CHOICE_FIELD("schedule.kind", schedule, "constant", "linear_warmup", "cosine", "linear_decay", "step"),
      INT_FIELD("schedule.warmup_steps", warmup_steps, 0),
      DOUBLE_FIELD("schedule.min_lr_ratio", min_lr_ratio, 0.0),
      {"memory.checkpointing",
       [](Recipe& r, const std::string& v) {
         try {
           r.checkpointing = checkpoint::CheckpointPolicy::parse(v).name();
         } catch (const std::invalid_argument&) {
           throw std::invalid_argument("one of none, full, every_K (K >= 1), selective");
         }
       },
       [](const Recipe& r) { return r.checkpointing; }},
      {"memory.activation_budget",
       [](Recipe& r, const std::string& v) {
         const auto b = io::parse_bytes(v);
         if (!b) throw std::invalid_argument("a byte count such as 0, 500000000 or 2GiB");
         r.activation_budget = *b;
       },
       [](const Recipe& r) { return std::to_string(r.activation_budget); }},
      BOOL_FIELD("memory.chunked_loss", chunked_loss),
      INT_FIELD("memory.loss_chunk", loss_chunk, 1),
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
  if (r.beta1 >= 1 || r.beta2 >= 1) bad("optimizer.beta1 and optimizer.beta2 must be below 1");
  if (r.in_backward && r.clip == "global_norm") {
    bad("optimizer.clip global_norm cannot run inside backward in one pass; use global_norm_two_pass or per_param_norm");
  }
  if ((r.schedule == "cosine" || r.schedule == "linear_decay") && r.warmup_steps >= r.steps) {
    bad("schedule.warmup_steps (" + std::to_string(r.warmup_steps) + ") must be below train.steps (" + std::to_string(r.steps) + ")");
  }
  if (r.device != "cpu" && r.device != "cuda" && r.device.rfind("cuda:", 0) != 0) bad("train.device must be cpu, cuda or cuda:N");
  if (r.corpus.empty() && r.tokens.empty()) bad("data.corpus or data.tokens must be set");
}

}  // namespace

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
