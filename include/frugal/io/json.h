// frugal/io/json.h — a small streaming JSON writer for reports, timelines and metrics.
//
//   frugal::io::JsonWriter w(std::cout);
//   w.begin_object().key("peak_bytes").value(int64_t{123}).key("ok").value(true).end_object();
//   // {"peak_bytes": 123, "ok": true}
#pragma once

#include <cstdint>
#include <ostream>
#include <string>
#include <vector>

namespace frugal {
namespace io {

class JsonWriter {
 public:
  // indent > 0 pretty-prints with that many spaces per level; 0 writes one line; a negative indent
  // writes one line with no spaces at all (data embedded in a page).
  explicit JsonWriter(std::ostream& out, int indent = 2);

  JsonWriter& begin_object();
  JsonWriter& end_object();
  JsonWriter& begin_array();
  JsonWriter& end_array();
  JsonWriter& key(const std::string& k);
  JsonWriter& value(const std::string& v);
  JsonWriter& value(const char* v);
  JsonWriter& value(int64_t v);
  JsonWriter& value(int v) { return value(static_cast<int64_t>(v)); }
  JsonWriter& value(double v);  // NaN and infinities are written as null
  JsonWriter& value(bool v);
  JsonWriter& null();

  static std::string escape(const std::string& s);

 private:
  void before_value();
  void newline();
  std::ostream& out_;
  int indent_;
  struct Level {
    bool is_object;
    bool empty;
  };
  std::vector<Level> stack_;
  bool after_key_ = false;
};

}  // namespace io
}  // namespace frugal
