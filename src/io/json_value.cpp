#include "frugal/io/json_value.h"

#include "frugal/io/files.h"

#include <cerrno>
#include <cmath>
#include <cstdlib>
#include <set>

#include "frugal/io/utf8.h"

namespace frugal {
namespace io {

JsonValue JsonValue::make_bool(bool b) {
  JsonValue v;
  v.type_ = Type::boolean;
  v.bool_ = b;
  return v;
}
JsonValue JsonValue::make_number(double d, bool integral, int64_t i) {
  JsonValue v;
  v.type_ = Type::number;
  v.number_ = d;
  v.integral_ = integral;
  v.int_ = i;
  return v;
}
JsonValue JsonValue::make_string(std::string s) {
  JsonValue v;
  v.type_ = Type::string;
  v.string_ = std::move(s);
  return v;
}
JsonValue JsonValue::make_array(std::vector<JsonValue> items) {
  JsonValue v;
  v.type_ = Type::array;
  v.items_ = std::move(items);
  return v;
}
JsonValue JsonValue::make_object(std::vector<std::pair<std::string, JsonValue>> members) {
  JsonValue v;
  v.type_ = Type::object;
  v.members_ = std::move(members);
  return v;
}

bool JsonValue::as_bool() const {
  if (type_ != Type::boolean) throw JsonError("expected true or false");
  return bool_;
}
double JsonValue::as_double() const {
  if (type_ != Type::number) throw JsonError("expected a number");
  return number_;
}
int64_t JsonValue::as_int() const {
  if (type_ != Type::number || !integral_) throw JsonError("expected an integer");
  return int_;
}
const std::string& JsonValue::as_string() const {
  if (type_ != Type::string) throw JsonError("expected a string");
  return string_;
}
const std::vector<JsonValue>& JsonValue::items() const {
  if (type_ != Type::array) throw JsonError("expected an array");
  return items_;
}
const std::vector<std::pair<std::string, JsonValue>>& JsonValue::members() const {
  if (type_ != Type::object) throw JsonError("expected an object");
  return members_;
}
const JsonValue* JsonValue::find(const std::string& key) const {
  if (type_ != Type::object) return nullptr;
  for (const auto& m : members_) {
    if (m.first == key) return &m.second;
  }
  return nullptr;
}
bool JsonValue::contains(const std::string& key) const { return find(key) != nullptr; }
const JsonValue& JsonValue::at(const std::string& key) const {
  if (type_ != Type::object) throw JsonError("expected an object with key '" + key + "'");
  const JsonValue* v = find(key);
  if (!v) throw JsonError("missing key '" + key + "'");
  return *v;
}

namespace {

constexpr int kMaxDepth = 64;

class Parser {
 public:
  explicit Parser(const std::string& text, const std::string* stream_key = nullptr, const JsonItemSink* sink = nullptr)
      : s_(text), stream_key_(stream_key), sink_(sink) {}

  JsonValue parse_document() {
    JsonValue v = parse_value(0);
    skip_space();
    if (pos_ != s_.size()) fail("unexpected bytes after the JSON value");
    return v;
  }

 private:
  [[noreturn]] void fail(const std::string& what) const { throw JsonError("JSON: " + what + " at byte " + std::to_string(pos_)); }
  void skip_space() {
    while (pos_ < s_.size() && (s_[pos_] == ' ' || s_[pos_] == '\t' || s_[pos_] == '\n' || s_[pos_] == '\r')) ++pos_;
  }
  bool consume(const char* word) {
    size_t n = 0;
    while (word[n]) ++n;
    if (s_.compare(pos_, n, word) == 0) {
      pos_ += n;
      return true;
    }
    return false;
  }

  JsonValue parse_value(int depth) {
    if (depth > kMaxDepth) fail("nesting deeper than 64 levels");
    skip_space();
    if (pos_ >= s_.size()) fail("unexpected end");
    const char c = s_[pos_];
    if (c == '{') return parse_object(depth);
    if (c == '[') return parse_array(depth);
    if (c == '"') return JsonValue::make_string(parse_string());
    if (consume("true")) return JsonValue::make_bool(true);
    if (consume("false")) return JsonValue::make_bool(false);
    if (consume("null")) return JsonValue();
    if (c == '-' || (c >= '0' && c <= '9')) return parse_number();
    fail("unexpected character '" + printable(std::string(1, c)) + "'");
  }

  JsonValue parse_object(int depth) {
    ++pos_;  // {
    std::vector<std::pair<std::string, JsonValue>> members;
    std::set<std::string> keys;
    skip_space();
    if (pos_ < s_.size() && s_[pos_] == '}') {
      ++pos_;
      return JsonValue::make_object(std::move(members));
    }
    while (true) {
      skip_space();
      if (pos_ >= s_.size() || s_[pos_] != '"') fail("expected a string key");
      std::string key = parse_string();
      if (!keys.insert(key).second) fail("duplicate key '" + printable(key) + "'");
      skip_space();
      if (pos_ >= s_.size() || s_[pos_] != ':') fail("expected ':'");
      ++pos_;
      skip_space();
      // The streamed array: its items go to the sink one by one and are not kept.
      const bool stream = depth == 0 && stream_key_ && key == *stream_key_ && pos_ < s_.size() && s_[pos_] == '[';
      JsonValue v = stream ? parse_array(depth + 1, sink_) : parse_value(depth + 1);
      members.emplace_back(std::move(key), std::move(v));
      skip_space();
      if (pos_ < s_.size() && s_[pos_] == ',') {
        ++pos_;
        continue;
      }
      if (pos_ < s_.size() && s_[pos_] == '}') {
        ++pos_;
        return JsonValue::make_object(std::move(members));
      }
      fail("expected ',' or '}'");
    }
  }

  JsonValue parse_array(int depth, const JsonItemSink* sink = nullptr) {
    if (depth > kMaxDepth) fail("nesting deeper than 64 levels");
    ++pos_;  // [
    std::vector<JsonValue> items;
    skip_space();
    if (pos_ < s_.size() && s_[pos_] == ']') {
      ++pos_;
      return JsonValue::make_array(std::move(items));
    }
    while (true) {
      if (sink) {
        (*sink)(parse_value(depth + 1));
      } else {
        items.push_back(parse_value(depth + 1));
      }
      skip_space();
      if (pos_ < s_.size() && s_[pos_] == ',') {
        ++pos_;
        continue;
      }
      if (pos_ < s_.size() && s_[pos_] == ']') {
        ++pos_;
        return JsonValue::make_array(std::move(items));
      }
      fail("expected ',' or ']'");
    }
  }

  uint32_t parse_hex4() {
    if (pos_ + 4 > s_.size()) fail("short \\u escape");
    uint32_t v = 0;
    for (int i = 0; i < 4; ++i) {
      const char c = s_[pos_++];
      v <<= 4;
      if (c >= '0' && c <= '9') {
        v |= static_cast<uint32_t>(c - '0');
      } else if (c >= 'a' && c <= 'f') {
        v |= static_cast<uint32_t>(c - 'a' + 10);
      } else if (c >= 'A' && c <= 'F') {
        v |= static_cast<uint32_t>(c - 'A' + 10);
      } else {
        fail("bad \\u escape");
      }
    }
    return v;
  }

  std::string parse_string() {
    ++pos_;  // "
    std::string out;
    while (true) {
      if (pos_ >= s_.size()) fail("unterminated string");
      const unsigned char c = static_cast<unsigned char>(s_[pos_++]);
      if (c == '"') return out;
      if (c < 0x20) fail("control character in a string");
      if (c != '\\') {
        out += static_cast<char>(c);
        continue;
      }
      if (pos_ >= s_.size()) fail("unterminated escape");
      const char e = s_[pos_++];
      switch (e) {
        case '"': out += '"'; break;
        case '\\': out += '\\'; break;
        case '/': out += '/'; break;
        case 'b': out += '\b'; break;
        case 'f': out += '\f'; break;
        case 'n': out += '\n'; break;
        case 'r': out += '\r'; break;
        case 't': out += '\t'; break;
        case 'u': {
          uint32_t cp = parse_hex4();
          if (cp >= 0xD800 && cp < 0xDC00) {  // surrogate pair
            if (!consume("\\u")) fail("lone surrogate");
            const uint32_t lo = parse_hex4();
            if (lo < 0xDC00 || lo >= 0xE000) fail("bad surrogate pair");
            cp = 0x10000 + ((cp - 0xD800) << 10) + (lo - 0xDC00);
          } else if (cp >= 0xDC00 && cp < 0xE000) {
            fail("lone surrogate");
          }
          append_utf8(out, cp);
          break;
        }
        default: fail("bad escape '\\" + printable(std::string(1, e)) + "'");
      }
    }
  }

  JsonValue parse_number() {
    const size_t start = pos_;
    if (s_[pos_] == '-') ++pos_;
    auto digits = [&] {
      const size_t b = pos_;
      while (pos_ < s_.size() && s_[pos_] >= '0' && s_[pos_] <= '9') ++pos_;
      return pos_ - b;
    };
    if (pos_ < s_.size() && s_[pos_] == '0') {
      ++pos_;
    } else if (digits() == 0) {
      fail("bad number");
    }
    bool integral = true;
    if (pos_ < s_.size() && s_[pos_] == '.') {
      ++pos_;
      integral = false;
      if (digits() == 0) fail("bad number");
    }
    if (pos_ < s_.size() && (s_[pos_] == 'e' || s_[pos_] == 'E')) {
      ++pos_;
      integral = false;
      if (pos_ < s_.size() && (s_[pos_] == '+' || s_[pos_] == '-')) ++pos_;
      if (digits() == 0) fail("bad number");
    }
    const std::string text = s_.substr(start, pos_ - start);
    errno = 0;
    const double d = std::strtod(text.c_str(), nullptr);
    if (!std::isfinite(d)) fail("number out of range");
    int64_t i = 0;
    if (integral) {
      errno = 0;
      const long long ll = std::strtoll(text.c_str(), nullptr, 10);
      // An integer past int64 is still a JSON number (transformers writes model_max_length as
      // 1e30 in digits): kept as a double, so a reader that needs an integer refuses it by name.
      if (errno == ERANGE) integral = false;
      i = ll;
    }
    return JsonValue::make_number(d, integral, i);
  }

  const std::string& s_;
  size_t pos_ = 0;
  const std::string* stream_key_;  // the top-level member whose array items go to sink_ (or none)
  const JsonItemSink* sink_;
};

}  // namespace

JsonValue parse_json(const std::string& text) { return Parser(text).parse_document(); }

JsonValue parse_json_streaming(const std::string& text, const std::string& key, const JsonItemSink& on_item) {
  return Parser(text, &key, &on_item).parse_document();
}

}  // namespace io
}  // namespace frugal
