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

// One parsed JSON value of any type (objects keep their members in file order).
class JsonValue {
 public:
  enum class Type { null, boolean, number, string, array, object };

  JsonValue() = default;
  static JsonValue make_bool(bool b);  // true or false
  // A number: `d` for as_double(); when `integral`, `i` for as_int().
  static JsonValue make_number(double d, bool integral, int64_t i);
  static JsonValue make_string(std::string s);                // a string
  static JsonValue make_array(std::vector<JsonValue> items);  // an array of `items`, in order
  // An object of `members`, in order (duplicate keys are not checked here).
  static JsonValue make_object(std::vector<std::pair<std::string, JsonValue>> members);

  // Which kind of value this is (null for a default-constructed one).
  Type type() const { return type_; }
  // Whether it is null.
  bool is_null() const { return type_ == Type::null; }
  // Whether it is an object.
  bool is_object() const { return type_ == Type::object; }
  // Whether it is an array.
  bool is_array() const { return type_ == Type::array; }
  // Whether it is a string.
  bool is_string() const { return type_ == Type::string; }
  // Whether it is a number, integral or not.
  bool is_number() const { return type_ == Type::number; }
  // Whether it is true or false.
  bool is_bool() const { return type_ == Type::boolean; }
  // Whether it is a number written as an integer that fits int64_t (as_int() accepts it).
  bool is_integer() const { return type_ == Type::number && integral_; }

  // Typed access; JsonError when the type differs (what = what the caller expected).
  bool as_bool() const;
  double as_double() const;                                               // any number
  int64_t as_int() const;                                                 // integral numbers only
  const std::string& as_string() const;                                   // the string, unescaped (UTF-8)
  const std::vector<JsonValue>& items() const;                            // an array's items, in order
  const std::vector<std::pair<std::string, JsonValue>>& members() const;  // in file order

  bool contains(const std::string& key) const;          // whether it is an object with member `key`
  const JsonValue& at(const std::string& key) const;    // JsonError naming the key when absent
  const JsonValue* find(const std::string& key) const;  // member `key`, or nullptr when absent or not an object

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
