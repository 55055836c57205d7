// frugal/io/utf8.h — one code point appended to a string as UTF-8 (the JSON parser's \u escapes, the
// tokenizers' byte-to-character tables and normalizers).
//
//   std::string s;
//   frugal::io::append_utf8(s, 0x00E9);   // s == "\xC3\xA9" ("é")
#pragma once

#include <cstdint>
#include <string>

namespace frugal {
namespace io {

// cp: a Unicode scalar value (the caller checks the range); 1 to 4 bytes are appended.
inline void append_utf8(std::string& out, uint32_t cp) {
  if (cp < 0x80) {
    out += static_cast<char>(cp);
  } else if (cp < 0x800) {
    out += static_cast<char>(0xC0 | (cp >> 6));
    out += static_cast<char>(0x80 | (cp & 0x3F));
  } else if (cp < 0x10000) {
    out += static_cast<char>(0xE0 | (cp >> 12));
    out += static_cast<char>(0x80 | ((cp >> 6) & 0x3F));
    out += static_cast<char>(0x80 | (cp & 0x3F));
  } else {
    out += static_cast<char>(0xF0 | (cp >> 18));
    out += static_cast<char>(0x80 | ((cp >> 12) & 0x3F));
    out += static_cast<char>(0x80 | ((cp >> 6) & 0x3F));
    out += static_cast<char>(0x80 | (cp & 0x3F));
  }
}

}  // namespace io
}  // namespace frugal
