// tokenizer.json tokenizers against the ids the `tokenizers` library gave for the same strings
// (tests/data/make_tokenizer_fixtures.py wrote the fixtures and expected_ids.json), malformed files,
// invalid UTF-8, and speed on a 1 MB line.
#include <gtest/gtest.h>
#include <sys/stat.h>

#include <chrono>
#include <cstdio>
#include <fstream>
#include <sstream>

#include "frugal/data/corpus.h"
#include "frugal/data/hf_tokenizer.h"
#include "frugal/data/tokenizer.h"
#include "frugal/io/atomic_file.h"
#include "frugal/io/files.h"
#include "frugal/io/json_value.h"
#include "build_info.h"  // FRUGAL_*: this build's facts (CMakeLists.txt)

using namespace frugal::data;

namespace {

std::string fixture(const std::string& name) {
  std::string path =
      FRUGAL_SOURCE_DIR "/tests/data/fixtures/";  // one literal: GCC 12 misreads a temporary's append (-Warray-bounds, C++20)
  return path + name;
}

const frugal::io::JsonValue& expected() {
  static const frugal::io::JsonValue v =
      frugal::io::parse_json(frugal::io::read_file(fixture("expected_ids.json"), frugal::io::kTokenizerFileBytes));
  return v;
}

std::vector<int32_t> ids_of(const frugal::io::JsonValue& list) {
  std::vector<int32_t> out;
  for (const auto& x : list.items()) out.push_back(static_cast<int32_t>(x.as_int()));
  return out;
}

std::string long_line() {  // as make_tokenizer_fixtures.py's long_line()
  const std::string unit =
      "lorem ipsum dolor 42 sit amet, \xC3\xBCn\xC3\xAF"
      "c\xC3\xB6"
      "d\xC3\xA9 \xE6\x97\xA5\xE6\x9C\xAC ";
  const size_t n = (size_t(1) << 20) / unit.size() + 1;
  std::string s;
  s.reserve(n * unit.size());
  for (size_t i = 0; i < n; ++i) s += unit;
  return s;
}

std::string fnv1a64(const std::vector<int32_t>& ids) {
  uint64_t h = 0xcbf29ce484222325ull;
  for (int32_t id : ids) {
    for (int k = 0; k < 4; ++k) {
      h ^= static_cast<uint8_t>(static_cast<uint32_t>(id) >> (8 * k));
      h *= 0x100000001b3ull;
    }
  }
  char buf[17];
  std::snprintf(buf, sizeof(buf), "%016llx", static_cast<unsigned long long>(h));
  return buf;
}

std::string with_replaced(const std::string& text, const std::string& from, const std::string& to) {
  const auto at = text.find(from);
  EXPECT_NE(at, std::string::npos) << from;
  return text.substr(0, at) + to + text.substr(at + from.size());
}

void expect_refused(const std::string& json, const std::string& needle) {
  try {
    HfTokenizer::parse(json, "bad.json");
    ADD_FAILURE() << "accepted; expected an error naming " << needle;
  } catch (const std::invalid_argument& e) {
    EXPECT_NE(std::string(e.what()).find(needle), std::string::npos) << e.what();
    EXPECT_NE(std::string(e.what()).find("bad.json"), std::string::npos) << e.what();
  }
}

}  // namespace

// Outside the anonymous namespace: GoogleTest derives each case's class from it, which GCC warns about
// in a unity batch (-Wsubobject-linkage) when the base has internal linkage.
class HfTokenizerParity : public ::testing::TestWithParam<std::string> {};

TEST_P(HfTokenizerParity, IdsEqualTheTokenizersLibrarysOnHardStrings) {
  const std::string name = GetParam();
  const HfTokenizer tok = HfTokenizer::load(fixture(name + ".json"));
  const auto& e = expected().at(name);
  EXPECT_EQ(tok.vocab_size(), e.at("vocab_size").as_int());
  for (const auto& c : e.at("cases").items()) {
    const std::string& text = c.at("text").as_string();
    EXPECT_EQ(tok.encode(text), ids_of(c.at("ids"))) << name << ": '" << text << "'";
    EXPECT_EQ(tok.encode(text, true), ids_of(c.at("ids_with_special"))) << name << ": '" << text << "'";
    EXPECT_EQ(tok.decode(ids_of(c.at("ids")), /*skip_special_tokens=*/false), c.at("decoded").as_string()) << name << ": '" << text << "'";
  }
}

TEST_P(HfTokenizerParity, AOneMegabyteLineIsFastAndMatches) {
  const std::string name = GetParam();
  const HfTokenizer tok = HfTokenizer::load(fixture(name + ".json"));
  const std::string line = long_line();
  const auto t0 = std::chrono::steady_clock::now();
  const auto ids = tok.encode(line);
  const double seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  const auto& e = expected().at(name).at("long_line");
  EXPECT_EQ(static_cast<int64_t>(ids.size()), e.at("count").as_int());
  EXPECT_EQ(fnv1a64(ids), e.at("fnv1a64").as_string());
  EXPECT_LT(seconds, 10.0) << "quadratic somewhere?";
  // Byte-level and byte-fallback tokenizers are lossless.
  EXPECT_EQ(tok.decode(ids), line);
}

INSTANTIATE_TEST_SUITE_P(Fixtures, HfTokenizerParity, ::testing::Values("gpt2", "llama3", "llama2", "mistral"));

TEST(HfTokenizer, RoundTripsTextLosslessly) {
  for (const char* name : {"gpt2", "llama3", "llama2", "mistral"}) {
    const HfTokenizer tok = HfTokenizer::load(fixture(std::string(name) + ".json"));
    for (const char* s : {"spaces  \t\ttabs\r\n\r\nCRLF ", "emoji 😀 CJK 日本語 e\xCC\x81", "x", "unseen ꙮ 𝔘"}) {
      EXPECT_EQ(tok.decode(tok.encode(s)), s) << name;
    }
    // Metaspace's decoder drops the first token's "▁" (prepend_scheme first): a leading space is lost,
    // as in `tokenizers`; the others keep it.
    if (std::string(name) != "mistral") {
      EXPECT_EQ(tok.decode(tok.encode("  two leading")), "  two leading") << name;
    }
  }
}

TEST(HfTokenizer, InvalidUtf8IsRefused) {
  const HfTokenizer tok = HfTokenizer::load(fixture("gpt2.json"));
  for (const std::string& bad : {std::string("ab\xFF"), std::string("\xC3"), std::string("\xE0\x80\x80"), std::string("\xED\xA0\x80")}) {
    try {
      tok.encode(bad);
      ADD_FAILURE() << "accepted invalid UTF-8";
    } catch (const std::invalid_argument& e) {
      EXPECT_NE(std::string(e.what()).find("not valid UTF-8"), std::string::npos) << e.what();
    }
  }
}

TEST(HfTokenizer, MalformedFilesAreRefusedNamingTheField) {
  const std::string good = frugal::io::read_file(fixture("gpt2.json"), frugal::io::kTokenizerFileBytes);
  expect_refused("{", "not valid JSON");
  expect_refused(R"({"version": "1.0"})", "'model' is missing");
  expect_refused(with_replaced(good, "\"type\":\"BPE\"", "\"type\":\"WordPiece\""), "model: type 'WordPiece' is not supported");
  expect_refused(
      with_replaced(good, "\"type\":\"ByteLevel\",\"add_prefix_space\":false", "\"type\":\"Whitespace\",\"add_prefix_space\":false"),
      "pre_tokenizer: type 'Whitespace' is not supported (supported:");
  expect_refused(with_replaced(good, "\"dropout\":null", "\"dropout\":0.1"), "'dropout'");
  expect_refused(with_replaced(good, "\"merges\":[", "\"merges\":[\"nosuchtoken x\","), "merges[0]");
  expect_refused(with_replaced(good, "\"merges\":[", "\"merges\":[\"abc\","), "merges[0] 'abc' is not two tokens");
  expect_refused(with_replaced(good, "\"truncation\":null", "\"truncation\":{\"max_length\":8}"), "truncation");
  expect_refused(with_replaced(good, "\"single_word\":false", "\"single_word\":true"), "added_tokens[0]: single_word");
  expect_refused(with_replaced(good, "\"version\":\"1.0\"", "\"version\":\"1.0\",\"frobnicate\":1"), "'frobnicate'");
  const std::string l3 = frugal::io::read_file(fixture("llama3.json"), frugal::io::kTokenizerFileBytes);
  expect_refused(with_replaced(l3, "\"behavior\":\"Isolated\"", "\"behavior\":\"Sideways\""), "behavior 'Sideways'");
  expect_refused(with_replaced(l3, "\"Regex\":\"(?i:", "\"Regex\":\"((?i:"), "does not compile");
  EXPECT_THROW(HfTokenizer::load("/nonexistent/tokenizer.json"), std::invalid_argument);
}

TEST(HfTokenizer, SpecialTokensAreRecognisedAndSkippedWhenDecoding) {
  const HfTokenizer tok = HfTokenizer::load(fixture("llama2.json"));
  EXPECT_EQ(tok.token_to_id("</s>"), 2);
  EXPECT_TRUE(tok.is_special(1));
  EXPECT_EQ(tok.prefix_ids(), std::vector<int32_t>{1});
  const auto ids = tok.encode("Hi</s>");
  EXPECT_EQ(ids.back(), 2);
  EXPECT_EQ(tok.decode(ids), "Hi");
  EXPECT_THROW(tok.decode({static_cast<int32_t>(tok.vocab_size())}), std::invalid_argument);
}

// ---- data::Tokenizer over both kinds, and model folders ----
namespace {

std::string temp_dir(const std::string& name) {
  const std::string d = ::testing::TempDir() + "/frugal_hf_" + name;
  ::mkdir(d.c_str(), 0755);
  return d;
}

const std::vector<std::string>& hard_strings() {
  static const std::vector<std::string> v = {"",
                                             "Hello world",
                                             " leading space",
                                             "  two leading",
                                             "trailing  ",
                                             "runs     of      spaces",
                                             "tabs\tand\t\ttabs",
                                             "new\nlines\n\n\n",
                                             "crlf\r\nline\r\n",
                                             "emoji 😀🎉👍🏽",
                                             "CJK 日本語 中文",
                                             "combining e\xCC\x81 a\xCC\x88",
                                             "numbers 1234567 3.14",
                                             "\xE2\x96\x81metaspace",
                                             "\n",
                                             " ",
                                             "unseen ꙮ 𝔘",
                                             "the cat sat on the mat."};
  return v;
}

}  // namespace

TEST(HfTokenizerFolder, SaveAndLoadFolderKeepTheIdsAndSpecialTokens) {
  for (const char* name : {"gpt2", "llama3", "llama2"}) {
    const Tokenizer tok = Tokenizer::load(fixture(std::string(name) + ".json"));
    const std::string d = temp_dir(std::string("folder_") + name);
    tok.save_folder(d);
    EXPECT_TRUE(Tokenizer::folder_has_tokenizer(d));
    const Tokenizer back = Tokenizer::load_folder(d);
    EXPECT_EQ(back.vocab_size(), tok.vocab_size());
    EXPECT_EQ(back.bos_id(), tok.bos_id()) << name;
    EXPECT_EQ(back.eos_id(), tok.eos_id()) << name;
    EXPECT_EQ(back.add_bos(), tok.add_bos()) << name;
    for (const auto& s : hard_strings()) {
      EXPECT_EQ(back.encode(s), tok.encode(s)) << name;
      EXPECT_EQ(back.encode(s, true), tok.encode(s, true)) << name;
    }
  }
  const Tokenizer l2 = Tokenizer::load(fixture("llama2.json"));
  EXPECT_EQ(l2.bos_id(), 1);
  EXPECT_EQ(l2.eos_id(), 2);
  EXPECT_TRUE(l2.add_bos());
  EXPECT_EQ(l2.encode("Hi", true).front(), 1);
}

TEST(HfTokenizerFolder, TokenizerConfigIsHonouredAndCheckedByName) {
  const std::string d = temp_dir("config");
  Tokenizer::load(fixture("llama2.json")).save_folder(d);
  frugal::io::write_file_atomic(d + "/tokenizer_config.json",
                                R"({"bos_token": {"content": "<s>"}, "eos_token": "</s>", "add_bos_token": false, "add_eos_token": true})");
  const Tokenizer t = Tokenizer::load_folder(d);
  EXPECT_FALSE(t.add_bos());
  EXPECT_TRUE(t.add_eos());
  const auto ids = t.encode("Hi", true);
  EXPECT_NE(ids.front(), 1);
  EXPECT_EQ(ids.back(), 2);
  frugal::io::write_file_atomic(d + "/tokenizer_config.json", R"({"eos_token": "<nope>"})");
  try {
    Tokenizer::load_folder(d);
    ADD_FAILURE() << "accepted an eos_token outside the vocabulary";
  } catch (const std::invalid_argument& e) {
    EXPECT_NE(std::string(e.what()).find("tokenizer_config.json: eos_token '<nope>'"), std::string::npos) << e.what();
  }
  EXPECT_FALSE(Tokenizer::folder_has_tokenizer(temp_dir("empty")));
  EXPECT_THROW(Tokenizer::load_folder(temp_dir("empty")), std::invalid_argument);
}

// Every field of tokenizer_config.json is honoured, changes no id, or is refused by name; the files
// transformers writes itself (a 10^30 model_max_length, its backend name) load.
TEST(HfTokenizerFolder, EveryTokenizerConfigFieldIsHonouredNeutralOrRefusedByName) {
  const std::string d = temp_dir("config_fields");
  Tokenizer::load(fixture("gpt2.json")).save_folder(d);
  frugal::io::write_file_atomic(d + "/tokenizer_config.json",
                                R"({"backend": "tokenizers", "bos_token": "<|endoftext|>", "eos_token": "<|endoftext|>",)"
                                R"( "model_max_length": 1000000000000000019884624838656, "tokenizer_class": "TokenizersBackend",)"
                                R"( "add_prefix_space": false, "chat_template": "{{ messages }}", "clean_up_tokenization_spaces": true})");
  const Tokenizer t = Tokenizer::load_folder(d);
  const std::string text = "Hello , world . Is n't it ?";
  // transformers' clean-up drops the space before punctuation and contractions when decoding.
  EXPECT_EQ(t.decode(t.encode(text)), "Hello, world. Isn't it?");
  // The chat template is kept and written back (a fine-tuned chat model keeps its template);
  // transformers 5's chat_template.jinja wins over the config's.
  EXPECT_EQ(t.chat_template(), "{{ messages }}");
  const std::string saved = temp_dir("config_fields_saved");
  t.save_folder(saved);
  EXPECT_EQ(Tokenizer::load_folder(saved).chat_template(), "{{ messages }}");
  frugal::io::write_file_atomic(saved + "/chat_template.jinja", "{{ bos_token }}");
  EXPECT_EQ(Tokenizer::load_folder(saved).chat_template(), "{{ bos_token }}");
  t.save_folder(saved);  // a stale chat_template.jinja does not outlive a save
  EXPECT_EQ(Tokenizer::load_folder(saved).chat_template(), "{{ messages }}");
  for (const char* field :
       {R"("do_lower_case": true)", R"("split_special_tokens": true)", R"("add_prefix_space": true)", R"("some_new_option": 3)"}) {
    frugal::io::write_file_atomic(d + "/tokenizer_config.json", std::string(R"({"eos_token": "<|endoftext|>", )") + field + "}");
    const std::string name = std::string(field).substr(1, std::string(field).find('"', 1) - 1);
    try {
      Tokenizer::load_folder(d);
      ADD_FAILURE() << "accepted " << field;
    } catch (const std::invalid_argument& e) {
      EXPECT_NE(std::string(e.what()).find("field '" + name + "'"), std::string::npos) << e.what();
    }
  }
}

// frugal's own SentencePiece tokenizers keep whitespace (identity normalization), and the
// tokenizer.json save_folder writes for them gives SentencePiece's ids on hard strings (transformers
// 5.23's AutoTokenizer reads that file to the same ids; its own conversion of a bare tokenizer.model
// differs on leading spaces, hence the file).
TEST(HfTokenizerFolder, ATrainedSentencePieceModelSavesAsAnEqualTokenizerJson) {
  const std::string d = temp_dir("spm");
  std::vector<std::string> docs;
  const char* lines[] = {"the cat sat on the mat.", "  indented  code\tline", "日本語 text 123", "Hello world, hello tokens."};
  for (int i = 0; i < 300; ++i) docs.push_back(std::string(lines[i % 4]) + " " + std::to_string(i));
  train_tokenizer(docs, d + "/tok", TokenizerTrainOptions().vocab_size(400));
  const Tokenizer spm = Tokenizer::load(d + "/tok.model");
  EXPECT_EQ(spm.decode(spm.encode("a  b\t\tc")), "a  b\t\tc");  // whitespace kept as it is
  const std::string folder = d + "/model";
  spm.save_folder(folder);
  ASSERT_TRUE(frugal::io::path_exists(folder + "/tokenizer.json"));
  ASSERT_TRUE(frugal::io::path_exists(folder + "/tokenizer.model"));
  const Tokenizer json = Tokenizer::load_folder(folder);
  EXPECT_EQ(json.vocab_size(), spm.vocab_size());
  EXPECT_EQ(json.bos_id(), spm.bos_id());
  EXPECT_EQ(json.eos_id(), spm.eos_id());
  EXPECT_NE(json.fingerprint(), spm.fingerprint());
  for (const auto& s : hard_strings()) {
    EXPECT_EQ(json.encode(s), spm.encode(s)) << "'" << s << "'";
    EXPECT_EQ(json.encode(s, true), spm.encode(s, true)) << "'" << s << "'";
    EXPECT_EQ(json.decode(spm.encode(s)), spm.decode(spm.encode(s))) << "'" << s << "'";
  }
  EXPECT_THROW(spm.encode("bad \xFF"), std::invalid_argument);
}

// A long text is tokenized in pieces (tokenize_documents' piece_bytes): whatever whitespace lies
// between its words (runs of spaces, newlines, tabs, CRLF, a space after a newline), the pieces'
// ids are the whole text's, for each kind of tokenizer: regex pre-tokenizers (GPT-2, Llama-3), a
// Prepend normalizer (Llama-2), Metaspace (Mistral), SentencePiece and its saved tokenizer.json.
TEST(HfTokenizerPieces, ALongTextCutInPiecesGivesTheWholeTextsIds) {
  const char* words[] = {"the", "cat", "sat", "on", "a", "mat", "\xC3\xA9t\xC3\xA9", "\xE6\x97\xA5\xE6\x9C\xAC", "code();", "42", "don't"};
  const char* gaps[] = {" ", "  ", "\n", " \n", "\t", "\n  ", "   ", "\r\n", ", ", " \t ", "\n\n", ". "};
  std::string text;
  for (uint32_t i = 0, x = 7; text.size() < 30000; ++i) {
    x = x * 1664525u + 1013904223u;
    text += words[(x >> 16) % 11];
    text += gaps[(x >> 8) % 12];
  }
  std::vector<std::string> docs;
  for (int i = 0; i < 200; ++i) docs.push_back(text.substr(static_cast<size_t>(i) * 97, 400));
  const std::string d = temp_dir("pieces");
  train_tokenizer(docs, d + "/tok", TokenizerTrainOptions().vocab_size(400));
  const Tokenizer spm = Tokenizer::load(d + "/tok.model");
  spm.save_folder(d + "/model");
  std::vector<std::pair<std::string, Tokenizer>> tokenizers = {{"sentencepiece", spm},
                                                               {"its tokenizer.json", Tokenizer::load_folder(d + "/model")}};
  for (const char* name : {"gpt2", "llama3", "llama2", "mistral"})
    tokenizers.emplace_back(name, Tokenizer::load(fixture(std::string(name) + ".json")));
  for (const auto& [name, tok] : tokenizers) {
    std::vector<int32_t> want = tok.encode(text);
    want.push_back(tok.eos_id());
    for (size_t piece : {size_t(1000), size_t(777)}) {
      const std::string path = d + "/t.tokens";
      ASSERT_EQ(tokenize_documents({text}, tok, path, piece), static_cast<int64_t>(want.size())) << name << ", piece_bytes " << piece;
      const TokenFile f(path);
      const int32_t* p = f.tokens().data_ptr<int32_t>();
      EXPECT_TRUE(std::vector<int32_t>(p, p + f.size()) == want) << name << ", piece_bytes " << piece;
    }
  }
}
