// frugal/models/generation.h — continuing a sequence with a decoder: greedy, temperature, top-k, top-p.
//
// The prompt goes through the model in one call, then one token per call (DecoderImpl::logits_with_cache),
// until an end-of-sequence id, max_new_tokens, or the model's max_seq_len. Sampling is deterministic
// for a seed. Filters apply in transformers' order: temperature, then top-k, then top-p.
//
//   auto opts = frugal::models::GenerationOptions().max_new_tokens(20).temperature(0).eos_ids({2});
//   frugal::models::Generation g = frugal::models::generate_ids(*model, {1, 42, 7}, opts);
//   // g.tokens: the continuation's ids; g.stop: why it ended
#pragma once

#include <ATen/core/Generator.h>
#include <torch/arg.h>

#include <cstdint>
#include <string>
#include <vector>

#include "frugal/data/tokenizer.h"
#include "frugal/models/decoder.h"

namespace frugal {
namespace models {

// How generate and generate_ids continue a prompt: length, sampling, seed and stop ids.
struct GenerationOptions {
  TORCH_ARG(int64_t, max_new_tokens) = 64;
  TORCH_ARG(double, temperature) = 0.8;  // 0: greedy; otherwise finite and > 0
  TORCH_ARG(int64_t, top_k) = 0;         // sample among the k likeliest (0: all)
  TORCH_ARG(double, top_p) = 1.0;        // nucleus: the smallest set with probability >= top_p, in (0, 1]
  TORCH_ARG(uint64_t, seed) = 0;
  TORCH_ARG(std::vector<int32_t>, eos_ids) = {};  // any of these ends generation (not included)

 public:  // (TORCH_ARG leaves the struct private)
  // Throws std::invalid_argument naming the first bad value.
  void validate() const;
};

// Why generation ended: an end-of-sequence id, max_new_tokens made, or prompt plus continuation
// filled the model's max_seq_len (positions past it were never trained).
enum class GenerationStop { end_of_sequence, token_limit, context_full };
const char* generation_stop_name(GenerationStop s);  // "end-of-sequence token", ...
const char* generation_stop_key(GenerationStop s);   // "eos", "max_new_tokens", "context_full" (for JSON)

// What generation made, and why it stopped.
struct Generation {
  std::string text;             // generate(): the prompt as given, then the continuation
  std::vector<int32_t> tokens;  // the continuation's ids (end-of-sequence not included)
  GenerationStop stop = GenerationStop::token_limit;
};

// Picks the next id from logits (V) as the options say (validated by the caller). Greedy at
// temperature 0; otherwise logits are shifted by their max before dividing, so a tiny temperature
// becomes greedy instead of overflowing. Throws std::runtime_error on NaN logits.
int64_t choose_next_token(const at::Tensor& logits, const GenerationOptions& options, at::Generator& gen);

// Continues prompt_ids (non-empty, each < vocab_size) as the options say.
Generation generate_ids(DecoderImpl& model, const std::vector<int32_t>& prompt_ids, const GenerationOptions& options);

// Encodes the prompt (BOS first when the tokenizer has one), adds the tokenizer's EOS to the
// options' eos_ids, generates, and decodes the continuation together with the prompt (so
// SentencePiece puts the word boundary between them where the model did).
Generation generate(DecoderImpl& model, const data::Tokenizer& tokenizer, const std::string& prompt, GenerationOptions options);

// The end-of-sequence ids a Hugging Face folder declares: generation_config.json's eos_token_id
// when present, else config.json's (an integer or a list; null or absent: none). Throws
// std::invalid_argument for a value of another type.
std::vector<int32_t> checkpoint_eos_ids(const std::string& dir);

}  // namespace models
}  // namespace frugal
