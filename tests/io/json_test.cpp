// The JSON writer escapes strings and never writes NaN; atomic writes replace the whole file.
#include <dirent.h>
#include <gtest/gtest.h>
#include <sys/stat.h>

#include <cmath>
#include <fstream>
#include <sstream>

#include "frugal/io/atomic_file.h"
#include "frugal/io/json.h"
#include "frugal/io/json_value.h"

using frugal::io::JsonValue;
using frugal::io::JsonWriter;
using frugal::io::parse_json;

TEST(Json, WritesNestedValuesOnOneLine) {
  std::ostringstream out;
  JsonWriter w(out, 0);
  w.begin_object().key("a").value(int64_t{1}).key("b").begin_array().value(true).null().value("x\"y\n").end_array();
  w.key("nan").value(std::nan("")).key("e").begin_object().end_object().end_object();
  EXPECT_EQ(out.str(), "{\"a\": 1, \"b\": [true, null, \"x\\\"y\\n\"], \"nan\": null, \"e\": {}}");
}

TEST(Json, CompactModeHasNoSpaces) {
  std::ostringstream out;
  JsonWriter w(out, -1);
  w.begin_object().key("a").begin_array().value(1).value("x").end_array().key("b").null().end_object();
  EXPECT_EQ(out.str(), R"({"a":[1,"x"],"b":null})");
}

TEST(Json, EscapesControlCharacters) { EXPECT_EQ(JsonWriter::escape(std::string("\x01", 1)), "\\u0001"); }

TEST(AtomicFile, ReplacesTheWholeFile) {
  const std::string path = ::testing::TempDir() + "/frugal_atomic_test.txt";
  frugal::io::write_file_atomic(path, "first version, longer");
  frugal::io::write_file_atomic(path, "second");
  std::ifstream in(path);
  std::stringstream got;
  got << in.rdbuf();
  EXPECT_EQ(got.str(), "second");
  EXPECT_THROW(frugal::io::write_file_atomic("/nonexistent-dir/x.json", "x"), std::runtime_error);
}

// Pieces appended, a header overwritten in place, a tail taken back: the target sees only the
// committed whole; a writer dropped before commit leaves the old file and no temporary.
TEST(AtomicFile, WriterOverwritesAndTruncatesBeforeCommit) {
  const std::string dir = ::testing::TempDir() + "/frugal_atomic_writer";
  ::mkdir(dir.c_str(), 0755);
  const std::string path = dir + "/f.bin";
  auto read = [&] {
    std::ifstream in(path, std::ios::binary);
    std::stringstream got;
    got << in.rdbuf();
    return got.str();
  };
  frugal::io::write_file_atomic(path, "old");
  {
    frugal::io::AtomicFileWriter w(path);
    w.write("HEAD-body-", 10);
    w.write("dropped tail", 12);
    w.truncate(10);
    w.write("end", 3);
    w.write_at(0, "head", 4);
    EXPECT_EQ(read(), "old");
    w.commit();
  }
  EXPECT_EQ(read(), "head-body-end");
  {
    frugal::io::AtomicFileWriter w(path);
    w.write("never committed", 15);
  }
  EXPECT_EQ(read(), "head-body-end");
  int entries = 0;
  if (DIR* d = ::opendir(dir.c_str())) {
    while (dirent* e = ::readdir(d)) entries += e->d_name[0] != '.';
    ::closedir(d);
  }
  EXPECT_EQ(entries, 1);
}

// transformers writes tokenizer_config.json's model_max_length as 10^30 in digits: a valid JSON
// number past int64, read as a double (not refused, not wrapped into a wrong integer).
TEST(JsonValue, AnIntegerPastInt64IsANumberButNotAnInteger) {
  const JsonValue v = parse_json(R"({"model_max_length": 1000000000000000019884624838656, "n": -9223372036854775808})");
  const JsonValue& big = v.at("model_max_length");
  EXPECT_TRUE(big.is_number());
  EXPECT_FALSE(big.is_integer());
  EXPECT_DOUBLE_EQ(big.as_double(), 1e30);
  EXPECT_TRUE(v.at("n").is_integer());
  EXPECT_EQ(v.at("n").as_int(), INT64_MIN);
}
