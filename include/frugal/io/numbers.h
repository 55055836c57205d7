// frugal/io/numbers.h — numbers from text (flags, environment variables, recipe values), strictly:
// the whole text one decimal number, no blanks or trailing junk, nothing past the type's range,
// no inf or nan, then within the range the caller states (which the refusal names).
//
//   int64_t port = frugal::io::parse_int(text, "MASTER_PORT", 1, 65535);
//     // "abc": std::invalid_argument "MASTER_PORT must be an integer from 1 to 65535, not 'abc'"
//   double t = frugal::io::parse_double(text, "--dist-timeout", 1, 86400);
//   std::optional<int64_t> n = frugal::io::to_int("12");   // nullopt unless the text is an integer
#pragma once

#include <cstdint>
#include <optional>
#include <string>

namespace frugal {
namespace io {

// An optional '-' then decimal digits, nothing else, within int64_t; nullopt otherwise ("+1",
// " 1", "1x", "0x10", "1e3" and 2^63 all fail).
std::optional<int64_t> to_int(const std::string& text);
// A finite decimal number: optional '-', digits with an optional '.' and fraction, an optional
// exponent (e/E, optional sign, digits); nullopt for anything else (blanks, hex, "inf", "nan",
// a value past double's range; one too small to represent becomes 0 or the nearest subnormal).
std::optional<double> to_double(const std::string& text);

// "an integer from MIN to MAX" / "a number from MIN to MAX": the range as messages state it.
std::string int_range(int64_t min, int64_t max);
std::string double_range(double min, double max);
// The text as a message quotes it: control bytes escaped (\n, \x01), at most 40 bytes shown.
std::string quote_text(const std::string& text);

// to_int / to_double within [min, max]; else throws std::invalid_argument
// "WHAT must be an integer from MIN to MAX, not 'TEXT'" (a number ...).
int64_t parse_int(const std::string& text, const std::string& what, int64_t min, int64_t max);
double parse_double(const std::string& text, const std::string& what, double min, double max);

}  // namespace io
}  // namespace frugal
