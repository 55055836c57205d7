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
// bytes); the number is read as io::to_double reads one (no blanks, signs, hex, inf or nan);
// std::nullopt for anything else, and for a count past 9e18 or a fraction of a byte.
std::optional<int64_t> parse_bytes(const std::string& text);
// "a byte count from MIN to MAX (64 PiB)": a range as messages state it.
std::string bytes_range(int64_t min, int64_t max);

}  // namespace io
}  // namespace frugal
