#include "frugal/io/numbers.h"

#include <cerrno>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <limits>
#include <sstream>
#include <stdexcept>

namespace frugal {
namespace io {
namespace {

bool is_digit(char c) { return c >= '0' && c <= '9'; }

// Skips digits from `i`; returns how many there were.
size_t digits(const std::string& t, size_t& i) {
  const size_t start = i;
  while (i < t.size() && is_digit(t[i])) ++i;
  return i - start;
}

std::string format_double(double d) {
  std::ostringstream s;
  s.precision(10);
  s << d;
  return s.str();
}

}  // namespace

std::optional<int64_t> to_int(const std::string& text) {
  size_t i = 0;
  const bool negative = !text.empty() && text[0] == '-';
  if (negative) ++i;
  if (digits(text, i) == 0 || i != text.size()) return std::nullopt;
  // Accumulated negatively, so that INT64_MIN (whose magnitude int64_t cannot hold) fits.
  int64_t v = 0;
  for (size_t k = negative ? 1 : 0; k < text.size(); ++k) {
    const int d = text[k] - '0';
    if (v < (std::numeric_limits<int64_t>::min() + d) / 10) return std::nullopt;
    v = v * 10 - d;
  }
  if (!negative) {
    if (v == std::numeric_limits<int64_t>::min()) return std::nullopt;
    v = -v;
  }
  return v;
}

std::optional<double> to_double(const std::string& text) {
  // The grammar first, so strtod's extras (blanks, '+', hex, inf, nan) never get in.
  size_t i = 0;
  if (i < text.size() && text[i] == '-') ++i;
  size_t mantissa = digits(text, i);
  if (i < text.size() && text[i] == '.') {
    ++i;
    mantissa += digits(text, i);
  }
  if (mantissa == 0) return std::nullopt;
  if (i < text.size() && (text[i] == 'e' || text[i] == 'E')) {
    ++i;
    if (i < text.size() && (text[i] == '-' || text[i] == '+')) ++i;
    if (digits(text, i) == 0) return std::nullopt;
  }
  if (i != text.size()) return std::nullopt;
  errno = 0;
  char* end = nullptr;
  const double v = std::strtod(text.c_str(), &end);
  if (end != text.c_str() + text.size() || !std::isfinite(v)) return std::nullopt;
  // ERANGE with a finite result is an underflow: the value is 0 or subnormal, which is what it is.
  if (errno == ERANGE && std::fabs(v) >= std::numeric_limits<double>::min()) return std::nullopt;
  return v;
}

std::string int_range(int64_t min, int64_t max) { return "an integer from " + std::to_string(min) + " to " + std::to_string(max); }

std::string double_range(double min, double max) { return "a number from " + format_double(min) + " to " + format_double(max); }

std::string quote_text(const std::string& text) {
  constexpr size_t kShown = 40;
  std::string out;
  for (size_t i = 0; i < text.size() && i < kShown; ++i) {
    const unsigned char c = static_cast<unsigned char>(text[i]);
    if (c == '\n') {
      out += "\\n";
    } else if (c == '\t') {
      out += "\\t";
    } else if (c == '\\') {
      out += "\\\\";
    } else if (c < 0x20 || c == 0x7f) {
      char buf[8];
      std::snprintf(buf, sizeof(buf), "\\x%02x", c);
      out += buf;
    } else {
      out += static_cast<char>(c);
    }
  }
  if (text.size() > kShown) out += "... (" + std::to_string(text.size()) + " bytes)";
  return "'" + out + "'";
}

int64_t parse_int(const std::string& text, const std::string& what, int64_t min, int64_t max) {
  const std::optional<int64_t> v = to_int(text);
  if (!v || *v < min || *v > max) throw std::invalid_argument(what + " must be " + int_range(min, max) + ", not " + quote_text(text));
  return *v;
}

double parse_double(const std::string& text, const std::string& what, double min, double max) {
  const std::optional<double> v = to_double(text);
  if (!v || *v < min || *v > max) throw std::invalid_argument(what + " must be " + double_range(min, max) + ", not " + quote_text(text));
  return *v;
}

}  // namespace io
}  // namespace frugal
