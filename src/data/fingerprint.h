// src/data/fingerprint.h — the 64-bit FNV-1a hash of some bytes as 16 hex digits: the fingerprint a
// token file or an examples file records of the tokenizer (and template) that made it, so that a
// file is never read with another.
#pragma once

#include <cstdint>
#include <cstdio>
#include <string>

namespace frugal {
namespace data {

inline std::string fnv1a64(const std::string& bytes) {
  uint64_t h = 0xcbf29ce484222325ull;
  for (unsigned char c : bytes) {
    h ^= c;
    h *= 0x100000001b3ull;
  }
  char buf[17];
  std::snprintf(buf, sizeof(buf), "%016llx", static_cast<unsigned long long>(h));
  return buf;
}

}  // namespace data
}  // namespace frugal
