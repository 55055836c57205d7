// frugal/data/tokenizer.h — SentencePiece tokenizers (the format of Llama's tokenizer.model).
//
// Debian's libsentencepiece is reached through libfrugal_spm.so, loaded privately at first use
// (it carries a protobuf copy that clashes with LibTorch's); it is looked up next to the running
// executable, or at $FRUGAL_SPM_SHIM.
//
//   frugal::data::train_tokenizer(docs, "out/tok", frugal::data::TokenizerTrainOptions().vocab_size(4096));
//   auto tok = frugal::data::Tokenizer::load("out/tok.model");
//   std::vector<int32_t> ids = tok.encode("Hello");   std::string back = tok.decode(ids);
#pragma once

#include <torch/arg.h>

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

namespace frugal {
namespace data {

class Tokenizer {
 public:
  // Throws std::invalid_argument naming the file when it is missing or not a SentencePiece model.
  static Tokenizer load(const std::string& model_path);
  std::vector<int32_t> encode(const std::string& text) const;
  std::string decode(const std::vector<int32_t>& ids) const;
  int64_t vocab_size() const { return vocab_; }
  int32_t bos_id() const { return bos_; }
  int32_t eos_id() const { return eos_; }
  const std::string& path() const { return path_; }

 private:
  std::shared_ptr<void> sp_;  // the SentencePiece processor, behind a privately loaded library
  std::string path_;
  int64_t vocab_ = 0;
  int32_t bos_ = -1, eos_ = -1;
};

struct TokenizerTrainOptions {
  TORCH_ARG(int64_t, vocab_size) = 4096;
  TORCH_ARG(std::string, model_type) = "bpe";  // bpe or unigram
  TORCH_ARG(double, character_coverage) = 1.0;
  TORCH_ARG(bool, byte_fallback) = true;       // unknown characters become bytes, as in Llama's
  TORCH_ARG(int64_t, max_sentences) = 2000000;
};

// Trains on the documents and writes <model_prefix>.model and .vocab, in the frugal-spm-train
// helper (which dies with this process). Throws std::invalid_argument with SentencePiece's reason
// (without its log lines) when it refuses the input, std::runtime_error when the helper fails. The
// temporary corpus and log files in /tmp carry our PID and are removed on every way out.
void train_tokenizer(const std::vector<std::string>& documents, const std::string& model_prefix,
                     const TokenizerTrainOptions& options = {});

// Removes temporary files of train_tokenizer left in `dir` by processes that are dead (killed).
void remove_stale_tokenizer_files(const std::string& dir = "/tmp");

}  // namespace data
}  // namespace frugal
