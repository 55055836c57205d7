// tokenizer.json's text stages: UTF-8 checks, the PCRE2 regex, normalizers and pre-tokenizers.
#define PCRE2_CODE_UNIT_WIDTH 8
#include <pcre2.h>
#include <utf8proc.h>

#include <algorithm>
#include <cctype>
#include <cstdlib>
#include <stdexcept>

#include "hf_pipeline.h"

namespace frugal {
namespace data {
namespace hf {

using io::JsonValue;

void refuse(const std::string& where, const std::string& why) { throw std::invalid_argument("tokenizer.json: " + where + ": " + why); }

void check_fields(const JsonValue& obj, const std::string& where, const std::vector<std::string>& known) {
  if (!obj.is_object()) refuse(where, "must be an object");
  for (const auto& m : obj.members()) {
    if (m.first == "type") continue;
    if (std::find(known.begin(), known.end(), m.first) == known.end()) refuse(where, "field '" + m.first + "' is not supported");
  }
}

const JsonValue& need(const JsonValue& obj, const std::string& key, const std::string& where) {
  const JsonValue* v = obj.is_object() ? obj.find(key) : nullptr;
  if (!v) refuse(where, "field '" + key + "' is missing");
  return *v;
}

std::string type_of(const JsonValue& obj, const std::string& where) {
  const JsonValue& t = need(obj, "type", where);
  if (!t.is_string()) refuse(where, "field 'type' must be a string");
  return t.as_string();
}

namespace {

bool get_bool(const JsonValue& obj, const std::string& key, bool fallback, const std::string& where) {
  const JsonValue* v = obj.find(key);
  if (!v || v->is_null()) return fallback;
  if (!v->is_bool()) refuse(where, "field '" + key + "' must be true or false");
  return v->as_bool();
}

std::string get_string(const JsonValue& obj, const std::string& key, const std::string& where) {
  const JsonValue& v = need(obj, key, where);
  if (!v.is_string()) refuse(where, "field '" + key + "' must be a string");
  return v.as_string();
}

// {"String": s} or {"Regex": r}
std::unique_ptr<Regex> make_pattern(const JsonValue& obj, const std::string& where) {
  const JsonValue& p = need(obj, "pattern", where);
  if (p.is_object() && p.members().size() == 1 && p.members()[0].second.is_string()) {
    const auto& m = p.members()[0];
    if (m.first == "String") return std::make_unique<Regex>(m.second.as_string(), true, where);
    if (m.first == "Regex") return std::make_unique<Regex>(m.second.as_string(), false, where);
  }
  refuse(where, "field 'pattern' must be {\"String\": ...} or {\"Regex\": ...}");
}

bool is_whitespace(uint32_t c) {  // Unicode White_Space, as Rust's char::is_whitespace
  return (c >= 9 && c <= 13) || c == 32 || c == 0x85 || c == 0xA0 || c == 0x1680 || (c >= 0x2000 && c <= 0x200A) || c == 0x2028 ||
         c == 0x2029 || c == 0x202F || c == 0x205F || c == 0x3000;
}

// ---- normalizers ----
struct SequenceNormalizer : Normalizer {
  std::vector<std::unique_ptr<Normalizer>> steps;
  void apply(std::string& s) const override {
    for (const auto& n : steps) n->apply(s);
  }
};
struct PrependNormalizer : Normalizer {
  std::string prefix;
  void apply(std::string& s) const override {
    if (!s.empty()) s.insert(0, prefix);
  }
};
struct ReplaceNormalizer : Normalizer {
  std::unique_ptr<Regex> pattern;
  std::string content;
  void apply(std::string& s) const override {
    const auto found = pattern->find_all(s);
    if (found.empty()) return;
    std::string out;
    size_t at = 0;
    for (const auto& m : found) {
      out.append(s, at, m.first - at);
      out += content;
      at = m.second;
    }
    out.append(s, at, std::string::npos);
    s.swap(out);
  }
};
struct UnicodeNormalizer : Normalizer {
  int options = 0;
  void apply(std::string& s) const override {
    if (s.empty()) return;
    utf8proc_uint8_t* out = nullptr;
    const auto n = utf8proc_map(reinterpret_cast<const utf8proc_uint8_t*>(s.data()), static_cast<utf8proc_ssize_t>(s.size()), &out,
                                static_cast<utf8proc_option_t>(options));
    if (n < 0) throw std::invalid_argument(std::string("tokenizer: cannot normalize the text: ") + utf8proc_errmsg(n));
    s.assign(reinterpret_cast<char*>(out), static_cast<size_t>(n));
    std::free(out);
  }
};
struct LowercaseNormalizer : Normalizer {
  void apply(std::string& s) const override {
    std::string out;
    out.reserve(s.size());
    for (size_t i = 0; i < s.size();) {
      utf8proc_int32_t c = 0;
      const auto n =
          utf8proc_iterate(reinterpret_cast<const utf8proc_uint8_t*>(s.data() + i), static_cast<utf8proc_ssize_t>(s.size() - i), &c);
      append_utf8(out, static_cast<uint32_t>(utf8proc_tolower(c)));
      i += static_cast<size_t>(n > 0 ? n : 1);
    }
    s.swap(out);
  }
};
struct StripNormalizer : Normalizer {
  bool left = true, right = true;
  void apply(std::string& s) const override {
    size_t b = 0, e = s.size();
    while (left && b < e) {
      utf8proc_int32_t c = 0;
      const auto n = utf8proc_iterate(reinterpret_cast<const utf8proc_uint8_t*>(s.data() + b), static_cast<utf8proc_ssize_t>(e - b), &c);
      if (n <= 0 || !is_whitespace(static_cast<uint32_t>(c))) break;
      b += static_cast<size_t>(n);
    }
    while (right && e > b) {
      size_t start = e - 1;
      while (start > b && (static_cast<unsigned char>(s[start]) & 0xC0) == 0x80) --start;
      utf8proc_int32_t c = 0;
      utf8proc_iterate(reinterpret_cast<const utf8proc_uint8_t*>(s.data() + start), static_cast<utf8proc_ssize_t>(e - start), &c);
      if (!is_whitespace(static_cast<uint32_t>(c))) break;
      e = start;
    }
    s = s.substr(b, e - b);
  }
};

// ---- pre-tokenizers ----
enum class Behavior { removed, isolated, merged_with_previous, merged_with_next, contiguous };

// Splits each piece at the pattern's matches (or, inverted, at what lies between them), as Split does.
void split_pieces(std::vector<Piece>& pieces, const Regex& re, Behavior behavior, bool invert) {
  std::vector<Piece> out;
  out.reserve(pieces.size());
  for (Piece& p : pieces) {
    std::vector<std::pair<std::pair<size_t, size_t>, bool>> parts;  // ((start, end), is_match)
    size_t prev = 0;
    for (const auto& m : re.find_all(p.text)) {
      if (m.first != prev) parts.push_back({{prev, m.first}, invert});
      parts.push_back({m, !invert});
      prev = m.second;
    }
    if (prev != p.text.size()) parts.push_back({{prev, p.text.size()}, invert});
    std::vector<std::pair<size_t, size_t>> spans;
    bool previous_match = false;
    switch (behavior) {
      case Behavior::removed:
        for (const auto& x : parts)
          if (!x.second) spans.push_back(x.first);
        break;
      case Behavior::isolated:
        for (const auto& x : parts) spans.push_back(x.first);
        break;
      case Behavior::merged_with_previous:
        for (const auto& x : parts) {
          if (x.second && !previous_match && !spans.empty())
            spans.back().second = x.first.second;
          else
            spans.push_back(x.first);
          previous_match = x.second;
        }
        break;
      case Behavior::contiguous:
        for (const auto& x : parts) {
          if (x.second == previous_match && !spans.empty())
            spans.back().second = x.first.second;
          else
            spans.push_back(x.first);
          previous_match = x.second;
        }
        break;
      case Behavior::merged_with_next:
        for (auto it = parts.rbegin(); it != parts.rend(); ++it) {
          if (it->second && !previous_match && !spans.empty())
            spans.back().first = it->first.first;
          else
            spans.push_back(it->first);
          previous_match = it->second;
        }
        std::reverse(spans.begin(), spans.end());
        break;
    }
    for (const auto& s : spans) {
      if (s.first == s.second) continue;
      out.push_back(Piece{p.text.substr(s.first, s.second - s.first), p.at_origin && s.first == 0});
    }
  }
  pieces.swap(out);
}

struct SequencePreTokenizer : PreTokenizer {
  std::vector<std::unique_ptr<PreTokenizer>> steps;
  void apply(std::vector<Piece>& pieces) const override {
    for (const auto& s : steps) s->apply(pieces);
  }
};
struct SplitPreTokenizer : PreTokenizer {
  std::unique_ptr<Regex> pattern;
  Behavior behavior = Behavior::isolated;
  bool invert = false;
  void apply(std::vector<Piece>& pieces) const override { split_pieces(pieces, *pattern, behavior, invert); }
};
const char* kGpt2Pattern = R"('s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+)";
struct ByteLevelPreTokenizer : PreTokenizer {
  bool add_prefix_space = true;
  std::unique_ptr<Regex> regex;  // null: use_regex false
  void apply(std::vector<Piece>& pieces) const override {
    if (add_prefix_space) {
      // A new string rather than insert(0, " "): GCC 12 warns (-Wrestrict) on the inlined overlap check.
      for (Piece& p : pieces) {
        if (p.text.empty() || p.text[0] != ' ') p.text = ' ' + p.text;
      }
    }
    if (regex) split_pieces(pieces, *regex, Behavior::isolated, false);
    const auto& table = byte_to_unicode();
    for (Piece& p : pieces) {
      std::string mapped;
      mapped.reserve(p.text.size() * 2);
      for (unsigned char c : p.text) mapped += table[c];
      p.text.swap(mapped);
    }
  }
};
struct MetaspacePreTokenizer : PreTokenizer {
  std::string replacement;
  enum class Prepend { always, first, never } prepend = Prepend::always;
  bool split = true;
  std::unique_ptr<Regex> at_replacement;
  void apply(std::vector<Piece>& pieces) const override {
    for (Piece& p : pieces) {
      std::string t;
      t.reserve(p.text.size() + replacement.size());
      for (char c : p.text) {
        if (c == ' ')
          t += replacement;
        else
          t += c;
      }
      const bool starts = t.compare(0, replacement.size(), replacement) == 0;
      if (!starts && (prepend == Prepend::always || (prepend == Prepend::first && p.at_origin))) t.insert(0, replacement);
      p.text.swap(t);
    }
    if (split) split_pieces(pieces, *at_replacement, Behavior::merged_with_next, false);
  }
};

}  // namespace

std::unique_ptr<Normalizer> make_normalizer(const JsonValue& v, const std::string& where) {
  if (v.is_null()) return nullptr;
  const std::string type = type_of(v, where);
  const std::string at = where + " type '" + type + "'";
  if (type == "Sequence") {
    check_fields(v, at, {"normalizers"});
    auto seq = std::make_unique<SequenceNormalizer>();
    const JsonValue& list = need(v, "normalizers", at);
    if (!list.is_array()) refuse(at, "field 'normalizers' must be a list");
    for (size_t i = 0; i < list.items().size(); ++i) {
      auto n = make_normalizer(list.items()[i], where + "[" + std::to_string(i) + "]");
      if (n) seq->steps.push_back(std::move(n));
    }
    return seq;
  }
  if (type == "Prepend") {
    check_fields(v, at, {"prepend"});
    auto n = std::make_unique<PrependNormalizer>();
    n->prefix = get_string(v, "prepend", at);
    return n;
  }
  if (type == "Replace") {
    check_fields(v, at, {"pattern", "content"});
    auto n = std::make_unique<ReplaceNormalizer>();
    n->pattern = make_pattern(v, at);
    n->content = get_string(v, "content", at);
    return n;
  }
  if (type == "NFC" || type == "NFD" || type == "NFKC" || type == "NFKD") {
    check_fields(v, at, {});
    auto n = std::make_unique<UnicodeNormalizer>();
    n->options =
        UTF8PROC_STABLE | (type[type.size() - 1] == 'C' ? UTF8PROC_COMPOSE : UTF8PROC_DECOMPOSE) | (type.size() == 4 ? UTF8PROC_COMPAT : 0);
    return n;
  }
  if (type == "Lowercase") {
    check_fields(v, at, {});
    return std::make_unique<LowercaseNormalizer>();
  }
  if (type == "Strip") {
    check_fields(v, at, {"strip_left", "strip_right"});
    auto n = std::make_unique<StripNormalizer>();
    n->left = get_bool(v, "strip_left", true, at);
    n->right = get_bool(v, "strip_right", true, at);
    return n;
  }
  refuse(where, "type '" + type + "' is not supported (supported: Sequence, Prepend, Replace, NFC, NFD, NFKC, NFKD, Lowercase, Strip)");
}

std::unique_ptr<PreTokenizer> make_pre_tokenizer(const JsonValue& v, const std::string& where) {
  if (v.is_null()) return nullptr;
  const std::string type = type_of(v, where);
  const std::string at = where + " type '" + type + "'";
  if (type == "Sequence") {
    check_fields(v, at, {"pretokenizers"});
    auto seq = std::make_unique<SequencePreTokenizer>();
    const JsonValue& list = need(v, "pretokenizers", at);
    if (!list.is_array()) refuse(at, "field 'pretokenizers' must be a list");
    for (size_t i = 0; i < list.items().size(); ++i) {
      auto p = make_pre_tokenizer(list.items()[i], where + "[" + std::to_string(i) + "]");
      if (p) seq->steps.push_back(std::move(p));
    }
    return seq;
  }
  if (type == "Split") {
    check_fields(v, at, {"pattern", "behavior", "invert"});
    auto s = std::make_unique<SplitPreTokenizer>();
    s->pattern = make_pattern(v, at);
    const std::string b = get_string(v, "behavior", at);
    if (b == "Removed")
      s->behavior = Behavior::removed;
    else if (b == "Isolated")
      s->behavior = Behavior::isolated;
    else if (b == "MergedWithPrevious")
      s->behavior = Behavior::merged_with_previous;
    else if (b == "MergedWithNext")
      s->behavior = Behavior::merged_with_next;
    else if (b == "Contiguous")
      s->behavior = Behavior::contiguous;
    else
      refuse(at, "behavior '" + b + "' is not one of Removed, Isolated, MergedWithPrevious, MergedWithNext, Contiguous");
    s->invert = get_bool(v, "invert", false, at);
    return s;
  }
  if (type == "ByteLevel") {
    check_fields(v, at, {"add_prefix_space", "trim_offsets", "use_regex"});  // trim_offsets: offsets only
    auto b = std::make_unique<ByteLevelPreTokenizer>();
    b->add_prefix_space = get_bool(v, "add_prefix_space", true, at);
    if (get_bool(v, "use_regex", true, at)) b->regex = std::make_unique<Regex>(kGpt2Pattern, false, at);
    return b;
  }
  if (type == "Metaspace") {
    check_fields(v, at, {"replacement", "prepend_scheme", "split", "add_prefix_space", "str_rep"});
    auto m = std::make_unique<MetaspacePreTokenizer>();
    m->replacement = get_string(v, "replacement", at);
    if (utf8_length(static_cast<unsigned char>(m->replacement.empty() ? 0 : m->replacement[0])) != m->replacement.size() ||
        m->replacement.empty()) {
      refuse(at, "field 'replacement' must be one character");
    }
    if (const JsonValue* ps = v.find("prepend_scheme"); ps && !ps->is_null()) {
      const std::string s = ps->is_string() ? ps->as_string() : "";
      if (s == "always")
        m->prepend = MetaspacePreTokenizer::Prepend::always;
      else if (s == "first")
        m->prepend = MetaspacePreTokenizer::Prepend::first;
      else if (s == "never")
        m->prepend = MetaspacePreTokenizer::Prepend::never;
      else
        refuse(at, "prepend_scheme must be always, first or never");
    } else if (!get_bool(v, "add_prefix_space", true, at)) {
      m->prepend = MetaspacePreTokenizer::Prepend::never;
    }
    m->split = get_bool(v, "split", true, at);
    m->at_replacement = std::make_unique<Regex>(m->replacement, true, at);
    return m;
  }
  if (type == "Digits") {
    check_fields(v, at, {"individual_digits"});
    auto s = std::make_unique<SplitPreTokenizer>();
    s->pattern = std::make_unique<Regex>(get_bool(v, "individual_digits", false, at) ? "\\p{N}" : "\\p{N}+", false, at);
    return s;
  }
  refuse(where, "type '" + type + "' is not supported (supported: Sequence, Split, ByteLevel, Metaspace, Digits)");
}

// ---- UTF-8 and the regex ----

size_t utf8_length(unsigned char c) { return c < 0x80 ? 1 : (c >> 5) == 6 ? 2 : (c >> 4) == 14 ? 3 : (c >> 3) == 30 ? 4 : 1; }

void check_utf8(const std::string& s, const char* what) {
  const auto* p = reinterpret_cast<const unsigned char*>(s.data());
  const size_t n = s.size();
  for (size_t i = 0; i < n;) {
    const unsigned char c = p[i];
    if (c < 0x80) {
      ++i;
      continue;
    }
    size_t len = utf8_length(c);
    uint32_t cp = len == 2 ? (c & 0x1F) : len == 3 ? (c & 0x0F) : (c & 0x07);
    bool ok = len > 1 && i + len <= n;
    for (size_t k = 1; ok && k < len; ++k) {
      ok = (p[i + k] & 0xC0) == 0x80;
      cp = (cp << 6) | (p[i + k] & 0x3F);
    }
    // Overlong forms, surrogates and code points past U+10FFFF are not UTF-8 either.
    ok = ok && !(len == 2 && cp < 0x80) && !(len == 3 && (cp < 0x800 || (cp >= 0xD800 && cp <= 0xDFFF))) &&
         !(len == 4 && (cp < 0x10000 || cp > 0x10FFFF));
    if (!ok) throw std::invalid_argument(std::string(what) + " is not valid UTF-8 (at byte " + std::to_string(i) + ")");
    i += len;
  }
}

const std::vector<std::string>& byte_to_unicode() {
  static const std::vector<std::string> table = [] {
    std::vector<std::string> t(256);
    uint32_t next = 256;
    for (uint32_t b = 0; b < 256; ++b) {
      const bool printable = (b >= '!' && b <= '~') || (b >= 0xA1 && b <= 0xAC) || (b >= 0xAE && b <= 0xFF);
      append_utf8(t[b], printable ? b : next++);
    }
    return t;
  }();
  return table;
}

Regex::Regex(const std::string& pattern, bool literal, const std::string& where) {
  int error = 0;
  PCRE2_SIZE offset = 0;
  std::string source;  // a literal's ASCII punctuation escaped (PCRE2_LITERAL does not combine with UCP)
  for (char c : pattern) {
    if (literal && static_cast<unsigned char>(c) < 0x80 && !std::isalnum(static_cast<unsigned char>(c))) source += '\\';
    source += c;
  }
  const uint32_t options = PCRE2_UTF | PCRE2_UCP;
  code_ = pcre2_compile(reinterpret_cast<PCRE2_SPTR>(source.data()), source.size(), options, &error, &offset, nullptr);
  if (!code_) {
    PCRE2_UCHAR message[256];
    pcre2_get_error_message(error, message, sizeof(message));
    refuse(where,
           "pattern '" + pattern + "' does not compile at offset " + std::to_string(offset) + ": " + reinterpret_cast<char*>(message));
  }
  pcre2_jit_compile(static_cast<pcre2_code*>(code_), PCRE2_JIT_COMPLETE);  // falls back to the interpreter when unavailable
}

Regex::~Regex() { pcre2_code_free(static_cast<pcre2_code*>(code_)); }

std::vector<std::pair<size_t, size_t>> Regex::find_all(const std::string& s) const {
  std::vector<std::pair<size_t, size_t>> out;
  auto* code = static_cast<pcre2_code*>(code_);
  pcre2_match_data* md = pcre2_match_data_create_from_pattern(code, nullptr);
  const auto* subject = reinterpret_cast<PCRE2_SPTR>(s.data());
  size_t at = 0;
  while (at <= s.size()) {
    const int rc = pcre2_match(code, subject, s.size(), at, PCRE2_NO_UTF_CHECK, md, nullptr);
    if (rc == PCRE2_ERROR_NOMATCH) break;
    if (rc < 0) {
      pcre2_match_data_free(md);
      throw std::runtime_error("tokenizer: a pre-tokenizer regex failed (PCRE2 error " + std::to_string(rc) + ")");
    }
    const PCRE2_SIZE* ov = pcre2_get_ovector_pointer(md);
    out.emplace_back(ov[0], ov[1]);
    if (ov[1] > ov[0]) {
      at = ov[1];
    } else {  // an empty match: the next try starts one character on
      if (ov[1] >= s.size()) break;
      at = ov[1] + utf8_length(static_cast<unsigned char>(s[ov[1]]));
    }
  }
  pcre2_match_data_free(md);
  return out;
}

}  // namespace hf
}  // namespace data
}  // namespace frugal
