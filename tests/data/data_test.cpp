// Corpus reading, tokenizer training and round trips, token files (including corrupted ones), and
// deterministic batches.
#include <dirent.h>
#include <gtest/gtest.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <cstdio>
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

TEST(Corpus, SymlinkLoopsEndAndEachFileIsReadOnce) {
  const std::string d = dir("loops");
  ::mkdir((d + "/sub").c_str(), 0755);
  std::ofstream(d + "/a.txt") << "alpha text\n";
  std::ofstream(d + "/sub/b.txt") << "beta text\n";
  // Links back up the tree: without visiting each real folder once, 6 links nest 6^9 times.
  for (const char* link : {"/l1", "/l2", "/l3", "/sub/up1", "/sub/up2", "/sub/up3"}) {
    ::symlink(std::string(link).rfind("/sub/", 0) == 0 ? ".." : ".", (d + link).c_str());
  }
  const auto docs = read_corpus(d);
  ASSERT_EQ(docs.size(), 2u);
  EXPECT_EQ(docs[0], "alpha text\n");
  EXPECT_EQ(docs[1], "beta text\n");
}

TEST(Corpus, AFileThatCannotBeReadIsNamedNotCalledEmpty) {
  const std::string d = dir("unreadable");
  std::ofstream(d + "/good.txt") << "some text\n";
  // /proc/self/mem opens as a regular file but its first page cannot be read (EIO), even as root.
  ::symlink("/proc/self/mem", (d + "/zz-mem").c_str());
  try {
    read_corpus(d);
    ADD_FAILURE() << "an unreadable file was skipped";
  } catch (const std::invalid_argument& e) {
    EXPECT_NE(std::string(e.what()).find("corpus file " + d + "/zz-mem cannot be read"), std::string::npos) << e.what();
  }
}

TEST(Tokenizer, LongLinesAreTokenizedInPiecesWithTheSameTokens) {
  const std::string prefix = dir("tok_pieces") + "/tok";
  train_tokenizer(sample_docs(), prefix, TokenizerTrainOptions().vocab_size(320));
  const Tokenizer tok = Tokenizer::load(prefix + ".model");
  std::string line;  // one line of ~24 KB
  for (const auto& d : sample_docs()) line += d.substr(0, d.size() - 1) + " ";
  line += "end";
  const std::string path = dir("tok_pieces") + "/t.tokens";
  const int64_t n = tokenize_corpus({line, "short one"}, tok, path, /*piece_bytes=*/1000);
  std::vector<int32_t> want = tok.encode(line);  // the reference: one call over the whole line
  want.push_back(tok.eos_id());
  for (int32_t id : tok.encode("short one")) want.push_back(id);
  want.push_back(tok.eos_id());
  ASSERT_EQ(n, static_cast<int64_t>(want.size()));
  const TokenFile file(path);
  const at::Tensor got = file.tokens();
  ASSERT_EQ(got.numel(), n);
  EXPECT_TRUE(at::equal(got, at::tensor(want, at::kInt)));
  // Without whitespace the pieces end on character boundaries: multi-byte text decodes intact (each
  // piece starts a word, so only spaces are added between pieces).
  std::string dense;
  for (int i = 0; i < 3000; ++i) dense += "\xc3\xa9";  // é
  tokenize_corpus({dense}, tok, path, 999);
  const TokenFile dense_file(path);
  const at::Tensor ids = dense_file.tokens().narrow(0, 0, dense_file.size() - 1);
  std::string decoded = tok.decode(std::vector<int32_t>(ids.data_ptr<int32_t>(), ids.data_ptr<int32_t>() + ids.numel()));
  decoded.erase(std::remove(decoded.begin(), decoded.end(), ' '), decoded.end());
  EXPECT_TRUE(decoded == dense) << "decoded " << decoded.size() << " bytes, want " << dense.size();
}

TEST(Tokenizer, BadModelPathsAreNamedInOurWords) {
  const std::string d = dir("tok_bad");
  for (const auto& [path, words] : std::vector<std::pair<std::string, std::string>>{
           {d, "is a folder, not a SentencePiece model file"}, {d + "/missing.model", "does not exist"}}) {
    try {
      Tokenizer::load(path);
      ADD_FAILURE() << path;
    } catch (const std::invalid_argument& e) {
      EXPECT_EQ(std::string(e.what()), "tokenizer " + path + " " + words);
    }
  }
}

TEST(Tokenizer, TrainingLeavesNoTemporaryFilesAndRemovesDeadRunsLeftovers) {
  const std::string me = std::to_string(::getpid());
  auto ours = [&](const std::string& pid) {
    int n = 0;
    for (const char* prefix : {"frugal-tokenizer-corpus-", "frugal-tokenizer-log-"}) {
      const std::string want = prefix + pid + "-";
      if (DIR* dd = ::opendir("/tmp")) {
        while (dirent* e = ::readdir(dd)) n += std::string(e->d_name).rfind(want, 0) == 0;
        ::closedir(dd);
      }
    }
    return n;
  };
  train_tokenizer(sample_docs(), dir("tok_tmp") + "/tok", TokenizerTrainOptions().vocab_size(300));
  EXPECT_EQ(ours(me), 0);
  // A dead process's leftovers go; a live one's (our parent's) stay.
  const pid_t child = ::fork();
  if (child == 0) ::_exit(0);
  int status = 0;
  ::waitpid(child, &status, 0);
  const std::string dead = std::to_string(child), live = std::to_string(::getppid());
  std::ofstream("/tmp/frugal-tokenizer-corpus-" + dead + "-abcdef") << "left by a kill";
  std::ofstream("/tmp/frugal-tokenizer-log-" + live + "-abcdef") << "in use";
  remove_stale_tokenizer_files();
  EXPECT_EQ(ours(dead), 0);
  EXPECT_EQ(ours(live), 1);
  std::remove(("/tmp/frugal-tokenizer-log-" + live + "-abcdef").c_str());
}

TEST(Tokenizer, TrainingErrorsCarryNoSentencePieceLogLines) {
  try {
    train_tokenizer(sample_docs(), dir("tok_err") + "/tok", TokenizerTrainOptions().vocab_size(320).character_coverage(5.0));
    ADD_FAILURE() << "a character_coverage of 5 was accepted";
  } catch (const std::exception& e) {
    const std::string what = e.what();
    EXPECT_EQ(what.find(".cc("), std::string::npos) << what;
    EXPECT_EQ(what.find('\n'), std::string::npos) << what;
    EXPECT_NE(what.find("character_coverage"), std::string::npos) << what;
  }
}
