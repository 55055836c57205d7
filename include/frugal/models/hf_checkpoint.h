// frugal/models/hf_checkpoint.h — Hugging Face checkpoints: config.json + safetensors weights.
//
// Reads and writes a folder with config.json and model.safetensors, or shards with
// model.safetensors.index.json. Llama uses Hugging Face's names and layouts as they are; GPT-2's
// Conv1D weights are transposed on the way in and out. Loading checks every parameter's presence
// and shape and names what is missing or wrong.
//
//   auto cfg = frugal::models::read_hf_config("llama-dir/config.json");
//   auto model = frugal::models::make_decoder(cfg);
//   frugal::models::load_hf_weights(*model, "llama-dir");
//   frugal::models::save_hf_checkpoint(*model, "out-dir", /*max_shard_bytes=*/2LL << 30);
#pragma once

#include <cstdint>
#include <string>
#include <utility>
#include <vector>

#include "frugal/models/decoder.h"

namespace frugal {
namespace models {

// The model a config.json defines (model_type llama or gpt2). Every field that changes the
// computation is honoured (sizes, head_dim, rope_theta, rope_parameters / rope_scaling of types
// default, linear, llama3 and dynamic, norm epsilons, hidden_act / activation_function, biases, tied
// embeddings, the dtype) or refused; fields that do not (ids, dropout, bookkeeping) are kept in
// hf_passthrough. Throws std::invalid_argument naming the file, the field and its value for a
// missing, bad, unsupported or unknown field.
DecoderConfig read_hf_config(const std::string& config_json_path);
// The config.json transformers (4.x and 5) reads back to the same computation: every honoured
// field written out (rope parameters in both layouts), then the config's hf_passthrough fields.
std::string hf_config_json(const DecoderConfig& config, const std::string& torch_dtype = "float32");

// Copies the weights in the folder into the model (converting dtype). Throws std::invalid_argument
// listing missing tensors and shape mismatches; tensors the model has no use for (rotary
// inv_freq buffers, a tied lm_head) are skipped.
// Returns the number of tensors loaded.
int64_t load_hf_weights(DecoderImpl& model, const std::string& dir);

// The parameters a config implies, by name (as DecoderImpl::named_parameters) with their shapes.
std::vector<std::pair<std::string, std::vector<int64_t>>> hf_parameter_shapes(const DecoderConfig& config);
// Checks the folder's weight headers hold every parameter the config implies, with its shape,
// reading no data: a config's sizes are claims, checked before a model of that size is built.
void check_hf_weights(const DecoderConfig& config, const std::string& dir);
// read_hf_config, check_hf_weights, make_decoder and load_hf_weights in one. Parameters take
// options' dtype, or the file's (torch_dtype / dtype) when options name none, or fp32.
Decoder load_hf_checkpoint(const std::string& dir, const at::TensorOptions& options = {});

// Writes config.json and the weights into dir (made when missing), sharded when they exceed
// max_shard_bytes (0: one file). Every file is written atomically.
void save_hf_checkpoint(DecoderImpl& model, const std::string& dir, int64_t max_shard_bytes = 0);

}  // namespace models
}  // namespace frugal
