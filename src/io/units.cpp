#include "frugal/io/units.h"

#include <cerrno>
#include <cmath>
#include <cstdio>
#include <cstdlib>

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
  if (text.empty() || text[0] == '-' || text[0] == '+' || std::isspace(static_cast<unsigned char>(text[0]))) {
    return std::nullopt;
  }
  errno = 0;
  char* end = nullptr;
  const double value = std::strtod(text.c_str(), &end);
  if (end == text.c_str() || errno == ERANGE || !std::isfinite(value)) return std::nullopt;
  const std::string unit(end);
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
  const double bytes = value * scale;
  if (bytes > 9.0e18 || (scale == 1 && value != std::floor(value))) return std::nullopt;
  return static_cast<int64_t>(std::llround(bytes));
}

}  // namespace io
}  // namespace frugal
