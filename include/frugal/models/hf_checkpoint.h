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

// Throws std::invalid_argument naming the file and the key for missing or bad values.
DecoderConfig read_hf_config(const std::string& config_json_path);
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
// read_hf_config, check_hf_weights, make_decoder and load_hf_weights in one.
Decoder load_hf_checkpoint(const std::string& dir, const at::TensorOptions& options = {});

// Writes config.json and the weights, sharded when they exceed max_shard_bytes (0: one file).
// Every file is written atomically.
void save_hf_checkpoint(DecoderImpl& model, const std::string& dir, int64_t max_shard_bytes = 0);

}  // namespace models
}  // namespace frugal
