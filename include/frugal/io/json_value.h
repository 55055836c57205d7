// frugal/io/json_value.h — a strict JSON parser for headers and configs that may be hostile.
//
// Bounded: nesting deeper than 64 levels, strings with bad escapes, numbers out of range and
// trailing bytes are errors (JsonError with the byte offset), never crashes or huge allocations.
//
//   frugal::io::JsonValue v = frugal::io::parse_json(R"({"dim": 4096, "names": ["a", "b"]})");
//   int64_t dim = v.at("dim").as_int();
#pragma once

#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <stdexcept>
#include <string>
#include <vector>

namespace frugal {
namespace io {

struct JsonError : std::runtime_error {
  using std::runtime_error::runtime_error;
};

class JsonValue {
 public:
  enum class Type { null, boolean, number, string, array, object };

  JsonValue() = default;
  static JsonValue make_bool(bool b);
  static JsonValue make_number(double d, bool integral, int64_t i);
  static JsonValue make_string(std::string s);
  static JsonValue make_array(std::vector<JsonValue> items);
  static JsonValue make_object(std::vector<std::pair<std::string, JsonValue>> members);

  Type type() const { return type_; }
  bool is_null() const { return type_ == Type::null; }
  bool is_object() const { return type_ == Type::object; }
  bool is_array() const { return type_ == Type::array; }
  bool is_string() const { return type_ == Type::string; }
  bool is_number() const { return type_ == Type::number; }
  bool is_bool() const { return type_ == Type::boolean; }
  bool is_integer() const { return type_ == Type::number && integral_; }

  // Typed access; JsonError when the type differs (what = what the caller expected).
  bool as_bool() const;
  double as_double() const;
  int64_t as_int() const;  // integral numbers only
  const std::string& as_string() const;
  const std::vector<JsonValue>& items() const;
  const std::vector<std::pair<std::string, JsonValue>>& members() const;  // in file order

  bool contains(const std::string& key) const;
  const JsonValue& at(const std::string& key) const;  // JsonError naming the key when absent
  const JsonValue* find(const std::string& key) const;

 private:
  Type type_ = Type::null;
  bool bool_ = false;
  double number_ = 0;
  bool integral_ = false;
  int64_t int_ = 0;
  std::string string_;
  std::vector<JsonValue> items_;
  std::vector<std::pair<std::string, JsonValue>> members_;
};

// Parses exactly one JSON value (surrounding white space allowed). Duplicate object keys are an error.
JsonValue parse_json(const std::string& text);

// As parse_json, but when the document is an object, each item of its array member `key` goes to
// on_item as soon as it is parsed and is not kept (that member comes back as an empty array). For
// long lists, such as a trace's events, that would otherwise be held whole as a tree. An exception
// from on_item stops the parse and propagates.
using JsonItemSink = std::function<void(const JsonValue&)>;
JsonValue parse_json_streaming(const std::string& text, const std::string& key, const JsonItemSink& on_item);

}  // namespace io
}  // namespace frugal
