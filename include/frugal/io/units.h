// frugal/io/units.h — byte counts for people: printing and parsing.
//
//   frugal::io::human_bytes(3 << 20);          // "3.00 MiB"
//   frugal::io::parse_bytes("64MiB");          // 67108864 (also "512", "1.5GiB", "20M", "4096KiB")
#pragma once

#include <cstdint>
#include <optional>
#include <string>

namespace frugal {
namespace io {

std::string human_bytes(int64_t bytes);

// A non-negative byte count with an optional binary unit (K, KiB, M, MiB, G, GiB; B or none for
// bytes); std::nullopt for anything else.
std::optional<int64_t> parse_bytes(const std::string& text);

}  // namespace io
}  // namespace frugal
