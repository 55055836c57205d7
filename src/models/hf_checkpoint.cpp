#include "frugal/models/hf_checkpoint.h"

#include <sys/stat.h>

#include <fstream>
#include <map>
#include <set>
#include <sstream>
#include <stdexcept>

#include "frugal/io/atomic_file.h"
#include "frugal/io/files.h"
#include "frugal/io/json.h"
#include "frugal/io/json_value.h"
#include "frugal/io/safetensors.h"

namespace frugal {
namespace models {
namespace {

// GPT-2 stores its Linear weights as Conv1D (in, out).
bool is_conv1d(const std::string& arch, const std::string& name) {
  if (arch != "gpt2") return false;
  for (const char* suffix : {"attn.c_attn.weight", "attn.c_proj.weight", "mlp.c_fc.weight", "mlp.c_proj.weight"}) {
    const std::string s(suffix);
    if (name.size() >= s.size() && name.compare(name.size() - s.size(), s.size(), s) == 0) return true;
  }
  return false;
}

}  // namespace

DecoderConfig read_hf_config(const std::string& path) {
  io::JsonValue j;
  try {
    j = io::parse_json(io::read_file(path));
  } catch (const io::JsonError& e) {
    throw std::invalid_argument(path + ": " + e.what());
  }
  auto get = [&](const char* key) -> const io::JsonValue& {
    const io::JsonValue* v = j.find(key);
    if (!v) throw std::invalid_argument(path + ": missing key '" + key + "'");
    return *v;
  };
  auto integer = [&](const char* key) {
    const auto& v = get(key);
    if (!v.is_integer()) throw std::invalid_argument(path + ": '" + key + "' must be an integer");
    return v.as_int();
  };
  auto number = [&](const char* key, double fallback) {
    const io::JsonValue* v = j.find(key);
    if (!v || v->is_null()) return fallback;
    if (!v->is_number()) throw std::invalid_argument(path + ": '" + key + "' must be a number");
    return v->as_double();
  };
  if (!j.is_object()) throw std::invalid_argument(path + ": not a JSON object");
  const io::JsonValue* type = j.find("model_type");
  const std::string model_type = type && type->is_string() ? type->as_string() : "llama";
  DecoderConfig c;
  if (model_type == "gpt2") {
    c.arch = "gpt2";
    c.vocab_size = integer("vocab_size");
    c.dim = integer("n_embd");
    c.n_layers = integer("n_layer");
    c.n_heads = c.n_kv_heads = integer("n_head");
    c.max_seq_len = integer("n_positions");
    const io::JsonValue* inner = j.find("n_inner");
    c.ffn_dim = inner && inner->is_integer() ? inner->as_int() : 4 * c.dim;
    c.norm_eps = number("layer_norm_epsilon", 1e-5);
    c.tie_embeddings = true;
  } else if (model_type == "llama") {
    c.arch = "llama";
    c.vocab_size = integer("vocab_size");
    c.dim = integer("hidden_size");
    c.n_layers = integer("num_hidden_layers");
    c.n_heads = integer("num_attention_heads");
    c.n_kv_heads = j.contains("num_key_value_heads") ? integer("num_key_value_heads") : c.n_heads;
    c.ffn_dim = integer("intermediate_size");
    c.max_seq_len = j.contains("max_position_embeddings") ? integer("max_position_embeddings") : 4096;
    c.rope_theta = number("rope_theta", 10000.0);
    c.norm_eps = number("rms_norm_eps", 1e-6);
    const io::JsonValue* tie = j.find("tie_word_embeddings");
    c.tie_embeddings = tie && tie->is_bool() && tie->as_bool();
  } else {
    throw std::invalid_argument(path + ": model_type '" + model_type + "' is not supported (allowed: llama, gpt2)");
  }
  const std::string invalid = c.validate();
  if (!invalid.empty()) throw std::invalid_argument(path + ": " + invalid);
  return c;
}

std::string hf_config_json(const DecoderConfig& c, const std::string& torch_dtype) {
  std::ostringstream out;
  io::JsonWriter w(out);
  w.begin_object();
  if (c.arch == "gpt2") {
    w.key("architectures").begin_array().value("GPT2LMHeadModel").end_array();
    w.key("model_type").value("gpt2");
    w.key("vocab_size").value(c.vocab_size).key("n_embd").value(c.dim).key("n_layer").value(c.n_layers);
    w.key("n_head").value(c.n_heads).key("n_positions").value(c.max_seq_len).key("n_inner").value(c.ffn_dim);
    w.key("layer_norm_epsilon").value(c.norm_eps);
  } else {
    w.key("architectures").begin_array().value("LlamaForCausalLM").end_array();
    w.key("model_type").value("llama");
    w.key("vocab_size").value(c.vocab_size).key("hidden_size").value(c.dim);
    w.key("intermediate_size").value(c.ffn_dim).key("num_hidden_layers").value(c.n_layers);
    w.key("num_attention_heads").value(c.n_heads).key("num_key_value_heads").value(c.n_kv_heads);
    w.key("max_position_embeddings").value(c.max_seq_len).key("rope_theta").value(c.rope_theta);
    w.key("rms_norm_eps").value(c.norm_eps).key("hidden_act").value("silu");
    w.key("tie_word_embeddings").value(c.tie_embeddings);
  }
  w.key("torch_dtype").value(torch_dtype);
  w.end_object();
  return out.str();
}

namespace {

// The weight files of a folder, opened lazily, and the match of the model's names and shapes
// against their headers (no data is read).
class WeightFiles {
 public:
  explicit WeightFiles(const std::string& dir) : dir_(dir) {
    const std::string index = dir + "/model.safetensors.index.json";
    single_ = dir + "/model.safetensors";
    if (io::is_regular_file(index)) {
      io::JsonValue j;
      try {
        j = io::parse_json(io::read_file(index));
        const io::JsonValue* map = j.is_object() ? j.find("weight_map") : nullptr;
        if (!map || !map->is_object()) throw std::invalid_argument(index + ": 'weight_map' must be an object");
        for (const auto& [name, file] : map->members()) {
          if (!file.is_string()) throw std::invalid_argument(index + ": the shard of '" + name + "' must be a string");
          const std::string& f = file.as_string();
          if (f.find('/') != std::string::npos || f.find("..") != std::string::npos) {
            throw std::invalid_argument(index + ": shard name '" + f + "' must be a plain file name");
          }
          where_[name] = dir + "/" + f;
        }
      } catch (const io::JsonError& e) {
        throw std::invalid_argument(index + ": " + e.what());
      }
    } else if (!io::is_regular_file(single_)) {
      throw std::invalid_argument(dir + ": no model.safetensors or model.safetensors.index.json");
    }
  }

  struct Source {
    size_t index;                 // into the list matched
    io::SafetensorsReader* reader;
    std::string name;             // in the file
    bool transposed;              // GPT-2's Conv1D weights are stored (in, out)
  };

  // Every name and shape checked against the headers; throws std::invalid_argument naming what is
  // missing and, for each wrong shape, the tensor and the dimension.
  std::vector<Source> match(const std::string& arch, const std::vector<std::pair<std::string, std::vector<int64_t>>>& params) {
    std::vector<std::string> missing, wrong;
    std::vector<Source> sources;
    for (size_t i = 0; i < params.size(); ++i) {
      std::string name = params[i].first;
      io::SafetensorsReader* r = reader_for(name);
      if (!r && arch == "gpt2" && name.rfind("transformer.", 0) == 0) {
        name = name.substr(12);  // some GPT-2 files omit the prefix
        r = reader_for(name);
      }
      if (!r) {
        missing.push_back(params[i].first);
        continue;
      }
      std::vector<int64_t> shape = r->find(name)->shape;
      const bool transposed = is_conv1d(arch, name) && shape.size() == 2;
      if (transposed) std::swap(shape[0], shape[1]);
      const std::vector<int64_t>& want = params[i].second;
      if (shape != want) {
        std::ostringstream m;
        m << params[i].first << " is " << at::IntArrayRef(shape) << " in the file but " << at::IntArrayRef(want) << " in the model";
        if (shape.size() != want.size()) {
          m << " (" << shape.size() << " dimensions vs " << want.size() << ")";
        } else {
          for (size_t d = 0; d < shape.size(); ++d) {
            if (shape[d] != want[d]) {
              m << " (dimension " << d << ": " << shape[d] << " vs " << want[d] << ")";
              break;
            }
          }
        }
        wrong.push_back(m.str());
        continue;
      }
      sources.push_back({i, r, name, transposed});
    }
    if (!missing.empty() || !wrong.empty()) {
      std::ostringstream m;
      m << dir_ << ": the weights do not fit the model.";
      if (!missing.empty()) {
        m << " Missing:";
        for (size_t i = 0; i < missing.size() && i < 10; ++i) m << (i ? ", " : " ") << missing[i];
        if (missing.size() > 10) m << " (and " << missing.size() - 10 << " more)";
        m << ".";
      }
      if (!wrong.empty()) {
        m << " Wrong shapes:";
        for (size_t i = 0; i < wrong.size() && i < 10; ++i) m << (i ? "; " : " ") << wrong[i];
        if (wrong.size() > 10) m << " (and " << wrong.size() - 10 << " more)";
        m << ".";
      }
      throw std::invalid_argument(m.str());
    }
    return sources;
  }

  // Tensors named in the index, or held by the single file.
  uint64_t tensor_count() {
    if (!where_.empty()) return where_.size();
    reader_for("");
    return readers_.count(single_) ? readers_[single_]->tensors().size() : 0;
  }

 private:
  io::SafetensorsReader* reader_for(const std::string& name) {
    const std::string file = where_.empty() ? single_ : (where_.count(name) ? where_[name] : "");
    if (file.empty()) return nullptr;
    auto& r = readers_[file];
    try {
      if (!r) r = std::make_unique<io::SafetensorsReader>(file);
    } catch (const io::SafetensorsError& e) {
      throw std::invalid_argument(e.what());
    }
    return r->find(name) ? r.get() : nullptr;
  }

  std::string dir_, single_;
  std::map<std::string, std::string> where_;  // name -> shard file
  std::map<std::string, std::unique_ptr<io::SafetensorsReader>> readers_;
};

}  // namespace

std::vector<std::pair<std::string, std::vector<int64_t>>> hf_parameter_shapes(const DecoderConfig& c) {
  std::vector<std::pair<std::string, std::vector<int64_t>>> out;
  auto add = [&](const std::string& name, std::vector<int64_t> shape) { out.emplace_back(name, std::move(shape)); };
  const int64_t d = c.dim, f = c.ffn_dim, V = c.vocab_size;
  if (c.arch == "gpt2") {
    add("transformer.wte.weight", {V, d});
    add("transformer.wpe.weight", {c.max_seq_len, d});
    for (int64_t i = 0; i < c.n_layers; ++i) {
      const std::string b = "transformer.h." + std::to_string(i) + ".";
      add(b + "ln_1.weight", {d});
      add(b + "ln_1.bias", {d});
      add(b + "attn.c_attn.weight", {3 * d, d});
      add(b + "attn.c_attn.bias", {3 * d});
      add(b + "attn.c_proj.weight", {d, d});
      add(b + "attn.c_proj.bias", {d});
      add(b + "ln_2.weight", {d});
      add(b + "ln_2.bias", {d});
      add(b + "mlp.c_fc.weight", {f, d});
      add(b + "mlp.c_fc.bias", {f});
      add(b + "mlp.c_proj.weight", {d, f});
      add(b + "mlp.c_proj.bias", {d});
    }
    add("transformer.ln_f.weight", {d});
    add("transformer.ln_f.bias", {d});
    return out;
  }
  const int64_t hd = c.head_dim();
  add("model.embed_tokens.weight", {V, d});
  for (int64_t i = 0; i < c.n_layers; ++i) {
    const std::string b = "model.layers." + std::to_string(i) + ".";
    add(b + "self_attn.q_proj.weight", {c.n_heads * hd, d});
    add(b + "self_attn.k_proj.weight", {c.n_kv_heads * hd, d});
    add(b + "self_attn.v_proj.weight", {c.n_kv_heads * hd, d});
    add(b + "self_attn.o_proj.weight", {d, c.n_heads * hd});
    add(b + "mlp.gate_proj.weight", {f, d});
    add(b + "mlp.up_proj.weight", {f, d});
    add(b + "mlp.down_proj.weight", {d, f});
    add(b + "input_layernorm.weight", {d});
    add(b + "post_attention_layernorm.weight", {d});
  }
  add("model.norm.weight", {d});
  if (!c.tie_embeddings) add("lm_head.weight", {V, d});
  return out;
}

void check_hf_weights(const DecoderConfig& config, const std::string& dir) {
  WeightFiles files(dir);
  // Counted first: the list of names itself grows with the config's claims (10^8 layers).
  const uint64_t per_layer = config.arch == "gpt2" ? 12 : 9, layers = static_cast<uint64_t>(config.n_layers);
  const uint64_t implied = layers * per_layer + (config.arch == "gpt2" ? 4 : (config.tie_embeddings ? 2 : 3));
  if (layers > (uint64_t{1} << 40) || implied > files.tensor_count()) {
    throw std::invalid_argument(dir + ": config.json implies " + std::to_string(implied) + " tensors (" + std::to_string(layers) +
                                " layers) but the weights hold " + std::to_string(files.tensor_count()));
  }
  files.match(config.arch, hf_parameter_shapes(config));
}

Decoder load_hf_checkpoint(const std::string& dir, const at::TensorOptions& options) {
  const DecoderConfig config = read_hf_config(dir + "/config.json");
  check_hf_weights(config, dir);  // before the model is built: the config's sizes are only claims
  Decoder model = make_decoder(config, options);
  load_hf_weights(*model, dir);
  return model;
}

int64_t load_hf_weights(DecoderImpl& model, const std::string& dir) {
  WeightFiles files(dir);
  std::vector<std::pair<std::string, std::vector<int64_t>>> shapes;
  std::vector<at::Tensor> params;
  for (const auto& item : model.named_parameters()) {
    shapes.emplace_back(item.key(), item.value().sizes().vec());
    params.push_back(item.value());
  }
  const auto sources = files.match(model.config().arch, shapes);  // every header checked before a byte of data is read
  // One tensor at a time: read it, convert it into the parameter (dtype and device), drop it. The
  // peak is the parameters plus the largest tensor.
  at::NoGradGuard no_grad;
  for (const auto& src : sources) {
    at::Tensor t = src.reader->load(src.name);
    params[src.index].copy_(src.transposed ? t.t() : t);
  }
  return static_cast<int64_t>(sources.size());
}

void save_hf_checkpoint(DecoderImpl& model, const std::string& dir, int64_t max_shard_bytes) {
  const auto params = model.named_parameters();
  const at::ScalarType dtype = params.is_empty() ? at::kFloat : params.begin()->value().scalar_type();
  const std::string torch_dtype = dtype == at::kBFloat16 ? "bfloat16" : dtype == at::kHalf ? "float16" : "float32";
  io::write_file_atomic(dir + "/config.json", hf_config_json(model.config(), torch_dtype));
  std::vector<std::vector<std::pair<std::string, at::Tensor>>> shards(1);
  int64_t in_shard = 0;
  for (const auto& item : params) {
    at::Tensor t = item.value().detach();
    if (is_conv1d(model.config().arch, item.key())) t = t.t();
    const int64_t bytes = t.numel() * static_cast<int64_t>(t.element_size());
    if (max_shard_bytes > 0 && in_shard > 0 && in_shard + bytes > max_shard_bytes) {
      shards.emplace_back();
      in_shard = 0;
    }
    shards.back().emplace_back(item.key(), t);
    in_shard += bytes;
  }
  if (shards.size() == 1) {
    io::write_safetensors(dir + "/model.safetensors", shards[0], {{"format", "pt"}});
    return;
  }
  std::ostringstream index;
  io::JsonWriter w(index);
  w.begin_object().key("metadata").begin_object().end_object().key("weight_map").begin_object();
  for (size_t s = 0; s < shards.size(); ++s) {
    char name[64];
    std::snprintf(name, sizeof(name), "model-%05zu-of-%05zu.safetensors", s + 1, shards.size());
    io::write_safetensors(dir + "/" + name, shards[s], {{"format", "pt"}});
    for (const auto& item : shards[s]) w.key(item.first).value(name);
  }
  w.end_object().end_object();
  io::write_file_atomic(dir + "/model.safetensors.index.json", index.str());
}

}  // namespace models
}  // namespace frugal
