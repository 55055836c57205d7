// Corpus reading, tokenizer training and round trips, token files (including corrupted ones), and
// deterministic batches.
#include <dirent.h>
#include <gtest/gtest.h>
#include <malloc.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <cstdio>
#include <cstring>
#include <fstream>
#include <map>
#include <sstream>

#include "../support/peak_in_child.h"
#include "frugal/data/corpus.h"
#include "frugal/data/tokenizer.h"
#include "frugal/io/files.h"

using namespace frugal::data;

namespace {

std::string data_dir(const std::string& name) {
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
  const std::string d = data_dir("corpus");
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
  const std::string prefix = data_dir("tok") + "/tok";
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
  const std::string d = data_dir("tokens");
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
  const std::string d = data_dir("dataset");
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
  const std::string d = data_dir("loops");
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
  const std::string d = data_dir("unreadable");
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
  const std::string prefix = data_dir("tok_pieces") + "/tok";
  train_tokenizer(sample_docs(), prefix, TokenizerTrainOptions().vocab_size(320));
  const Tokenizer tok = Tokenizer::load(prefix + ".model");
  std::string line;  // one line of ~24 KB
  for (const auto& d : sample_docs()) line += d.substr(0, d.size() - 1) + " ";
  line += "end";
  const std::string path = data_dir("tok_pieces") + "/t.tokens";
  const int64_t n = tokenize_documents({line, "short one"}, tok, path, /*piece_bytes=*/1000);
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
  tokenize_documents({dense}, tok, path, 999);
  const TokenFile dense_file(path);
  const at::Tensor ids = dense_file.tokens().narrow(0, 0, dense_file.size() - 1);
  std::string decoded = tok.decode(std::vector<int32_t>(ids.data_ptr<int32_t>(), ids.data_ptr<int32_t>() + ids.numel()));
  decoded.erase(std::remove(decoded.begin(), decoded.end(), ' '), decoded.end());
  EXPECT_TRUE(decoded == dense) << "decoded " << decoded.size() << " bytes, want " << dense.size();
}

TEST(Tokenizer, BadModelPathsAreNamedInOurWords) {
  const std::string d = data_dir("tok_bad");
  // A folder is a model folder now (its tokenizer.json or tokenizer.model): one without either is named so.
  for (const auto& [path, message] : std::vector<std::pair<std::string, std::string>>{
           {d, "model folder " + d + " has no tokenizer (neither tokenizer.json nor tokenizer.model)"},
           {d + "/missing.model", "tokenizer " + d + "/missing.model does not exist"}}) {
    try {
      Tokenizer::load(path);
      ADD_FAILURE() << path;
    } catch (const std::invalid_argument& e) {
      EXPECT_EQ(std::string(e.what()), message);
    }
  }
}

TEST(Tokenizer, TrainingLeavesNoTemporaryFilesAndRemovesDeadRunsLeftovers) {
  const std::string me = std::to_string(::getpid());
  const std::string tmp = frugal::io::TempDir::base();  // where training makes its folder
  auto ours = [&](const std::string& pid) {
    int n = 0;
    const std::string want = "frugal-tokenizer-" + pid + "-";
    if (DIR* dd = ::opendir(tmp.c_str())) {
      while (dirent* e = ::readdir(dd)) n += std::string(e->d_name).rfind(want, 0) == 0;
      ::closedir(dd);
    }
    return n;
  };
  train_tokenizer(sample_docs(), data_dir("tok_tmp") + "/tok", TokenizerTrainOptions().vocab_size(300));
  EXPECT_EQ(ours(me), 0);
  // A dead process's leftovers go; a live one's (our parent's) stay.
  const pid_t child = ::fork();
  if (child == 0) ::_exit(0);
  int status = 0;
  ::waitpid(child, &status, 0);
  const std::string dead = std::to_string(child), live = std::to_string(::getppid());
  frugal::io::make_directories(tmp + "/frugal-tokenizer-" + dead + "-abcdef");
  std::ofstream(tmp + "/frugal-tokenizer-" + dead + "-abcdef/corpus.txt") << "left by a kill";
  frugal::io::make_directories(tmp + "/frugal-tokenizer-" + live + "-abcdef");
  remove_stale_tokenizer_files();
  EXPECT_EQ(ours(dead), 0);
  EXPECT_EQ(ours(live), 1);
  frugal::io::remove_tree(tmp + "/frugal-tokenizer-" + live + "-abcdef");
}

TEST(Tokenizer, TrainingErrorsCarryNoSentencePieceLogLines) {
  try {
    train_tokenizer(sample_docs(), data_dir("tok_err") + "/tok", TokenizerTrainOptions().vocab_size(320).character_coverage(5.0));
    ADD_FAILURE() << "a character_coverage of 5 was accepted";
  } catch (const std::exception& e) {
    const std::string what = e.what();
    EXPECT_EQ(what.find(".cc("), std::string::npos) << what;
    EXPECT_EQ(what.find('\n'), std::string::npos) << what;
    EXPECT_NE(what.find("character_coverage"), std::string::npos) << what;
  }
}

namespace {

// The documents of one file by the rules corpus.h states, computed over the whole text at once (as
// frugal did before it streamed): an independent reference for the streaming reader.
std::vector<std::string> whole_file_documents(const std::string& text) {
  std::vector<std::string> docs;
  auto keep = [&](const std::string& d) {
    if (d.find_first_not_of(" \t\r\n") != std::string::npos) docs.push_back(d);
  };
  if (text.find('\0') != std::string::npos) return docs;
  if (("\n" + text).find("\n%\n") == std::string::npos) {
    keep(text);
    return docs;
  }
  std::istringstream in(text);
  std::string line, doc;
  while (std::getline(in, line)) {
    if (line == "%") {
      keep(doc);
      doc.clear();
    } else {
      doc += line + "\n";
    }
  }
  keep(doc);
  return docs;
}

std::string words_text(size_t bytes, uint32_t seed) {  // lower-case words and spaces, no newline
  const char* words[] = {"the", "cat", "sat", "on", "a", "mat", "and", "dog", "ran", "far", "away", "home"};
  std::string s;
  uint32_t x = seed;
  while (s.size() < bytes) {
    x = x * 1664525u + 1013904223u;
    s += words[(x >> 16) % 12];
    s += ' ';
  }
  return s;
}

Tokenizer small_tokenizer(const std::string& name) {
  const std::string prefix = data_dir(name) + "/tok";
  train_tokenizer(sample_docs(), prefix, TokenizerTrainOptions().vocab_size(320));
  return Tokenizer::load(prefix + ".model");
}

std::vector<int32_t> token_file_ids(const std::string& path) {
  const TokenFile f(path);
  const int32_t* p = f.tokens().data_ptr<int32_t>();
  return std::vector<int32_t>(p, p + f.size());
}

}  // namespace

// Streaming splits documents exactly as reading each file whole does, at every 64 KiB read boundary
// (a "\n%\n" across one, a "%" line ending a read), and its tokens are those of one encode call per
// whole document followed by EOS.
TEST(Corpus, StreamedDocumentsAndTokensEqualTheWholeFileComputation) {
  const std::string d = data_dir("stream");
  std::map<std::string, std::string> files;
  // A fortune file whose separator straddles the first read boundary (bytes 65535-65537).
  std::string f1 = "%\nfirst\n%\n%%not a separator\n   \t\n%\n";
  f1 += words_text(65535 - f1.size() - 1, 1) + "\n";
  f1.resize(65535, 'x');
  f1 += "\n%\nafter the boundary\n";
  f1 += words_text(70000, 2) + "\n%\r\nstill the same document\n%\n" + words_text(65536 * 3 - f1.size() - 2, 3) + "\n%";
  files["a_fortunes"] = f1;
  // "%" at a read's last byte and its newline in the next read; an unterminated last line.
  std::string f2 = words_text(65535 - 1, 4);
  f2.resize(65535 - 1);
  f2 += "\n%\nlast line without a newline";
  files["b_fortunes"] = f2;
  files["c_one_line"] = words_text(300000, 5);  // one long line, no newline
  files["d_spaces_only"] = std::string(70000, ' ') + "\n\t\n";
  files["e_binary"] = std::string("abc\0def", 7) + words_text(100, 6);
  files["f_crlf"] = "one\r\n%\r\ntwo\r\n";  // no "\n%\n": one document
  std::string f3 = std::string(80000, ' ') + "late text\n%\n" + std::string(90000, '\n') + "\n%\nend\n";
  files["g_late_text"] = f3;  // whitespace for more than a read, then text; a whitespace-only document
  std::vector<std::string> want_docs;
  for (const auto& [name, text] : files) {
    std::ofstream(d + "/" + name, std::ios::binary) << text;
    for (auto& doc : whole_file_documents(text)) want_docs.push_back(doc);
  }
  const auto docs = read_corpus(d);
  ASSERT_EQ(docs.size(), want_docs.size());
  for (size_t i = 0; i < docs.size(); ++i) EXPECT_TRUE(docs[i] == want_docs[i]) << "document " << i;

  const Tokenizer tok = small_tokenizer("stream_tok");
  std::vector<int32_t> want;
  for (const auto& doc : want_docs) {
    for (int32_t id : tok.encode(doc)) want.push_back(id);
    want.push_back(tok.eos_id());
  }
  for (size_t piece : {size_t(1000), size_t(1) << 16}) {
    const std::string path = d + "_" + std::to_string(piece) + ".tokens";
    const CorpusTokens made = tokenize_corpus(d, tok, path, piece);
    EXPECT_EQ(made.documents, static_cast<int64_t>(want_docs.size()));
    EXPECT_EQ(made.tokens, static_cast<int64_t>(want.size()));
    EXPECT_TRUE(token_file_ids(path) == want) << "piece_bytes " << piece;
  }
  // A corpus of whitespace only is refused and leaves no file.
  const std::string empty = data_dir("stream_empty");
  std::ofstream(empty + "/blank") << "  \n%\n\t\n";
  EXPECT_THROW(tokenize_corpus(empty, tok, empty + ".tokens"), std::invalid_argument);
  struct stat st {};
  EXPECT_NE(::stat((empty + ".tokens").c_str(), &st), 0);
}

namespace {

struct ChildRun {
  int64_t rss_growth = 0, tokens = 0;
};

// Tokenizes a corpus in a child process; reports its peak RSS growth (VmHWM after, less VmRSS when
// the peak was reset just before) and the token count. held: read the corpus into memory first and
// tokenize from there (a control, to show the measure sees memory that grows with the corpus).
ChildRun tokenize_in_child(const std::string& corpus, const Tokenizer& tok, const std::string& out, bool held) {
  const auto r = frugal::testing::peak_in_child<int64_t>([&]() -> int64_t {
    if (held) return static_cast<int64_t>(tokenize_documents(read_corpus(corpus), tok, out));
    return static_cast<int64_t>(tokenize_corpus(corpus, tok, out).tokens);
  });
  return ChildRun{r.rss_growth, r.value};
}

}  // namespace

// Memory flat in corpus size: a one-line corpus of N and of 4N bytes (the same text four times)
// gives 4x the tokens while the tokenizing process's peak RSS grows by less than 2 MiB more. The
// same corpora held in memory grow by more than the 3N bytes of text added, so the measure sees it.
TEST(Corpus, TokenizingMemoryIsFlatInCorpusSize) {
  const std::string d = data_dir("flat");
  const size_t n = size_t(2) << 20;  // 2 MiB
  const std::string text = words_text(n, 7);
  std::string four;
  for (int i = 0; i < 4; ++i) four += text;
  ::mkdir((d + "/n").c_str(), 0755);
  ::mkdir((d + "/4n").c_str(), 0755);
  std::ofstream(d + "/n/c", std::ios::binary) << text;
  std::ofstream(d + "/4n/c", std::ios::binary) << four;
  const Tokenizer tok = small_tokenizer("flat_tok");
  const ChildRun small = tokenize_in_child(d + "/n", tok, d + "/n.tokens", false);
  const ChildRun big = tokenize_in_child(d + "/4n", tok, d + "/4n.tokens", false);
  // Four copies joined at a space: the words' tokens four times, one EOS, and one "▁" for the text's
  // trailing space (whitespace is kept: only the last copy's trailing space is a token of its own,
  // the others start the next copy's first word).
  EXPECT_EQ(big.tokens - 2, 4 * (small.tokens - 2));
  EXPECT_EQ(token_file_ids(d + "/4n.tokens").size(), static_cast<size_t>(big.tokens));
  RecordProperty("rss_growth_n", std::to_string(small.rss_growth));
  RecordProperty("rss_growth_4n", std::to_string(big.rss_growth));
  const int64_t bound = int64_t(2) << 20;
  EXPECT_LT(big.rss_growth - small.rss_growth, bound)
      << "peak RSS growth " << small.rss_growth << " B for " << n << " B, " << big.rss_growth << " B for " << 4 * n << " B";
  // No absolute bound: the fixed part (SentencePiece's and the allocator's working memory) was 2.3 MB
  // on a quiet machine and 11 MB under ctest -j2 with other builds running; flatness is the claim.
  const ChildRun small_held = tokenize_in_child(d + "/n", tok, d + "/n_held.tokens", true);
  const ChildRun big_held = tokenize_in_child(d + "/4n", tok, d + "/4n_held.tokens", true);
  RecordProperty("rss_growth_held_n", std::to_string(small_held.rss_growth));
  RecordProperty("rss_growth_held_4n", std::to_string(big_held.rss_growth));
  EXPECT_GT(big_held.rss_growth - small_held.rss_growth, static_cast<int64_t>(3 * n));
  EXPECT_TRUE(token_file_ids(d + "/4n_held.tokens") == token_file_ids(d + "/4n.tokens"));
}
