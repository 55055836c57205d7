// config.json <-> DecoderConfig: every field that changes the computation honoured or refused by
// name; fields that do not are kept (DecoderConfig::hf_passthrough) and written back.
#include <map>
#include <set>
#include <sstream>
#include <stdexcept>

#include "frugal/io/files.h"
#include "frugal/io/json.h"
#include "frugal/io/json_value.h"
#include "frugal/models/hf_checkpoint.h"

namespace frugal {
namespace models {
namespace {

// Fields of any model type that do not change what the model computes: ids, bookkeeping, defaults
// of generation (transformers 4 kept them in the model's config), output switches.
const std::set<std::string> kHarmless = {"architectures",
                                         "transformers_version",
                                         "initializer_range",
                                         "use_cache",
                                         "bos_token_id",
                                         "eos_token_id",
                                         "pad_token_id",
                                         "sep_token_id",
                                         "decoder_start_token_id",
                                         "output_attentions",
                                         "output_hidden_states",
                                         "return_dict",
                                         "torchscript",
                                         "_name_or_path",
                                         "id2label",
                                         "label2id",
                                         "problem_type",
                                         "finetuning_task",
                                         "tokenizer_class",
                                         "prefix",
                                         "task_specific_params",
                                         "max_length",
                                         "min_length",
                                         "do_sample",
                                         "early_stopping",
                                         "num_beams",
                                         "num_beam_groups",
                                         "diversity_penalty",
                                         "temperature",
                                         "top_k",
                                         "top_p",
                                         "typical_p",
                                         "repetition_penalty",
                                         "length_penalty",
                                         "no_repeat_ngram_size",
                                         "encoder_no_repeat_ngram_size",
                                         "bad_words_ids",
                                         "num_return_sequences",
                                         "output_scores",
                                         "return_dict_in_generate",
                                         "forced_bos_token_id",
                                         "forced_eos_token_id",
                                         "remove_invalid_values",
                                         "exponential_decay_length_penalty",
                                         "suppress_tokens",
                                         "begin_suppress_tokens",
                                         "tf_legacy_loss",
                                         "use_bfloat16",
                                         "chunk_size_feed_forward",
                                         "tie_encoder_decoder",
                                         "is_decoder",
                                         "cross_attention_hidden_size",
                                         "pruned_heads",
                                         "is_encoder_decoder",
                                         "add_cross_attention"};

// Fields each model type reads (their meaning is checked below), and its dropout fields.
const std::map<std::string, std::set<std::string>> kModelKeys = {
    {"llama",
     {"vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads", "hidden_act",
      "max_position_embeddings", "rms_norm_eps", "rope_theta", "rope_scaling", "rope_parameters", "attention_bias", "mlp_bias", "head_dim",
      "tie_word_embeddings",
      // pretraining_tp > 1 splits each projection into slices and adds their products: the same
      // product up to rounding, so it is accepted (and kept).
      "pretraining_tp", "attention_dropout"}},
    {"gpt2",
     {"vocab_size", "n_positions", "n_embd", "n_layer", "n_head", "n_inner", "activation_function", "layer_norm_epsilon",
      "scale_attn_weights", "scale_attn_by_inverse_layer_idx", "tie_word_embeddings",
      // reorder_and_upcast_attn changes only the rounding of attention's product (numerics), n_ctx
      // is an unused legacy copy of n_positions, summary_* belong to the double-heads model.
      "reorder_and_upcast_attn", "n_ctx", "summary_type", "summary_use_proj", "summary_activation", "summary_proj_to_labels",
      "summary_first_dropout", "resid_pdrop", "embd_pdrop", "attn_pdrop"}}};
const std::set<std::string> kDropout = {"attention_dropout", "resid_pdrop", "embd_pdrop", "attn_pdrop"};
// Kept and written back as they came: harmless fields and the model's own that frugal does not model.
const std::set<std::string> kPassThrough = {"pretraining_tp",
                                            "reorder_and_upcast_attn",
                                            "n_ctx",
                                            "summary_type",
                                            "summary_use_proj",
                                            "summary_activation",
                                            "summary_proj_to_labels",
                                            "summary_first_dropout",
                                            "attention_dropout",
                                            "resid_pdrop",
                                            "embd_pdrop",
                                            "attn_pdrop"};

std::string json_text(const io::JsonValue& v);

void write_value(io::JsonWriter& w, const io::JsonValue& v) {
  if (v.is_null()) {
    w.null();
  } else if (v.is_bool()) {
    w.value(v.as_bool());
  } else if (v.is_integer()) {
    w.value(v.as_int());
  } else if (v.is_number()) {
    w.value(v.as_double());
  } else if (v.is_string()) {
    w.value(v.as_string());
  } else if (v.is_array()) {
    w.begin_array();
    for (const auto& item : v.items()) write_value(w, item);
    w.end_array();
  } else {
    w.begin_object();
    for (const auto& [k, item] : v.members()) write_value(w.key(k), item);
    w.end_object();
  }
}

std::string json_text(const io::JsonValue& v) {
  std::ostringstream out;
  io::JsonWriter w(out, 0);
  write_value(w, v);
  return out.str();
}

// Typed access to one JSON object's fields, each error naming the file and the field.
struct Fields {
  const io::JsonValue& j;
  std::string where;  // "path" or "path: rope_parameters"
  [[noreturn]] void bad(const std::string& key, const std::string& what) const {
    throw std::invalid_argument(where + ": '" + key + "' " + what);
  }
  const io::JsonValue* find(const std::string& key) const {
    const io::JsonValue* v = j.find(key);
    return v && !v->is_null() ? v : nullptr;
  }
  int64_t integer(const std::string& key, std::optional<int64_t> fallback = std::nullopt) const {
    const io::JsonValue* v = find(key);
    if (!v) {
      if (!fallback) bad(key, "is missing");
      return *fallback;
    }
    if (!v->is_integer()) bad(key, "must be an integer, got " + json_text(*v));
    return v->as_int();
  }
  double number(const std::string& key, double fallback) const {
    const io::JsonValue* v = find(key);
    if (!v) return fallback;
    if (!v->is_number()) bad(key, "must be a number, got " + json_text(*v));
    return v->as_double();
  }
  bool boolean(const std::string& key, bool fallback) const {
    const io::JsonValue* v = find(key);
    if (!v) return fallback;
    if (!v->is_bool()) bad(key, "must be true or false, got " + json_text(*v));
    return v->as_bool();
  }
  std::string string(const std::string& key, const std::string& fallback) const {
    const io::JsonValue* v = find(key);
    if (!v) return fallback;
    if (!v->is_string()) bad(key, "must be a string, got " + json_text(*v));
    return v->as_string();
  }
};

// rope_parameters (transformers 5) or rope_scaling (4.x) into c: the type and its numbers.
void read_rope(const Fields& f, const char* key, DecoderConfig& c, std::set<std::string>& seen) {
  const io::JsonValue* v = f.find(key);
  if (!v) return;
  if (!v->is_object()) f.bad(key, "must be an object, got " + json_text(*v));
  const Fields r{*v, f.where + ": " + key};
  static const std::set<std::string> known = {"rope_type",
                                              "type",
                                              "rope_theta",
                                              "factor",
                                              "low_freq_factor",
                                              "high_freq_factor",
                                              "original_max_position_embeddings",
                                              "attention_factor",
                                              "partial_rotary_factor"};
  for (const auto& [k, unused] : v->members()) {
    (void)unused;
    if (!known.count(k)) r.bad(k, "is not supported (frugal honours rope types default, linear, llama3 and dynamic)");
  }
  // A number given twice (rope_parameters and rope_scaling, or rope_theta beside them) must agree.
  auto set = [&](const std::string& name, double value, double& into) {
    if (seen.count(name) && into != value)
      r.bad(name, "is " + json_text(*r.find(name)) + " but another field says " + std::to_string(into));
    seen.insert(name);
    into = value;
  };
  const std::string type = r.string("rope_type", r.string("type", "default"));
  if (r.find("rope_type") && r.find("type") && r.string("type", "") != type) r.bad("type", "disagrees with rope_type '" + type + "'");
  if (type != "default" && type != "linear" && type != "llama3" && type != "dynamic") {
    r.bad("rope_type", "'" + type + "' is not supported (allowed: default, linear, llama3, dynamic)");
  }
  if (seen.count("rope_type") && c.rope_scaling.type != type)
    r.bad("rope_type", "'" + type + "' disagrees with '" + c.rope_scaling.type + "'");
  seen.insert("rope_type");
  c.rope_scaling.type = type;
  if (r.find("rope_theta")) set("rope_theta", r.number("rope_theta", 0), c.rope_theta);
  for (const char* unit : {"attention_factor", "partial_rotary_factor"}) {
    if (r.find(unit) && r.number(unit, 1.0) != 1.0) r.bad(unit, json_text(*r.find(unit)) + " is not supported (only 1.0)");
  }
  if (type == "default") {
    if (r.number("factor", 1.0) != 1.0) r.bad("factor", "has no meaning for rope_type default");
    return;
  }
  if (!r.find("factor")) r.bad("factor", "is missing (rope_type " + type + " needs it)");
  set("factor", r.number("factor", 1.0), c.rope_scaling.factor);
  if (type == "llama3") {
    double orig = static_cast<double>(c.rope_scaling.original_max_position_embeddings);
    set("original_max_position_embeddings", static_cast<double>(r.integer("original_max_position_embeddings")), orig);
    c.rope_scaling.original_max_position_embeddings = static_cast<int64_t>(orig);
    set("low_freq_factor", r.number("low_freq_factor", 1.0), c.rope_scaling.low_freq_factor);
    set("high_freq_factor", r.number("high_freq_factor", 4.0), c.rope_scaling.high_freq_factor);
  } else if (r.find("low_freq_factor") || r.find("high_freq_factor")) {
    r.bad(r.find("low_freq_factor") ? "low_freq_factor" : "high_freq_factor", "has no meaning for rope_type " + type);
  } else if (r.find("original_max_position_embeddings")) {
    if (type != "dynamic") r.bad("original_max_position_embeddings", "has no meaning for rope_type " + type);
    c.rope_scaling.original_max_position_embeddings = r.integer("original_max_position_embeddings");
  }
}

std::string activation_from_hf(const Fields& f, const char* key, const std::string& fallback) {
  const std::string a = f.string(key, fallback);
  if (a == "silu" || a == "swish") return "silu";
  if (a == "gelu") return "gelu";
  if (a == "gelu_new" || a == "gelu_pytorch_tanh") return "gelu_tanh";
  f.bad(key, "'" + a + "' is not supported (allowed: silu, gelu, gelu_new, gelu_pytorch_tanh)");
}

}  // namespace

DecoderConfig read_hf_config(const std::string& path) {
  io::JsonValue j;
  try {
    j = io::parse_json(io::read_file(path, io::kMetadataFileBytes));
  } catch (const io::JsonError& e) {
    throw std::invalid_argument(path + ": " + e.what());
  }
  if (!j.is_object()) throw std::invalid_argument(path + ": not a JSON object");
  const Fields f{j, path};
  const std::string model_type = f.string("model_type", "");
  const auto known = kModelKeys.find(model_type);
  if (known == kModelKeys.end()) {
    f.bad("model_type", "'" + model_type + "' is not supported (allowed: llama, gpt2)");
  }
  DecoderConfig c;
  for (const auto& [key, value] : j.members()) {
    const bool harmless = kHarmless.count(key) > 0;
    if (!harmless && !known->second.count(key) && key != "model_type" && key != "torch_dtype" && key != "dtype") {
      f.bad(key, "is not a field frugal knows for model_type " + model_type + ", so it cannot honour it");
    }
    if (kDropout.count(key) && !value.is_null()) {
      const double p = f.number(key, 0.0);
      if (p > c.dropout) c.dropout = p, c.dropout_field = key;
    }
    if ((harmless && key != "architectures") || kPassThrough.count(key)) c.hf_passthrough.emplace_back(key, json_text(value));
  }
  // Harmless only in their neutral values.
  if (f.boolean("is_encoder_decoder", false)) f.bad("is_encoder_decoder", "true is not supported (decoder-only models)");
  if (f.boolean("add_cross_attention", false)) f.bad("add_cross_attention", "true is not supported (no cross-attention)");
  if (const io::JsonValue* p = f.find("pruned_heads"); p && !(p->is_object() && p->members().empty())) {
    f.bad("pruned_heads", "is not supported (pruned attention heads)");
  }
  for (const char* key : {"torch_dtype", "dtype"}) {
    const std::string d = f.string(key, "");
    if (d.empty() || d == "auto") continue;
    const std::optional<at::ScalarType> t = d == "float32"    ? at::kFloat
                                            : d == "bfloat16" ? at::kBFloat16
                                            : d == "float16"  ? at::kHalf
                                                              : std::optional<at::ScalarType>();
    if (!t) f.bad(key, "'" + d + "' is not supported (allowed: float32, bfloat16, float16)");
    if (c.file_dtype && *c.file_dtype != *t) f.bad(key, "'" + d + "' disagrees with the other dtype field");
    c.file_dtype = t;
  }
  if (model_type == "gpt2") {
    c.arch = "gpt2";
    c.vocab_size = f.integer("vocab_size");
    c.dim = f.integer("n_embd");
    c.n_layers = f.integer("n_layer");
    c.n_heads = c.n_kv_heads = f.integer("n_head");
    c.max_seq_len = f.integer("n_positions");
    c.ffn_dim = f.integer("n_inner", 4 * c.dim);
    c.norm_eps = f.number("layer_norm_epsilon", 1e-5);
    c.activation = activation_from_hf(f, "activation_function", "gelu_new");
    c.tie_embeddings = f.boolean("tie_word_embeddings", true);
    if (!f.boolean("scale_attn_weights", true))
      f.bad("scale_attn_weights", "false is not supported (attention is scaled by 1/sqrt(head size))");
    if (f.boolean("scale_attn_by_inverse_layer_idx", false)) f.bad("scale_attn_by_inverse_layer_idx", "true is not supported");
    // GPT-2's transformers defaults are 0.1: a file that names no dropout has it (and says so when written back).
    for (const char* key : {"resid_pdrop", "embd_pdrop", "attn_pdrop"}) {
      if (j.find(key)) continue;
      c.hf_passthrough.emplace_back(key, "0.1");
      if (0.1 > c.dropout) c.dropout = 0.1, c.dropout_field = std::string(key) + " (transformers' default)";
    }
  } else {
    c.arch = "llama";
    c.vocab_size = f.integer("vocab_size");
    c.dim = f.integer("hidden_size");
    c.n_layers = f.integer("num_hidden_layers");
    c.n_heads = f.integer("num_attention_heads");
    c.n_kv_heads = f.integer("num_key_value_heads", c.n_heads);
    c.ffn_dim = f.integer("intermediate_size");
    c.max_seq_len = f.integer("max_position_embeddings", 2048);
    c.norm_eps = f.number("rms_norm_eps", 1e-6);
    c.activation = activation_from_hf(f, "hidden_act", "silu");
    c.attention_bias = f.boolean("attention_bias", false);
    c.mlp_bias = f.boolean("mlp_bias", false);
    c.tie_embeddings = f.boolean("tie_word_embeddings", false);
    if (f.find("head_dim")) {
      c.explicit_head_dim = f.integer("head_dim");
      if (c.explicit_head_dim < 1) f.bad("head_dim", "must be positive, got " + std::to_string(c.explicit_head_dim));
    } else if (c.n_heads > 0 && c.dim % c.n_heads != 0) {
      f.bad("num_attention_heads",
            std::to_string(c.n_heads) + " does not divide hidden_size " + std::to_string(c.dim) + " and there is no head_dim");
    }
    if (c.explicit_head_dim == c.dim / std::max<int64_t>(1, c.n_heads) && c.dim % std::max<int64_t>(1, c.n_heads) == 0) {
      c.explicit_head_dim = 0;  // the derived size: nothing to say
    }
    std::set<std::string> seen;
    if (f.find("rope_theta")) {
      c.rope_theta = f.number("rope_theta", 10000.0);
      seen.insert("rope_theta");
    }
    read_rope(f, "rope_parameters", c, seen);
    read_rope(f, "rope_scaling", c, seen);
    if (f.integer("pretraining_tp", 1) < 1) f.bad("pretraining_tp", "must be >= 1");
  }
  const std::string invalid = c.validate();
  if (!invalid.empty()) throw std::invalid_argument(path + ": " + invalid);
  return c;
}

std::string hf_config_json(const DecoderConfig& c, const std::string& torch_dtype) {
  std::ostringstream out;
  io::JsonWriter w(out);
  std::set<std::string> written;
  auto key = [&](const std::string& k) -> io::JsonWriter& {
    written.insert(k);
    return w.key(k);
  };
  const std::string act = c.resolved_activation();
  w.begin_object();
  if (c.arch == "gpt2") {
    key("architectures").begin_array().value("GPT2LMHeadModel").end_array();
    key("model_type").value("gpt2");
    key("vocab_size").value(c.vocab_size);
    key("n_embd").value(c.dim);
    key("n_layer").value(c.n_layers);
    key("n_head").value(c.n_heads);
    key("n_positions").value(c.max_seq_len);
    key("n_inner").value(c.ffn_dim);
    key("layer_norm_epsilon").value(c.norm_eps);
    key("activation_function").value(act == "gelu_tanh" ? "gelu_new" : act);
    key("tie_word_embeddings").value(c.tie_embeddings);
    key("scale_attn_weights").value(true);
    key("scale_attn_by_inverse_layer_idx").value(false);
  } else {
    key("architectures").begin_array().value("LlamaForCausalLM").end_array();
    key("model_type").value("llama");
    key("vocab_size").value(c.vocab_size);
    key("hidden_size").value(c.dim);
    key("intermediate_size").value(c.ffn_dim);
    key("num_hidden_layers").value(c.n_layers);
    key("num_attention_heads").value(c.n_heads);
    key("num_key_value_heads").value(c.n_kv_heads);
    key("head_dim").value(c.head_dim());
    key("max_position_embeddings").value(c.max_seq_len);
    key("rms_norm_eps").value(c.norm_eps);
    key("hidden_act").value(act == "gelu_tanh" ? "gelu_pytorch_tanh" : act);
    key("attention_bias").value(c.attention_bias);
    key("mlp_bias").value(c.mlp_bias);
    key("tie_word_embeddings").value(c.tie_embeddings);
    key("rope_theta").value(c.rope_theta);
    // transformers 5's layout (it reads rope_theta inside it); 4.x reads rope_theta and rope_scaling.
    const RopeScaling& r = c.rope_scaling;
    auto rope = [&](const char* name, bool with_theta) {
      key(name).begin_object().key("rope_type").value(r.type);
      if (with_theta) w.key("rope_theta").value(c.rope_theta);
      if (r.type != "default") w.key("factor").value(r.factor);
      if (r.type == "llama3") {
        w.key("low_freq_factor").value(r.low_freq_factor).key("high_freq_factor").value(r.high_freq_factor);
      }
      if (r.original_max_position_embeddings > 0) w.key("original_max_position_embeddings").value(r.original_max_position_embeddings);
      w.end_object();
    };
    rope("rope_parameters", true);
    if (r.type != "default") rope("rope_scaling", false);
  }
  // Dropout frugal does not run: 0 unless the file it came from said otherwise (kept below).
  for (const char* k : c.arch == "gpt2" ? std::vector<const char*>{"resid_pdrop", "embd_pdrop", "attn_pdrop"}
                                        : std::vector<const char*>{"attention_dropout"}) {
    bool kept = false;
    for (const auto& p : c.hf_passthrough) kept = kept || p.first == k;
    if (!kept) key(k).value(0.0);
  }
  key("torch_dtype").value(torch_dtype);
  for (const auto& [k, text] : c.hf_passthrough) {
    if (written.count(k)) continue;
    written.insert(k);
    write_value(w.key(k), io::parse_json(text));
  }
  w.end_object();
  return out.str();
}

}  // namespace models
}  // namespace frugal
