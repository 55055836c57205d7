// The pieces of a tokenizer.json pipeline (private to src/data): UTF-8 helpers, a PCRE2 regex,
// normalizers, pre-tokenizers, the BPE model, decoders and the post-processor. Each is parsed from
// its JSON object by a make_* function that refuses unknown types and fields with an effect by name.
#pragma once

#include <cstdint>
#include <memory>
#include <mutex>
#include <string>
#include <unordered_map>
#include <utility>
#include <vector>

#include "frugal/io/json_value.h"
#include "frugal/io/utf8.h"

namespace frugal {
namespace data {
namespace hf {

// ---- UTF-8 ----
// Throws std::invalid_argument naming the byte offset when `s` is not valid UTF-8.
void check_utf8(const std::string& s, const char* what);
size_t utf8_length(unsigned char lead);  // bytes of the character a lead byte starts (1 for a bad one)
using io::append_utf8;                   // (frugal/io/utf8.h)
// The byte -> printable character table of byte-level BPE (GPT-2), as UTF-8 strings.
const std::vector<std::string>& byte_to_unicode();

// ---- regex (PCRE2 with UTF and Unicode properties) ----
class Regex {
 public:
  Regex(const std::string& pattern, bool literal, const std::string& where);
  ~Regex();
  Regex(const Regex&) = delete;
  Regex& operator=(const Regex&) = delete;
  // Every non-overlapping match in s, as (start, end) byte offsets; an empty match moves on one character.
  std::vector<std::pair<size_t, size_t>> find_all(const std::string& s) const;

 private:
  void* code_ = nullptr;  // pcre2_code_8*
};

// A piece of text on its way through the pipeline; at_origin: it starts at byte 0 of the input
// (Metaspace's prepend_scheme "first" asks this).
struct Piece {
  std::string text;
  bool at_origin = false;
};

// Throws std::invalid_argument "tokenizer.json: <where>: ..." naming the field.
[[noreturn]] void refuse(const std::string& where, const std::string& why);
// Fails when `obj` has a member not in `known`.
void check_fields(const io::JsonValue& obj, const std::string& where, const std::vector<std::string>& known);
const io::JsonValue& need(const io::JsonValue& obj, const std::string& key, const std::string& where);
std::string type_of(const io::JsonValue& obj, const std::string& where);

// ---- normalizers ----
struct Normalizer {
  virtual ~Normalizer() = default;
  virtual void apply(std::string& s) const = 0;
};
std::unique_ptr<Normalizer> make_normalizer(const io::JsonValue& v, const std::string& where);

// ---- pre-tokenizers: split each piece further (in place) ----
struct PreTokenizer {
  virtual ~PreTokenizer() = default;
  virtual void apply(std::vector<Piece>& pieces) const = 0;
};
std::unique_ptr<PreTokenizer> make_pre_tokenizer(const io::JsonValue& v, const std::string& where);

// ---- the BPE model ----
class Bpe {
 public:
  Bpe(const io::JsonValue& model, const std::string& where);
  // Appends the ids of one pre-token (cached for short ones; a heap-based merge, O(n log n)).
  void encode_word(const std::string& word, std::vector<int32_t>& out) const;
  const std::unordered_map<std::string, int32_t>& vocab() const { return vocab_; }

 private:
  struct PairHash {
    size_t operator()(uint64_t k) const { return std::hash<uint64_t>()(k * 0x9E3779B97F4A7C15ull); }
  };
  void merge(const std::string& word, std::vector<int32_t>& out) const;
  std::unordered_map<std::string, int32_t> vocab_;
  std::unordered_map<uint64_t, std::pair<int32_t, int32_t>, PairHash> merges_;  // (left, right) -> (rank, merged id)
  std::vector<int32_t> byte_ids_;                                               // <0xXX> pieces' ids, or empty without byte_fallback
  int32_t unk_ = -1;
  bool fuse_unk_ = false, byte_fallback_ = false, ignore_merges_ = false;
  mutable std::mutex cache_mutex_;
  mutable std::unordered_map<std::string, std::vector<int32_t>> cache_;
};

// ---- decoders: token strings -> text pieces ----
struct Decoder {
  virtual ~Decoder() = default;
  virtual void apply(std::vector<std::string>& tokens) const = 0;
};
std::unique_ptr<Decoder> make_decoder(const io::JsonValue& v, const std::string& where);

// ---- post-processor: the special ids around one sequence ----
struct PostProcessor {
  std::vector<int32_t> before, after;
};
// Adds what `v` puts around a single sequence to `post` (Sequence: each in turn).
void add_post_processor(const io::JsonValue& v, const std::string& where, PostProcessor& post);

// Whether a SentencePiece model (its .model bytes) puts "▁" in front of every text, whatever the text
// starts with: add_dummy_prefix, with whitespace escaped and not treated as a suffix.
bool sentencepiece_prepends_space(const std::string& model_bytes, const std::string& name);

}  // namespace hf
}  // namespace data
}  // namespace frugal
