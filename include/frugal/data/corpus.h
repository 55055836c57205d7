// frugal/data/corpus.h — text documents from a file or a folder, tokens on disk, batches.
//
// A corpus file is split into documents at lines holding only "%" (the fortune format) when it has
// them, and is one document otherwise; a folder is every readable text file below it (binary
// files and duplicate links skipped), in sorted order. Tokens live in a memory-mapped file;
// batches are random windows drawn from a generator seeded by (seed, step), so a resumed run sees
// exactly the batches it would have seen.
//
//   auto made = frugal::data::tokenize_corpus("/usr/share/games/fortunes", tokenizer, "out/fortunes.tokens");
//   frugal::data::TokenDataset ds("out/fortunes.tokens", /*val_fraction=*/0.05);
//   auto [x, y] = ds.train_batch(/*step=*/7, /*batch=*/16, /*seq=*/128, /*seed=*/0);   // (16, 128) each
#pragma once

#include <ATen/ATen.h>

#include <cstddef>
#include <cstdint>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "frugal/data/tokenizer.h"

namespace frugal {
namespace data {

// Every document, in memory (for tokenizer training). Throws std::invalid_argument when the path
// does not exist, a file or folder in it cannot be read, or it holds no text. Each real folder is
// visited once (symlink loops end). A document of whitespace only is none.
std::vector<std::string> read_corpus(const std::string& path);

// What tokenize_corpus wrote: the number of documents and of tokens (each document's EOS included).
struct CorpusTokens {
  int64_t documents = 0, tokens = 0;
};

// Tokenizes every document of the corpus at corpus_path (the documents read_corpus returns, each
// followed by EOS) into the token file at `path`, written atomically. The text is streamed: it is
// read in 64 KiB pieces, encoded in pieces of about piece_bytes split at whitespace (the tokens of
// one call over the whole document), and the tokens go to the file in bounded pieces, so memory
// does not grow with the corpus or with a line's length. Throws as read_corpus does.
CorpusTokens tokenize_corpus(const std::string& corpus_path, const Tokenizer& tokenizer, const std::string& path,
                             size_t piece_bytes = 1 << 16);
// The same for documents in memory (every one tokenized); returns the number of tokens.
int64_t tokenize_documents(const std::vector<std::string>& documents, const Tokenizer& tokenizer, const std::string& path,
                           size_t piece_bytes = 1 << 16);

// Format: "FRUGALTK", u32 version 1, u32 bytes per token (4), u64 vocabulary size, u64 count,
// then count little-endian int32 tokens.
void write_token_file(const std::string& path, const std::vector<int32_t>& tokens, int64_t vocab_size);

// A token file (write_token_file's format), memory-mapped and checked.
class TokenFile {
 public:
  // Maps the file and checks its header, size and every token against the vocabulary. Throws
  // std::invalid_argument naming the problem.
  explicit TokenFile(const std::string& path);
  ~TokenFile();
  TokenFile(const TokenFile&) = delete;
  TokenFile& operator=(const TokenFile&) = delete;
  // The number of tokens in the file.
  int64_t size() const { return count_; }
  // The vocabulary size from the header; every token is below it.
  int64_t vocab_size() const { return vocab_; }
  // All tokens as an int32 tensor over the mapping (no copy; valid while this object lives).
  const at::Tensor& tokens() const { return tokens_; }

 private:
  void* map_ = nullptr;
  size_t map_bytes_ = 0;
  int64_t count_ = 0, vocab_ = 0;
  at::Tensor tokens_;
};

// A token file split into a training and a validation part, and batches of windows from each.
class TokenDataset {
 public:
  // The last val_fraction of the tokens is the validation split.
  TokenDataset(const std::string& token_file, double val_fraction);
  // The number of tokens in the training split (the file's first ones).
  int64_t train_tokens() const { return train_end_; }
  // The number of tokens in the validation split (the rest).
  int64_t val_tokens() const { return file_->size() - train_end_; }
  // The token file's vocabulary size.
  int64_t vocab_size() const { return file_->vocab_size(); }
  // inputs, targets: (B, T) int64; windows start at random positions of the training split.
  std::pair<at::Tensor, at::Tensor> train_batch(int64_t step, int64_t batch, int64_t seq, uint64_t seed) const;
  // The index-th batch of consecutive windows through the validation split (wrapping around).
  std::pair<at::Tensor, at::Tensor> val_batch(int64_t index, int64_t batch, int64_t seq) const;

 private:
  std::pair<at::Tensor, at::Tensor> gather(const std::vector<int64_t>& starts, int64_t seq) const;
  std::shared_ptr<TokenFile> file_;
  int64_t train_end_ = 0;
};

}  // namespace data
}  // namespace frugal
