// The strict numeric parser: the whole text one decimal number within the type and the caller's
// range, or std::invalid_argument whose message states the range and quotes the text.
#include <gtest/gtest.h>

#include <cmath>
#include <limits>
#include <stdexcept>
#include <string>

#include "frugal/io/numbers.h"
#include "frugal/io/units.h"

using frugal::io::parse_double;
using frugal::io::parse_int;
using frugal::io::to_double;
using frugal::io::to_int;

namespace {

// The message of the exception parse throws, "" when it throws none.
template <typename F>
std::string refusal(F parse) {
  try {
    parse();
  } catch (const std::invalid_argument& e) {
    return e.what();
  }
  return "";
}

}  // namespace

TEST(Numbers, IntegersAreWholeDecimalTexts) {
  EXPECT_EQ(to_int("0"), 0);
  EXPECT_EQ(to_int("42"), 42);
  EXPECT_EQ(to_int("-7"), -7);
  EXPECT_EQ(to_int("007"), 7);
  for (const char* bad : {"", "-", "abc", "1x", "x1", " 1", "1 ", "+1", "1.0", "1e3", "0x10", "1,000", "inf", "nan", "--1", "1\n"}) {
    EXPECT_FALSE(to_int(bad)) << bad;
  }
  EXPECT_FALSE(
      to_int(std::string("12\0"
                         "3",
                         4)));
}

TEST(Numbers, IntegersPastInt64AreRefusedNotWrapped) {
  EXPECT_EQ(to_int("9223372036854775807"), std::numeric_limits<int64_t>::max());
  EXPECT_EQ(to_int("-9223372036854775808"), std::numeric_limits<int64_t>::min());
  EXPECT_FALSE(to_int("9223372036854775808"));
  EXPECT_FALSE(to_int("-9223372036854775809"));
  EXPECT_FALSE(to_int("99999999999999999999"));
  EXPECT_FALSE(to_int("18446744073709551617"));  // 2^64 + 1: wraps to 1 in unsigned arithmetic
}

TEST(Numbers, DoublesAreFiniteDecimalTexts) {
  EXPECT_EQ(to_double("1"), 1.0);
  EXPECT_EQ(to_double("0.25"), 0.25);
  EXPECT_EQ(to_double(".5"), 0.5);
  EXPECT_EQ(to_double("5."), 5.0);
  EXPECT_EQ(to_double("-2.5e3"), -2500.0);
  EXPECT_EQ(to_double("1E+2"), 100.0);
  EXPECT_EQ(to_double("1e-400"), 0.0);  // too small to represent: 0, as strtod rounds it
  for (const char* bad : {"",    ".",    "-",        "e5",  "1e",  "1e+",   "abc", "1x",   " 1",       "1 ",    "+1",
                          "inf", "-inf", "infinity", "nan", "NaN", "0x1p3", "1,5", "1..2", "1e300000", "1e309", "-1e309"}) {
    EXPECT_FALSE(to_double(bad)) << bad;
  }
  EXPECT_EQ(to_double("1e300"), 1e300);  // in double's range: the caller's range decides
}

TEST(Numbers, ParseIntStatesTheRangeAndTheText) {
  EXPECT_EQ(parse_int("65535", "MASTER_PORT", 1, 65535), 65535);
  EXPECT_EQ(parse_int("1", "MASTER_PORT", 1, 65535), 1);
  const std::string expected_start = "MASTER_PORT must be an integer from 1 to 65535, not ";
  EXPECT_EQ(refusal([] { parse_int("70000", "MASTER_PORT", 1, 65535); }), expected_start + "'70000'");
  EXPECT_EQ(refusal([] { parse_int("0", "MASTER_PORT", 1, 65535); }), expected_start + "'0'");
  EXPECT_EQ(refusal([] { parse_int("abc", "MASTER_PORT", 1, 65535); }), expected_start + "'abc'");
  EXPECT_EQ(refusal([] { parse_int("", "MASTER_PORT", 1, 65535); }), expected_start + "''");
  EXPECT_EQ(refusal([] { parse_int("99999999999999999999", "--nproc", 1, 4096); }),
            "--nproc must be an integer from 1 to 4096, not '99999999999999999999'");
}

TEST(Numbers, ParseDoubleStatesTheRangeAndRefusesNonFinite) {
  EXPECT_EQ(parse_double("3", "--dist-timeout", 1, 86400), 3.0);
  EXPECT_EQ(parse_double("86400", "--dist-timeout", 1, 86400), 86400.0);
  for (const char* bad : {"inf", "nan", "1e300", "-1", "0.5", "1x", "", "86400.5"}) {
    EXPECT_EQ(refusal([&] { parse_double(bad, "--dist-timeout", 1, 86400); }),
              "--dist-timeout must be a number from 1 to 86400, not '" + std::string(bad) + "'")
        << bad;
  }
  EXPECT_EQ(refusal([] { parse_double("2", "--top-p", 0.0001, 1); }), "--top-p must be a number from 0.0001 to 1, not '2'");
}

TEST(Numbers, QuotedTextIsEscapedAndCapped) {
  EXPECT_EQ(refusal([] { parse_int("1\n2", "N", 0, 9); }), "N must be an integer from 0 to 9, not '1\\n2'");
  EXPECT_EQ(refusal([] { parse_int(std::string("\x01", 1), "N", 0, 9); }), "N must be an integer from 0 to 9, not '\\x01'");
  const std::string message = refusal([] { parse_int(std::string(1000, '7'), "N", 0, 9); });
  EXPECT_LT(message.size(), 120u);
  EXPECT_NE(message.find("(1000 bytes)"), std::string::npos) << message;
}

TEST(Numbers, ByteCountsReadTheirNumberAsStrictly) {
  using frugal::io::parse_bytes;
  EXPECT_EQ(parse_bytes("1e3"), 1000);
  EXPECT_EQ(parse_bytes("0.5KiB"), 512);
  EXPECT_EQ(parse_bytes("0"), 0);
  // strtod alone took hex, inf and nan, and a blank after a sign.
  for (const char* bad :
       {"0x10", "0x1p4K", "inf", "infK", "nan", "NaNM", "-0", "5e", "1e+", "1 K", "1K ", "99999999999999999999", "9223372036854775807"}) {
    EXPECT_FALSE(parse_bytes(bad)) << bad;
  }
  // Whole numbers exactly: 2^56 + 1 is not rounded to 2^56 (a caller's bound would let it by).
  EXPECT_EQ(parse_bytes("72057594037927937"), (int64_t{1} << 56) + 1);
  EXPECT_EQ(parse_bytes("8589934592G"), std::nullopt);  // 2^33 GiB = 2^63: past the count
  EXPECT_EQ(frugal::io::bytes_range(1, int64_t{1} << 56), "a byte count from 1 to 72057594037927936 (64 PiB)");
}
