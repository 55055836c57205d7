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

namespace {

// The weight files of a folder, opened lazily, and the match of the model's names and shapes
// against their headers (no data is read).
class WeightFiles {
 public:
  explicit WeightFiles(const std::string& dir) : dir_(dir) {
    const std::string index = dir + "/model.safetensors.index.json";
    single_ = dir + "/model.safetensors";
    if (io::path_exists(index)) {  // present but no regular file: refused by read_file
      io::JsonValue j;
      try {
        j = io::parse_json(io::read_file(index, io::kMetadataFileBytes));
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
    } else if (!io::path_exists(single_)) {
      throw std::invalid_argument(dir + ": no model.safetensors or model.safetensors.index.json");
    }
  }

  struct Source {
    size_t index;  // into the list matched
    io::SafetensorsReader* reader;
    std::string name;  // in the file
    bool transposed;   // GPT-2's Conv1D weights are stored (in, out)
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
  // A Linear's weight (out, in) and, when it has one, its bias (out), in named_parameters order.
  auto linear = [&](const std::string& name, int64_t out_features, int64_t in_features, bool bias) {
    add(name + ".weight", {out_features, in_features});
    if (bias) add(name + ".bias", {out_features});
  };
  const int64_t d = c.dim, f = c.ffn_dim, V = c.vocab_size;
  if (c.arch == "gpt2") {
    add("transformer.wte.weight", {V, d});
    add("transformer.wpe.weight", {c.max_seq_len, d});
    for (int64_t i = 0; i < c.n_layers; ++i) {
      const std::string b = "transformer.h." + std::to_string(i) + ".";
      add(b + "ln_1.weight", {d});
      add(b + "ln_1.bias", {d});
      linear(b + "attn.c_attn", 3 * d, d, true);
      linear(b + "attn.c_proj", d, d, true);
      add(b + "ln_2.weight", {d});
      add(b + "ln_2.bias", {d});
      linear(b + "mlp.c_fc", f, d, true);
      linear(b + "mlp.c_proj", d, f, true);
    }
    add("transformer.ln_f.weight", {d});
    add("transformer.ln_f.bias", {d});
  } else {
    const int64_t q = c.n_heads * c.head_dim(), kv = c.n_kv_heads * c.head_dim();
    add("model.embed_tokens.weight", {V, d});
    for (int64_t i = 0; i < c.n_layers; ++i) {
      const std::string b = "model.layers." + std::to_string(i) + ".";
      linear(b + "self_attn.q_proj", q, d, c.attention_bias);
      linear(b + "self_attn.k_proj", kv, d, c.attention_bias);
      linear(b + "self_attn.v_proj", kv, d, c.attention_bias);
      linear(b + "self_attn.o_proj", d, q, c.attention_bias);
      linear(b + "mlp.gate_proj", f, d, c.mlp_bias);
      linear(b + "mlp.up_proj", f, d, c.mlp_bias);
      linear(b + "mlp.down_proj", d, f, c.mlp_bias);
      add(b + "input_layernorm.weight", {d});
      add(b + "post_attention_layernorm.weight", {d});
    }
    add("model.norm.weight", {d});
  }
  if (!c.tie_embeddings) add("lm_head.weight", {V, d});
  return out;
}

void check_hf_weights(const DecoderConfig& config, const std::string& dir) {
  WeightFiles files(dir);
  // Counted first: the list of names itself grows with the config's claims (10^8 layers).
  const bool gpt2 = config.arch == "gpt2";
  const uint64_t per_layer = gpt2 ? 12 : 9 + (config.attention_bias ? 4 : 0) + (config.mlp_bias ? 3 : 0);
  const uint64_t layers = static_cast<uint64_t>(config.n_layers);
  const uint64_t implied = layers * per_layer + (gpt2 ? 4 : 2) + (config.tie_embeddings ? 0 : 1);
  if (layers > (uint64_t{1} << 40) || implied > files.tensor_count()) {
    throw std::invalid_argument(dir + ": config.json implies " + std::to_string(implied) + " tensors (" + std::to_string(layers) +
                                " layers) but the weights hold " + std::to_string(files.tensor_count()));
  }
  files.match(config.arch, hf_parameter_shapes(config));
}

Decoder load_hf_checkpoint(const std::string& dir, const at::TensorOptions& options) {
  const DecoderConfig config = read_hf_config(dir + "/config.json");
  check_hf_weights(config, dir);  // before the model is built: the config's sizes are only claims
  // The file's dtype unless the caller names one.
  at::TensorOptions opts = options;
  if (!options.has_dtype() && config.file_dtype) opts = opts.dtype(*config.file_dtype);
  Decoder model = make_decoder(config, opts, WeightInit::for_loading);  // every parameter is read next
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
  io::make_directories(dir);
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
