// The JSON writer escapes strings and never writes NaN; atomic writes replace the whole file.
#include <gtest/gtest.h>

#include <cmath>
#include <fstream>
#include <sstream>

#include "frugal/io/atomic_file.h"
#include "frugal/io/json.h"

using frugal::io::JsonWriter;

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
