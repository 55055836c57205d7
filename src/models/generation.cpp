#include "frugal/models/generation.h"

#include <ATen/ATen.h>
#include <ATen/CPUGeneratorImpl.h>

#include <algorithm>
#include <cmath>
#include <stdexcept>

#include "frugal/io/files.h"
#include "frugal/io/json_value.h"

namespace frugal {
namespace models {

void GenerationOptions::validate() const {
  if (max_new_tokens() < 0) throw std::invalid_argument("max_new_tokens must be >= 0, not " + std::to_string(max_new_tokens()));
  if (!std::isfinite(temperature()) || temperature() < 0) {
    throw std::invalid_argument("temperature must be a finite number >= 0 (0: greedy), not " + std::to_string(temperature()));
  }
  if (top_k() < 0) throw std::invalid_argument("top_k must be >= 0 (0: all tokens), not " + std::to_string(top_k()));
  if (!(top_p() > 0 && top_p() <= 1)) throw std::invalid_argument("top_p must be in (0, 1], not " + std::to_string(top_p()));
}

const char* generation_stop_name(GenerationStop s) {
  switch (s) {
    case GenerationStop::end_of_sequence: return "end-of-sequence token";
    case GenerationStop::token_limit: return "token limit reached";
    case GenerationStop::context_full: return "context full";
  }
  return "?";
}

const char* generation_stop_key(GenerationStop s) {
  switch (s) {
    case GenerationStop::end_of_sequence: return "eos";
    case GenerationStop::token_limit: return "max_new_tokens";
    case GenerationStop::context_full: return "context_full";
  }
  return "?";
}

int64_t choose_next_token(const at::Tensor& logits_in, const GenerationOptions& o, at::Generator& gen) {
  const at::Tensor logits = logits_in.to(at::kCPU, at::kFloat).reshape({-1});  // (V)
  if (logits.isnan().any().item<bool>()) throw std::runtime_error("the model's logits hold NaN");
  if (o.temperature() == 0) return logits.argmax().item<int64_t>();
  // Shifted by the max first: (l - max) <= 0, so dividing by a tiny temperature gives -inf for all
  // but the likeliest (greedy), never +inf; the likeliest stay exactly 0 even when the temperature
  // underflows to 0 in fp32 (0 / 0 would be NaN).
  const at::Tensor shifted = logits - logits.max();                                 // (V)
  at::Tensor scaled = at::where(shifted == 0, shifted, shifted / o.temperature());  // (V)
  const int64_t V = scaled.size(0);
  if (o.top_k() > 0 && o.top_k() < V) {
    const at::Tensor kth = std::get<0>(scaled.topk(o.top_k())).select(0, o.top_k() - 1);
    scaled = scaled.masked_fill(scaled < kth, -INFINITY);
  }
  at::Tensor probs = at::softmax(scaled, 0);  // (V)
  if (o.top_p() < 1) {
    // Keep the likeliest tokens up to and including the one whose cumulative probability first
    // reaches top_p: a token stays when the mass strictly before it is < top_p (the first always).
    const auto sorted = probs.sort(/*dim=*/0, /*descending=*/true);
    const at::Tensor p_sorted = std::get<0>(sorted), order = std::get<1>(sorted);  // (V), (V)
    const at::Tensor before = p_sorted.cumsum(0) - p_sorted;                       // (V)
    const at::Tensor drop_sorted = before >= o.top_p();
    const at::Tensor drop = at::zeros_like(drop_sorted).scatter(0, order, drop_sorted);
    probs = probs.masked_fill(drop, 0);
  }
  return at::multinomial(probs, 1, false, gen).item<int64_t>();
}

Generation generate_ids(DecoderImpl& model, const std::vector<int32_t>& prompt_ids, const GenerationOptions& o) {
  o.validate();
  if (prompt_ids.empty()) throw std::invalid_argument("the prompt must hold at least one token");
  const int64_t vocab = model.config().vocab_size;
  for (int32_t id : prompt_ids) {
    if (id < 0 || id >= vocab) {
      throw std::invalid_argument("prompt token " + std::to_string(id) + " is outside the model's vocabulary [0, " + std::to_string(vocab) +
                                  ")");
    }
  }
  at::NoGradGuard no_grad;
  const bool was_training = model.is_training();
  model.eval();
  const auto device = model.parameters().front().device();
  at::Generator gen = at::make_generator<at::CPUGeneratorImpl>(o.seed());
  const int64_t window = model.config().max_seq_len;
  Generation g;
  KVCache cache;
  // The prompt in one call, then one token per call: x (1, T) -> logits (1, T, V), the last row used.
  at::Tensor x = at::tensor(std::vector<int64_t>(prompt_ids.begin(), prompt_ids.end()), at::kLong).unsqueeze(0).to(device);
  const int64_t n_prompt = static_cast<int64_t>(prompt_ids.size());
  while (static_cast<int64_t>(g.tokens.size()) < o.max_new_tokens()) {
    // The next token would sit at position n_prompt + made: past the window it was never trained.
    if (n_prompt + static_cast<int64_t>(g.tokens.size()) >= window) {
      g.stop = GenerationStop::context_full;
      break;
    }
    const at::Tensor logits = model.logits_with_cache(x, cache).select(1, -1).squeeze(0);  // (V)
    const int64_t next = choose_next_token(logits, o, gen);
    if (std::find(o.eos_ids().begin(), o.eos_ids().end(), next) != o.eos_ids().end()) {
      g.stop = GenerationStop::end_of_sequence;
      break;
    }
    g.tokens.push_back(static_cast<int32_t>(next));
    x = at::full({1, 1}, next, at::TensorOptions().dtype(at::kLong).device(device));  // (1, 1): the next call's input
  }
  if (was_training) model.train();
  return g;
}

Generation generate(DecoderImpl& model, const data::Tokenizer& tok, const std::string& prompt, GenerationOptions o) {
  if (tok.vocab_size() > model.config().vocab_size) {
    throw std::invalid_argument("tokenizer " + tok.path() + " has " + std::to_string(tok.vocab_size()) +
                                " pieces, more than the model's vocab_size " + std::to_string(model.config().vocab_size));
  }
  // The prompt as transformers' tokenizer(prompt) gives it: BOS first when the tokenizer adds one.
  const std::vector<int32_t> ids = tok.encode(prompt, /*add_special_tokens=*/true);
  if (ids.empty()) throw std::invalid_argument("tokenizer " + tok.path() + " adds no BOS, so the prompt must not be empty");
  if (tok.eos_id() >= 0) {
    std::vector<int32_t> eos = o.eos_ids();
    if (std::find(eos.begin(), eos.end(), tok.eos_id()) == eos.end()) eos.push_back(tok.eos_id());
    o.eos_ids(eos);
  }
  Generation g = generate_ids(model, ids, o);
  // Decoded alone, the continuation loses the word boundary SentencePiece marks on its first piece
  // ("isto:"); decoded with the prompt it gets it, and the prompt's own decoding is cut off so the
  // user's prompt is shown exactly as given (decode leaves special tokens such as BOS out).
  std::vector<int32_t> all = ids;
  all.insert(all.end(), g.tokens.begin(), g.tokens.end());
  const std::string prompt_text = tok.decode(ids);
  const std::string text = tok.decode(all);
  g.text = text.compare(0, prompt_text.size(), prompt_text) == 0 ? prompt + text.substr(prompt_text.size()) : text;
  return g;
}

namespace {

// eos_token_id of one JSON file: nullopt-like empty + found=false when the file or key is absent.
bool read_eos(const std::string& path, std::vector<int32_t>* out) {
  if (!io::path_exists(path)) return false;  // present but no regular file: refused by read_file
  io::JsonValue j;
  try {
    j = io::parse_json(io::read_file(path, io::kMetadataFileBytes));
  } catch (const io::JsonError& e) {
    throw std::invalid_argument(path + ": " + e.what());
  }
  const io::JsonValue* v = j.is_object() ? j.find("eos_token_id") : nullptr;
  if (!v) return false;
  out->clear();
  auto add = [&](const io::JsonValue& x) {
    if (!x.is_integer() || x.as_int() < 0 || x.as_int() > INT32_MAX) {
      throw std::invalid_argument(path + ": 'eos_token_id' must be a token id, a list of them, or null");
    }
    out->push_back(static_cast<int32_t>(x.as_int()));
  };
  if (v->is_array()) {
    for (const auto& x : v->items()) add(x);
  } else if (!v->is_null()) {
    add(*v);
  }
  return true;
}

}  // namespace

std::vector<int32_t> checkpoint_eos_ids(const std::string& dir) {
  std::vector<int32_t> ids;
  if (read_eos(dir + "/generation_config.json", &ids)) return ids;
  read_eos(dir + "/config.json", &ids);
  return ids;
}

}  // namespace models
}  // namespace frugal
