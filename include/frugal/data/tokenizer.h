// frugal/data/tokenizer.h — a model's tokenizer: a SentencePiece tokenizer.model or a Hugging Face
// tokenizer.json (see hf_tokenizer.h), behind one API, and what a model folder holds for it.
//
// Debian's libsentencepiece is reached through libfrugal_spm.so, loaded privately at first use
// (it carries a protobuf copy that clashes with LibTorch's); it is looked up next to the running
// executable, or at $FRUGAL_SPM_SHIM.
//
//   frugal::data::train_tokenizer(docs, "out/tok", frugal::data::TokenizerTrainOptions().vocab_size(4096));
//   auto tok = frugal::data::Tokenizer::load("out/tok.model");        // or a tokenizer.json, or a folder
//   std::vector<int32_t> ids = tok.encode("Hello");   std::string back = tok.decode(ids);
//   tok.save_folder("out/model");   // tokenizer.json (+ tokenizer.model) + tokenizer_config.json
//   auto same = frugal::data::Tokenizer::load_folder("out/model");    // AutoTokenizer reads it too
#pragma once

#include <torch/arg.h>

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

namespace frugal {
namespace data {

class HfTokenizer;

// A model's tokenizer, SentencePiece or tokenizer.json, behind one API; copies share the loaded model.
class Tokenizer {
 public:
  // A SentencePiece .model, a tokenizer.json (a file whose name ends in .json) or a model folder
  // (load_folder). Throws std::invalid_argument naming the file when it is missing or malformed.
  static Tokenizer load(const std::string& path);
  // A model folder's tokenizer: tokenizer.json when present, else tokenizer.model; tokenizer_config.json's
  // bos_token / eos_token / add_bos_token (and add_eos_token) honoured. Throws std::invalid_argument naming the file.
  static Tokenizer load_folder(const std::string& dir);
  // Whether `dir` holds a tokenizer.json or a tokenizer.model.
  static bool folder_has_tokenizer(const std::string& dir);
  // Writes what AutoTokenizer needs to read this tokenizer back with the same ids: the tokenizer file(s)
  // and tokenizer_config.json (atomic file writes). A SentencePiece BPE model with identity
  // normalization gets its tokenizer.json equivalent beside tokenizer.model (transformers' own
  // conversion of a bare tokenizer.model differs from SentencePiece on leading spaces).
  void save_folder(const std::string& dir) const;

  // The ids of UTF-8 text (std::invalid_argument when it is not UTF-8); add_special_tokens adds BOS
  // (and EOS) as add_bos() (add_eos()) say, or a tokenizer.json's post-processor when the config is silent.
  std::vector<int32_t> encode(const std::string& text, bool add_special_tokens = false) const;
  // Special tokens left out; tokenizer_config.json's clean_up_tokenization_spaces applied.
  std::string decode(const std::vector<int32_t>& ids) const;
  // The id space (added tokens included).
  int64_t vocab_size() const { return vocab_; }
  // The BOS id, -1 when there is none.
  int32_t bos_id() const { return bos_; }
  // The EOS id, -1 when there is none.
  int32_t eos_id() const { return eos_; }
  // Whether the model expects BOS before a text (what encode() adds with add_special_tokens).
  bool add_bos() const { return add_bos_; }
  // Whether the model expects EOS after a text (what encode() adds with add_special_tokens).
  bool add_eos() const { return add_eos_; }
  // The tokenizer.model or tokenizer.json file it was loaded from.
  const std::string& path() const { return path_; }
  // The folder's chat template (chat_template.jinja, else tokenizer_config.json's chat_template when it
  // is a string; "" otherwise); save_folder writes it back into tokenizer_config.json.
  const std::string& chat_template() const { return chat_template_; }
  // The id of a token's spelling ("</s>", "<|im_end|>"), -1 when the tokenizer has no such token;
  // id_to_token is the inverse ("" for an id it lacks).
  int32_t token_to_id(const std::string& token) const;
  std::string id_to_token(int32_t id) const;  // the spelling of `id`, "" when out of range
  // Whether encode() turns the spelling of an added or special token in the text into its id (a
  // tokenizer.json, as `tokenizers` does); SentencePiece spells control tokens out piece by piece.
  bool recognizes_special_tokens() const { return hf_ != nullptr; }
  // Whether every encode call puts a word-start mark in front of the text, whatever it starts with
  // (SentencePiece's dummy prefix, a Prepend normalizer; not Metaspace, which adds none to a text
  // starting with a space): a text cut in pieces before a space then encodes as a whole when each
  // later piece drops that one space.
  bool prepends_space() const { return prepends_space_; }
  // A hash of everything that decides the ids (the tokenizer's file(s) and EOS): token files made
  // with another tokenizer are told apart by it.
  const std::string& fingerprint() const { return fingerprint_; }

 private:
  std::shared_ptr<void> sp_;               // the SentencePiece processor, behind a privately loaded library
  std::shared_ptr<const HfTokenizer> hf_;  // or a tokenizer.json
  std::string path_, spm_bytes_;           // spm_bytes_: the .model file, for save_folder
  int64_t vocab_ = 0;
  int32_t bos_ = -1, eos_ = -1;
  bool add_bos_ = false, add_eos_ = false, config_add_special_ = false, prepends_space_ = false;
  bool clean_up_spaces_ = false;  // tokenizer_config.json's clean_up_tokenization_spaces (decode only)
  std::string chat_template_;     // tokenizer_config.json's chat_template (a string), written back by save_folder
  std::string fingerprint_;
  static Tokenizer load_sentencepiece(const std::string& model_path);
  static Tokenizer load_json(const std::string& json_path);
  std::string token_text(int32_t id) const;
  std::vector<int32_t> encode_sentencepiece(const std::string& text) const;
  std::string decode_raw(const std::vector<int32_t>& ids) const;  // before the clean-up
  int32_t token_id(const std::string& token) const;
};

// SentencePiece training settings for train_tokenizer.
struct TokenizerTrainOptions {
  TORCH_ARG(int64_t, vocab_size) = 4096;
  TORCH_ARG(std::string, model_type) = "bpe";  // bpe or unigram
  TORCH_ARG(double, character_coverage) = 1.0;
  TORCH_ARG(bool, byte_fallback) = true;  // unknown characters become bytes, as in Llama's
  TORCH_ARG(int64_t, max_sentences) = 2000000;
};
// Trained as Llama's is: identity normalization, whitespace kept as it is (runs of spaces, tabs,
// newlines; remove_extra_whitespaces=false, allow_whitespace_only_pieces=true), a "▁" in front of the
// text (add_dummy_prefix), digits split, <unk>=0 <s>=1 </s>=2. Such a model saves as an exact
// tokenizer.json (save_folder).

// Trains on the documents and writes <model_prefix>.model and .vocab, in the frugal-spm-train
// helper (which dies with this process). Throws std::invalid_argument with SentencePiece's reason
// (without its log lines) when it refuses the input, std::runtime_error when the helper fails. The
// temporary corpus and log live in an io::TempDir (its name carries our PID), removed on every way
// out, SIGINT, SIGTERM and SIGHUP included.
void train_tokenizer(const std::vector<std::string>& documents, const std::string& model_prefix, const TokenizerTrainOptions& options = {});

// train_tokenizer's temporary folder: <$TMPDIR or /tmp>/frugal-tokenizer-<pid>-XXXXXX (an io::TempDir).
constexpr const char* kTokenizerTempPrefix = "frugal-tokenizer";
// Removes temporary folders of train_tokenizer left in `dir` by processes that are dead (killed
// with SIGKILL; other signals remove them as they end). train_tokenizer does this itself. An empty
// `dir` is io::TempDir::base() ($TMPDIR, or /tmp), where train_tokenizer makes its folder.
void remove_stale_tokenizer_files(const std::string& dir = "");

}  // namespace data
}  // namespace frugal
