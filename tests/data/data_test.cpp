// Corpus reading, tokenizer training and round trips, token files (including corrupted ones), and
// deterministic batches.
#include <gtest/gtest.h>
#include <sys/stat.h>

#include <fstream>

#include "frugal/data/corpus.h"
#include "frugal/data/tokenizer.h"

using namespace frugal::data;

namespace {

std::string dir(const std::string& name) {
  const std::string d = ::testing::TempDir() + "/frugal_data_" + name;
  ::mkdir(d.c_str(), 0755);
  return d;
}

std::vector<std::string> sample_docs() {
  std::vector<std::string> docs;
  const char* words[] = {"the", "cat", "sat", "on", "a", "mat", "and", "dog", "ran", "far", "away", "home"};
  for (int i = 0; i < 400; ++i) {
    std::string d;
    for (int j = 0; j < 12; ++j) d += std::string(words[(i * 7 + j * 3) % 12]) + (j == 11 ? ".\n" : " ");
    docs.push_back(d);
  }
  return docs;
}

}  // namespace

TEST(Corpus, SplitsFortuneFilesAndSkipsBinaryAndDuplicates) {
  const std::string d = dir("corpus");
  std::ofstream(d + "/jokes") << "first joke\n%\nsecond\njoke\n%\nthird\n";
  std::ofstream(d + "/jokes.dat") << std::string("\0\1\2binary", 9);
  ::symlink((d + "/jokes").c_str(), (d + "/jokes.u8").c_str());
  std::ofstream(d + "/plain.txt") << "just one document\nwith two lines\n";
  const auto docs = read_corpus(d);
  ASSERT_EQ(docs.size(), 4u);
  EXPECT_EQ(docs[0], "first joke\n");
  EXPECT_EQ(docs[1], "second\njoke\n");
  EXPECT_EQ(docs[3], "just one document\nwith two lines\n");
  EXPECT_THROW(read_corpus(d + "/missing"), std::invalid_argument);
}

TEST(Tokenizer, TrainsAndRoundTrips) {
  const std::string prefix = dir("tok") + "/tok";
  train_tokenizer(sample_docs(), prefix, TokenizerTrainOptions().vocab_size(320));
  const Tokenizer tok = Tokenizer::load(prefix + ".model");
  EXPECT_LE(tok.vocab_size(), 320);
  EXPECT_GT(tok.vocab_size(), 256);  // 256 byte pieces plus merges
  for (const std::string text : {"the cat sat on a mat.", "Zebra 42 £ unseen"}) {
    const auto ids = tok.encode(text);
    EXPECT_FALSE(ids.empty());
    EXPECT_EQ(tok.decode(ids), text);  // byte fallback keeps unseen characters
  }
  EXPECT_THROW(Tokenizer::load(prefix + ".vocab"), std::invalid_argument);
  EXPECT_THROW(tok.decode({1000000}), std::invalid_argument);
}

TEST(TokenFile, WritesReadsAndRejectsCorruption) {
  const std::string d = dir("tokens");
  std::vector<int32_t> tokens;
  for (int i = 0; i < 1000; ++i) tokens.push_back((i * 37) % 50);
  write_token_file(d + "/t.tokens", tokens, 50);
  {
    TokenFile f(d + "/t.tokens");
    EXPECT_EQ(f.size(), 1000);
    EXPECT_EQ(f.vocab_size(), 50);
    EXPECT_EQ(f.tokens()[999].item<int32_t>(), tokens[999]);
  }
  write_token_file(d + "/bad_vocab.tokens", tokens, 10);  // tokens >= vocabulary
  EXPECT_THROW(TokenFile(d + "/bad_vocab.tokens"), std::invalid_argument);
  std::ofstream(d + "/junk.tokens") << "not a token file at all, but long enough";
  EXPECT_THROW(TokenFile(d + "/junk.tokens"), std::invalid_argument);
  std::ifstream in(d + "/t.tokens", std::ios::binary);
  std::string bytes((std::istreambuf_iterator<char>(in)), {});
  std::ofstream(d + "/short.tokens", std::ios::binary) << bytes.substr(0, bytes.size() - 4);
  EXPECT_THROW(TokenFile(d + "/short.tokens"), std::invalid_argument);
}

TEST(TokenDataset, DeterministicBatchesAndSplits) {
  const std::string d = dir("dataset");
  std::vector<int32_t> tokens(2000);
  for (int i = 0; i < 2000; ++i) tokens[i] = i % 97;
  write_token_file(d + "/t.tokens", tokens, 97);
  TokenDataset ds(d + "/t.tokens", 0.1);
  EXPECT_EQ(ds.train_tokens(), 1800);
  EXPECT_EQ(ds.val_tokens(), 200);
  const auto [x1, y1] = ds.train_batch(5, 4, 16, 0);
  const auto [x2, y2] = ds.train_batch(5, 4, 16, 0);
  const auto [x3, y3] = ds.train_batch(6, 4, 16, 0);
  EXPECT_EQ(x1.sizes(), (std::vector<int64_t>{4, 16}));
  EXPECT_TRUE(at::equal(x1, x2));
  EXPECT_FALSE(at::equal(x1, x3));
  EXPECT_TRUE(at::equal(x1.narrow(1, 1, 15), y1.narrow(1, 0, 15)));  // targets are the next tokens
  EXPECT_TRUE(at::equal((x1 + 1) % 97, y1));
  const auto [vx, vy] = ds.val_batch(0, 2, 16);
  EXPECT_EQ(vx[0][0].item<int64_t>(), 1800 % 97);
  EXPECT_THROW(ds.train_batch(0, 1, 5000, 0), std::invalid_argument);
}
