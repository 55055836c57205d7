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

// Writes one JSON document to a stream, value by value (a value in an object without its key: std::logic_error).
class JsonWriter {
 public:
  // indent > 0 pretty-prints with that many spaces per level; 0 writes one line; a negative indent
  // writes one line with no spaces at all (data embedded in a page).
  explicit JsonWriter(std::ostream& out, int indent = 2);

  JsonWriter& begin_object();               // opens an object: each value in it follows a key()
  JsonWriter& end_object();                 // closes the innermost object
  JsonWriter& begin_array();                // opens an array
  JsonWriter& end_array();                  // closes the innermost array
  JsonWriter& key(const std::string& k);    // the next value's key (escaped); std::logic_error outside an object
  JsonWriter& value(const std::string& v);  // a string, escaped
  JsonWriter& value(const char* v);         // a string, escaped
  JsonWriter& value(int64_t v);             // an integer
  // An integer.
  JsonWriter& value(int v) { return value(static_cast<int64_t>(v)); }
  JsonWriter& value(double v);  // NaN and infinities are written as null
  JsonWriter& value(bool v);    // true or false
  JsonWriter& null();           // a null

  // `s` as the inside of a JSON string: quotes, backslashes and control characters escaped, other bytes as they are.
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
