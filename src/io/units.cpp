#include "frugal/io/units.h"

#include <cerrno>
#include <cmath>
#include <cstdio>
#include <cctype>
#include <cstdlib>

#include "frugal/io/numbers.h"

namespace frugal {
namespace io {

std::string human_bytes(int64_t bytes) {
  char buf[32];
  const double b = static_cast<double>(bytes);
  const double ab = std::fabs(b);
  if (ab >= 1024.0 * 1024 * 1024) {
    std::snprintf(buf, sizeof(buf), "%.2f GiB", b / (1024.0 * 1024 * 1024));
  } else if (ab >= 1024.0 * 1024) {
    std::snprintf(buf, sizeof(buf), "%.2f MiB", b / (1024.0 * 1024));
  } else if (ab >= 1024.0) {
    std::snprintf(buf, sizeof(buf), "%.1f KiB", b / 1024.0);
  } else {
    std::snprintf(buf, sizeof(buf), "%lld B", static_cast<long long>(bytes));
  }
  return buf;
}

std::optional<int64_t> parse_bytes(const std::string& text) {
  // The number, then the unit: trailing letters (so "1e3" is a number and "5e" a bad unit).
  size_t unit_at = text.size();
  while (unit_at > 0 && std::isalpha(static_cast<unsigned char>(text[unit_at - 1]))) --unit_at;
  const std::string number = text.substr(0, unit_at);
  const std::optional<double> value = to_double(number);
  if (!value || *value < 0 || (*value == 0 && text[0] == '-')) return std::nullopt;
  const std::string unit = text.substr(unit_at);
  double scale = 0;
  if (unit.empty() || unit == "B") {
    scale = 1;
  } else if (unit == "K" || unit == "KiB") {
    scale = 1024.0;
  } else if (unit == "M" || unit == "MiB") {
    scale = 1024.0 * 1024;
  } else if (unit == "G" || unit == "GiB") {
    scale = 1024.0 * 1024 * 1024;
  } else {
    return std::nullopt;
  }
  constexpr int64_t kMax = 9'000'000'000'000'000'000;
  // A whole number is counted exactly (a double would round 2^56 + 1 to 2^56, past a caller's bound).
  if (const std::optional<int64_t> whole = to_int(number)) {
    int64_t bytes = 0;
    if (__builtin_mul_overflow(*whole, static_cast<int64_t>(scale), &bytes) || bytes > kMax) return std::nullopt;
    return bytes;
  }
  const double bytes = *value * scale;
  if (bytes > static_cast<double>(kMax) || (scale == 1 && *value != std::floor(*value))) return std::nullopt;
  return static_cast<int64_t>(std::llround(bytes));
}

std::string bytes_range(int64_t min, int64_t max) {
  auto exact = [](int64_t b) {
    std::string s = std::to_string(b);
    if (b >= 1024) {
      const char* units[] = {"KiB", "MiB", "GiB", "TiB", "PiB", "EiB"};
      double v = static_cast<double>(b);
      int u = -1;
      while (v >= 1024 && u < 5) {
        v /= 1024;
        ++u;
      }
      char buf[32];
      std::snprintf(buf, sizeof(buf), " (%.4g %s)", v, units[u]);
      s += buf;
    }
    return s;
  };
  return "a byte count from " + exact(min) + " to " + exact(max);
}

}  // namespace io
}  // namespace frugal
