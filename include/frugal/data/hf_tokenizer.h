// frugal/data/hf_tokenizer.h — Hugging Face tokenizer.json (BPE) tokenizers, as the `tokenizers`
// library runs them: GPT-2's byte-level BPE, Llama-3's (Split regex, ignore_merges), Llama-2's and
// Mistral's SentencePiece-style BPE (Metaspace or Prepend+Replace, byte fallback).
//
// Supported, each field honoured: model BPE (vocab, merges as "a b" or ["a", "b"], unk_token,
// fuse_unk, byte_fallback, ignore_merges); normalizers Sequence, Prepend, Replace, NFC, NFD, NFKC,
// NFKD, Lowercase, Strip; pre-tokenizers Sequence, Split (String or Regex, every behavior, invert),
// ByteLevel, Metaspace, Digits; decoders Sequence, ByteLevel, Metaspace, Replace, ByteFallback,
// Fuse, Strip; post-processors TemplateProcessing (single sequence), ByteLevel, Bert/RobertaProcessing,
// Sequence; added_tokens with lstrip, rstrip, normalized, special. Anything else (another model or
// type, BPE dropout, a word prefix/suffix, single_word, truncation, padding) is refused by name.
//
//   auto tok = frugal::data::HfTokenizer::load("llama3/tokenizer.json");
//   std::vector<int32_t> ids = tok.encode("Hello world", /*add_special_tokens=*/true);   // BOS first
//   std::string text = tok.decode(ids);                                                 // "Hello world"
#pragma once

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

namespace frugal {
namespace data {

// A tokenizer.json BPE tokenizer, loaded and checked; copies share the loaded model.
class HfTokenizer {
 public:
  // Throws std::invalid_argument naming the file and the field when it is missing, malformed or
  // asks for something unsupported.
  static HfTokenizer load(const std::string& path);
  // The same for the JSON text itself; `name` is used in messages.
  static HfTokenizer parse(const std::string& json_text, const std::string& name = "tokenizer.json");

  // The ids of UTF-8 text (std::invalid_argument when it is not UTF-8). Added tokens in the text
  // are recognised (special ones too, as `tokenizers` does); add_special_tokens adds what the
  // post-processor puts around a single sequence (BOS for Llama).
  std::vector<int32_t> encode(const std::string& text, bool add_special_tokens = false) const;
  // Special added tokens are left out unless skip_special_tokens is false. Throws
  // std::invalid_argument for an id outside the vocabulary.
  std::string decode(const std::vector<int32_t>& ids, bool skip_special_tokens = true) const;

  int64_t vocab_size() const;                           // the id space: largest id + 1
  int32_t token_to_id(const std::string& token) const;  // -1 when absent
  std::string id_to_token(int32_t id) const;            // "" when absent
  bool is_special(int32_t id) const;                    // whether `id` is an added token marked special
  // The ids the post-processor puts before and after a single sequence.
  const std::vector<int32_t>& prefix_ids() const;
  const std::vector<int32_t>& suffix_ids() const;  // the ids it puts after one (empty when none)
  const std::string& json() const;                 // the file's text, as read

 private:
  struct Impl;
  std::shared_ptr<const Impl> impl_;
};

// The tokenizer.json equivalent of a SentencePiece BPE model (tokenizer.model), Llama-2 style:
// Prepend "▁" and Replace " " -> "▁", byte fallback, merges ranked by the merged piece's score,
// "<s> $A" when the model has a <s> control piece. It gives SentencePiece's ids for text that does
// not spell a control token ("<s>" in the text is the BOS id here, as in `tokenizers`). Throws
// std::invalid_argument naming what cannot be expressed: a unigram model, a normalization other than
// the identity, removal of extra whitespace.
std::string sentencepiece_to_tokenizer_json(const std::string& model_path);

}  // namespace data
}  // namespace frugal
