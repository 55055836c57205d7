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

void load_hf_weights(DecoderImpl& model, const std::string& dir) {
  // name -> shard file
  std::map<std::string, std::string> where;
  const std::string single = dir + "/model.safetensors", index = dir + "/model.safetensors.index.json";
  std::vector<std::string> files;
  if (io::is_regular_file(index)) {
    io::JsonValue j;
    try {
      j = io::parse_json(io::read_file(index));
      for (const auto& [name, file] : j.at("weight_map").members()) {
        const std::string& f = file.as_string();
        if (f.find('/') != std::string::npos || f.find("..") != std::string::npos) {
          throw std::invalid_argument(index + ": shard name '" + f + "' must be a plain file name");
        }
        where[name] = dir + "/" + f;
      }
    } catch (const io::JsonError& e) {
      throw std::invalid_argument(index + ": " + e.what());
    }
  } else if (!io::is_regular_file(single)) {
    throw std::invalid_argument(dir + ": no model.safetensors or model.safetensors.index.json");
  }
  std::map<std::string, std::unique_ptr<io::SafetensorsReader>> readers;
  auto reader_for = [&](const std::string& name) -> io::SafetensorsReader* {
    const std::string file = where.empty() ? single : (where.count(name) ? where[name] : "");
    if (file.empty()) return nullptr;
    auto& r = readers[file];
    try {
      if (!r) r = std::make_unique<io::SafetensorsReader>(file);
    } catch (const io::SafetensorsError& e) {
      throw std::invalid_argument(e.what());
    }
    return r->find(name) ? r.get() : nullptr;
  };
  const std::string arch = model.config().arch;
  std::vector<std::string> missing, wrong;
  struct Source {
    at::Tensor param;
    io::SafetensorsReader* reader;
    std::string name;     // in the file
    bool transposed;      // GPT-2's Conv1D weights are stored (in, out)
  };
  std::vector<Source> sources;
  // Every name and shape is checked against the files' headers before a byte of data is read.
  for (const auto& item : model.named_parameters()) {
    std::string name = item.key();
    io::SafetensorsReader* r = reader_for(name);
    if (!r && arch == "gpt2" && name.rfind("transformer.", 0) == 0) {
      name = name.substr(12);  // some GPT-2 files omit the prefix
      r = reader_for(name);
    }
    if (!r) {
      missing.push_back(item.key());
      continue;
    }
    std::vector<int64_t> shape = r->find(name)->shape;
    const bool transposed = is_conv1d(arch, name) && shape.size() == 2;
    if (transposed) std::swap(shape[0], shape[1]);
    if (!item.value().sizes().equals(shape)) {
      std::ostringstream m;
      m << item.key() << " " << at::IntArrayRef(shape) << " in the file vs " << item.value().sizes() << " in the model";
      wrong.push_back(m.str());
      continue;
    }
    sources.push_back({item.value(), r, name, transposed});
  }
  if (!missing.empty() || !wrong.empty()) {
    std::ostringstream m;
    m << dir << ": the weights do not fit the model.";
    if (!missing.empty()) {
      m << " Missing:";
      for (size_t i = 0; i < missing.size() && i < 10; ++i) m << (i ? ", " : " ") << missing[i];
      if (missing.size() > 10) m << " (and " << missing.size() - 10 << " more)";
      m << ".";
    }
    if (!wrong.empty()) {
      m << " Wrong shapes:";
      for (size_t i = 0; i < wrong.size() && i < 10; ++i) m << (i ? "; " : " ") << wrong[i];
      m << ".";
    }
    throw std::invalid_argument(m.str());
  }
  // One tensor at a time: read it, convert it into the parameter (dtype and device), drop it. The
  // peak is the parameters plus the largest tensor.
  at::NoGradGuard no_grad;
  for (Source& src : sources) {
    at::Tensor t = src.reader->load(src.name);
    src.param.copy_(src.transposed ? t.t() : t);
  }
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
