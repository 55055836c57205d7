// tokenizer.json's BPE model, its decoders and its post-processor.
#include <algorithm>
#include <cstdio>
#include <queue>
#include <stdexcept>

#include "hf_pipeline.h"

namespace frugal {
namespace data {
namespace hf {

using io::JsonValue;

namespace {

uint64_t pair_key(int32_t a, int32_t b) { return (static_cast<uint64_t>(static_cast<uint32_t>(a)) << 32) | static_cast<uint32_t>(b); }

bool flag(const JsonValue& obj, const std::string& key, const std::string& where) {
  const JsonValue* v = obj.find(key);
  if (!v || v->is_null()) return false;
  if (!v->is_bool()) refuse(where, "field '" + key + "' must be true or false");
  return v->as_bool();
}

constexpr size_t kCacheWordBytes = 256;    // longer pre-tokens are not cached
constexpr size_t kCacheEntries = 1 << 18;  // the cache is emptied when it holds this many

}  // namespace

Bpe::Bpe(const JsonValue& model, const std::string& where) {
  check_fields(model, where,
               {"dropout", "unk_token", "continuing_subword_prefix", "end_of_word_suffix", "fuse_unk", "byte_fallback", "ignore_merges",
                "vocab", "merges"});
  for (const char* unsupported : {"dropout", "continuing_subword_prefix", "end_of_word_suffix"}) {
    const JsonValue* v = model.find(unsupported);
    if (v && !v->is_null() && !(v->is_string() && v->as_string().empty())) {
      refuse(where, std::string("field '") + unsupported + "' is not supported (only null)");
    }
  }
  const JsonValue& vocab = need(model, "vocab", where);
  if (!vocab.is_object()) refuse(where, "field 'vocab' must be an object of token -> id");
  vocab_.reserve(vocab.members().size());
  for (const auto& m : vocab.members()) {
    if (!m.second.is_integer() || m.second.as_int() < 0 || m.second.as_int() >= (int64_t(1) << 31)) {
      refuse(where, "vocab entry '" + m.first + "' has no valid id");
    }
    vocab_[m.first] = static_cast<int32_t>(m.second.as_int());
  }
  const JsonValue& merges = need(model, "merges", where);
  if (!merges.is_array()) refuse(where, "field 'merges' must be a list");
  merges_.reserve(merges.items().size());
  for (size_t i = 0; i < merges.items().size(); ++i) {
    const JsonValue& m = merges.items()[i];
    std::string a, b;
    if (m.is_string()) {
      const std::string& s = m.as_string();
      const auto space = s.find(' ');
      if (space == std::string::npos || s.find(' ', space + 1) != std::string::npos) {
        refuse(where, "merges[" + std::to_string(i) + "] '" + s + "' is not two tokens separated by one space");
      }
      a = s.substr(0, space);
      b = s.substr(space + 1);
    } else if (m.is_array() && m.items().size() == 2 && m.items()[0].is_string() && m.items()[1].is_string()) {
      a = m.items()[0].as_string();
      b = m.items()[1].as_string();
    } else {
      refuse(where, "merges[" + std::to_string(i) + "] must be \"a b\" or [\"a\", \"b\"]");
    }
    const auto ia = vocab_.find(a), ib = vocab_.find(b), iab = vocab_.find(a + b);
    if (ia == vocab_.end() || ib == vocab_.end() || iab == vocab_.end()) {
      refuse(where, "merges[" + std::to_string(i) + "] ('" + a + "', '" + b + "') uses a token missing from the vocab");
    }
    merges_.emplace(pair_key(ia->second, ib->second), std::make_pair(static_cast<int32_t>(i), iab->second));
  }
  if (const JsonValue* u = model.find("unk_token"); u && !u->is_null()) {
    if (!u->is_string()) refuse(where, "field 'unk_token' must be a string or null");
    const auto it = vocab_.find(u->as_string());
    if (it == vocab_.end()) refuse(where, "unk_token '" + u->as_string() + "' is not in the vocab");
    unk_ = it->second;
  }
  fuse_unk_ = flag(model, "fuse_unk", where);
  byte_fallback_ = flag(model, "byte_fallback", where);
  ignore_merges_ = flag(model, "ignore_merges", where);
  if (byte_fallback_) {
    byte_ids_.assign(256, -1);
    for (int b = 0; b < 256; ++b) {
      char name[8];
      std::snprintf(name, sizeof(name), "<0x%02X>", b);
      const auto it = vocab_.find(name);
      if (it != vocab_.end()) byte_ids_[static_cast<size_t>(b)] = it->second;
    }
  }
}

void Bpe::encode_word(const std::string& word, std::vector<int32_t>& out) const {
  if (ignore_merges_) {
    const auto it = vocab_.find(word);
    if (it != vocab_.end()) {
      out.push_back(it->second);
      return;
    }
  }
  if (word.size() > kCacheWordBytes) return merge(word, out);
  {
    std::lock_guard<std::mutex> lock(cache_mutex_);
    const auto it = cache_.find(word);
    if (it != cache_.end()) {
      out.insert(out.end(), it->second.begin(), it->second.end());
      return;
    }
  }
  const size_t first = out.size();
  merge(word, out);
  std::lock_guard<std::mutex> lock(cache_mutex_);
  if (cache_.size() >= kCacheEntries) cache_.clear();
  cache_.emplace(word, std::vector<int32_t>(out.begin() + static_cast<std::ptrdiff_t>(first), out.end()));
}

// The word's characters (or their bytes, or unk) as symbols, then the lowest-ranked adjacent pair
// merged first (leftmost among equals), from a heap: O(n log n) in the word's length.
void Bpe::merge(const std::string& word, std::vector<int32_t>& out) const {
  struct Symbol {
    int32_t id, prev, next;
  };
  std::vector<Symbol> sym;
  sym.reserve(word.size());
  auto add = [&](int32_t id) {
    const int32_t n = static_cast<int32_t>(sym.size());
    sym.push_back(Symbol{id, n - 1, -1});
    if (n > 0) sym[static_cast<size_t>(n - 1)].next = n;
  };
  bool pending_unk = false;
  std::string ch;
  for (size_t i = 0; i < word.size();) {
    const size_t len = std::min(utf8_length(static_cast<unsigned char>(word[i])), word.size() - i);
    ch.assign(word, i, len);
    const auto it = vocab_.find(ch);
    if (it != vocab_.end()) {
      if (pending_unk) add(unk_), pending_unk = false;
      add(it->second);
    } else {
      bool bytes = byte_fallback_;
      for (size_t k = 0; bytes && k < len; ++k) bytes = byte_ids_[static_cast<unsigned char>(word[i + k])] >= 0;
      if (bytes) {
        // As tokenizers does: bytes do not end a run of unknowns being fused.
        for (size_t k = 0; k < len; ++k) add(byte_ids_[static_cast<unsigned char>(word[i + k])]);
      } else if (unk_ >= 0) {
        if (pending_unk && !fuse_unk_) add(unk_);
        pending_unk = true;
      }  // no unk token: the character is dropped, as tokenizers does
    }
    i += len;
  }
  if (pending_unk) add(unk_);

  struct Candidate {
    int32_t rank, pos, merged;
    bool operator>(const Candidate& o) const { return rank != o.rank ? rank > o.rank : pos > o.pos; }
  };
  std::priority_queue<Candidate, std::vector<Candidate>, std::greater<Candidate>> heap;
  auto consider = [&](int32_t pos) {
    const int32_t next = sym[static_cast<size_t>(pos)].next;
    if (next < 0) return;
    const auto it = merges_.find(pair_key(sym[static_cast<size_t>(pos)].id, sym[static_cast<size_t>(next)].id));
    if (it != merges_.end()) heap.push(Candidate{it->second.first, pos, it->second.second});
  };
  for (int32_t i = 0; i + 1 < static_cast<int32_t>(sym.size()); ++i) consider(i);
  std::vector<char> dead(sym.size(), 0);
  while (!heap.empty()) {
    const Candidate c = heap.top();
    heap.pop();
    Symbol& s = sym[static_cast<size_t>(c.pos)];
    if (dead[static_cast<size_t>(c.pos)] || s.next < 0) continue;
    const auto it = merges_.find(pair_key(s.id, sym[static_cast<size_t>(s.next)].id));
    if (it == merges_.end() || it->second.first != c.rank) continue;  // stale: a neighbour changed
    const int32_t gone = s.next;
    s.id = c.merged;
    s.next = sym[static_cast<size_t>(gone)].next;
    dead[static_cast<size_t>(gone)] = 1;
    if (s.next >= 0) sym[static_cast<size_t>(s.next)].prev = c.pos;
    if (s.prev >= 0) consider(s.prev);
    consider(c.pos);
  }
  for (size_t i = 0; i < sym.size(); ++i) {
    if (!dead[i]) out.push_back(sym[i].id);
  }
}

// ---- decoders ----
namespace {

struct SequenceDecoder : Decoder {
  std::vector<std::unique_ptr<Decoder>> steps;
  void apply(std::vector<std::string>& t) const override {
    for (const auto& d : steps) d->apply(t);
  }
};
struct ByteLevelDecoder : Decoder {  // the printable characters back to bytes; invalid UTF-8 becomes U+FFFD
  void apply(std::vector<std::string>& t) const override {
    static const std::unordered_map<std::string, unsigned char> inverse = [] {
      std::unordered_map<std::string, unsigned char> m;
      for (int b = 0; b < 256; ++b) m[byte_to_unicode()[static_cast<size_t>(b)]] = static_cast<unsigned char>(b);
      return m;
    }();
    std::string bytes, ch;
    for (const std::string& s : t) {
      for (size_t i = 0; i < s.size();) {
        const size_t len = std::min(utf8_length(static_cast<unsigned char>(s[i])), s.size() - i);
        ch.assign(s, i, len);
        const auto it = inverse.find(ch);
        if (it != inverse.end())
          bytes += static_cast<char>(it->second);
        else
          bytes += ch;
        i += len;
      }
    }
    t.assign(1, lossy_utf8(bytes));
  }
  static std::string lossy_utf8(const std::string& b) {
    std::string out;
    for (size_t i = 0; i < b.size();) {
      const size_t len = utf8_length(static_cast<unsigned char>(b[i]));
      try {
        if (len > 1 && i + len <= b.size()) {
          check_utf8(b.substr(i, len), "");
          out.append(b, i, len);
          i += len;
          continue;
        }
        if (len == 1 && static_cast<unsigned char>(b[i]) < 0x80) {
          out += b[i++];
          continue;
        }
      } catch (const std::invalid_argument&) {
      }
      out += "\xEF\xBF\xBD";
      ++i;
      while (i < b.size() && (static_cast<unsigned char>(b[i]) & 0xC0) == 0x80) ++i;
    }
    return out;
  }
};
struct MetaspaceDecoder : Decoder {
  std::string replacement;
  bool strip_first = true;  // prepend_scheme is not "never": the first token's replacement characters go
  void apply(std::vector<std::string>& t) const override {
    for (size_t i = 0; i < t.size(); ++i) {
      std::string out;
      for (size_t at = 0; at < t[i].size();) {
        if (t[i].compare(at, replacement.size(), replacement) == 0) {
          if (!(i == 0 && strip_first)) out += ' ';
          at += replacement.size();
        } else {
          out += t[i][at++];
        }
      }
      t[i].swap(out);
    }
  }
};
struct ReplaceDecoder : Decoder {
  std::unique_ptr<Regex> pattern;
  std::string content;
  void apply(std::vector<std::string>& t) const override {
    for (std::string& s : t) {
      std::string out;
      size_t at = 0;
      for (const auto& m : pattern->find_all(s)) {
        out.append(s, at, m.first - at);
        out += content;
        at = m.second;
      }
      out.append(s, at, std::string::npos);
      s.swap(out);
    }
  }
};
struct ByteFallbackDecoder : Decoder {
  void apply(std::vector<std::string>& t) const override {
    std::vector<std::string> out;
    std::string bytes;
    size_t n_bytes = 0;
    auto flush = [&] {
      if (n_bytes == 0) return;
      try {
        check_utf8(bytes, "");
        out.push_back(bytes);
      } catch (const std::invalid_argument&) {
        for (size_t k = 0; k < n_bytes; ++k) out.push_back("\xEF\xBF\xBD");
      }
      bytes.clear();
      n_bytes = 0;
    };
    for (std::string& s : t) {
      unsigned value = 0;
      if (s.size() == 6 && s.compare(0, 3, "<0x") == 0 && s[5] == '>' && std::sscanf(s.c_str() + 3, "%2x", &value) == 1 &&
          std::isxdigit(static_cast<unsigned char>(s[3])) && std::isxdigit(static_cast<unsigned char>(s[4]))) {
        bytes += static_cast<char>(value);
        ++n_bytes;
      } else {
        flush();
        out.push_back(std::move(s));
      }
    }
    flush();
    t.swap(out);
  }
};
struct FuseDecoder : Decoder {
  void apply(std::vector<std::string>& t) const override {
    std::string all;
    for (const auto& s : t) all += s;
    t.assign(1, all);
  }
};
struct StripDecoder : Decoder {
  std::string content;
  int64_t start = 0, stop = 0;
  void apply(std::vector<std::string>& t) const override {
    for (std::string& s : t) {
      size_t b = 0, e = s.size();
      for (int64_t k = 0; k < start && s.compare(b, content.size(), content) == 0 && b + content.size() <= e; ++k) b += content.size();
      for (int64_t k = 0; k < stop && e >= b + content.size() && s.compare(e - content.size(), content.size(), content) == 0; ++k) {
        e -= content.size();
      }
      s = s.substr(b, e - b);
    }
  }
};

}  // namespace

std::unique_ptr<Decoder> make_decoder(const JsonValue& v, const std::string& where) {
  if (v.is_null()) return nullptr;
  const std::string type = type_of(v, where);
  const std::string at = where + " type '" + type + "'";
  auto str = [&](const char* key) {
    const JsonValue& s = need(v, key, at);
    if (!s.is_string()) refuse(at, std::string("field '") + key + "' must be a string");
    return s.as_string();
  };
  if (type == "Sequence") {
    check_fields(v, at, {"decoders"});
    auto seq = std::make_unique<SequenceDecoder>();
    const JsonValue& list = need(v, "decoders", at);
    if (!list.is_array()) refuse(at, "field 'decoders' must be a list");
    for (size_t i = 0; i < list.items().size(); ++i) {
      auto d = make_decoder(list.items()[i], where + "[" + std::to_string(i) + "]");
      if (d) seq->steps.push_back(std::move(d));
    }
    return seq;
  }
  if (type == "ByteLevel") {
    check_fields(v, at, {"add_prefix_space", "trim_offsets", "use_regex"});
    return std::make_unique<ByteLevelDecoder>();
  }
  if (type == "Metaspace") {
    check_fields(v, at, {"replacement", "prepend_scheme", "split", "add_prefix_space", "str_rep"});
    auto d = std::make_unique<MetaspaceDecoder>();
    d->replacement = str("replacement");
    const JsonValue* ps = v.find("prepend_scheme");
    const JsonValue* aps = v.find("add_prefix_space");
    if (ps && ps->is_string())
      d->strip_first = ps->as_string() != "never";
    else if (aps && aps->is_bool())
      d->strip_first = aps->as_bool();
    return d;
  }
  if (type == "Replace") {
    check_fields(v, at, {"pattern", "content"});
    auto d = std::make_unique<ReplaceDecoder>();
    const JsonValue& p = need(v, "pattern", at);
    if (!(p.is_object() && p.members().size() == 1 && p.members()[0].second.is_string() &&
          (p.members()[0].first == "String" || p.members()[0].first == "Regex"))) {
      refuse(at, "field 'pattern' must be {\"String\": ...} or {\"Regex\": ...}");
    }
    d->pattern = std::make_unique<Regex>(p.members()[0].second.as_string(), p.members()[0].first == "String", at);
    d->content = str("content");
    return d;
  }
  if (type == "ByteFallback") {
    check_fields(v, at, {});
    return std::make_unique<ByteFallbackDecoder>();
  }
  if (type == "Fuse") {
    check_fields(v, at, {});
    return std::make_unique<FuseDecoder>();
  }
  if (type == "Strip") {
    check_fields(v, at, {"content", "start", "stop"});
    auto d = std::make_unique<StripDecoder>();
    d->content = str("content");
    const JsonValue& s = need(v, "start", at);
    const JsonValue& e = need(v, "stop", at);
    if (!s.is_integer() || !e.is_integer()) refuse(at, "fields 'start' and 'stop' must be integers");
    d->start = s.as_int();
    d->stop = e.as_int();
    return d;
  }
  refuse(where, "type '" + type + "' is not supported (supported: Sequence, ByteLevel, Metaspace, Replace, ByteFallback, Fuse, Strip)");
}

void add_post_processor(const JsonValue& v, const std::string& where, PostProcessor& post) {
  if (v.is_null()) return;
  const std::string type = type_of(v, where);
  const std::string at = where + " type '" + type + "'";
  if (type == "Sequence") {
    check_fields(v, at, {"processors"});
    const JsonValue& list = need(v, "processors", at);
    if (!list.is_array()) refuse(at, "field 'processors' must be a list");
    for (size_t i = 0; i < list.items().size(); ++i) add_post_processor(list.items()[i], where + "[" + std::to_string(i) + "]", post);
    return;
  }
  if (type == "ByteLevel") {  // offsets only
    check_fields(v, at, {"add_prefix_space", "trim_offsets", "use_regex"});
    return;
  }
  if (type == "TemplateProcessing") {
    check_fields(v, at, {"single", "pair", "special_tokens"});
    const JsonValue& single = need(v, "single", at);
    const JsonValue& specials = need(v, "special_tokens", at);
    if (!single.is_array() || !specials.is_object()) refuse(at, "fields 'single' (a list) and 'special_tokens' (an object) are needed");
    bool seen_sequence = false;
    for (const JsonValue& item : single.items()) {
      if (const JsonValue* seq = item.find("Sequence")) {
        if (!seq->is_object() || !seq->contains("id") || !seq->at("id").is_string() || seq->at("id").as_string() != "A") {
          refuse(at, "a single-sequence template may only hold sequence A");
        }
        if (seen_sequence) refuse(at, "the single template holds sequence A twice");
        seen_sequence = true;
      } else if (const JsonValue* sp = item.find("SpecialToken")) {
        const JsonValue& name = need(*sp, "id", at + " SpecialToken");
        if (!name.is_string()) refuse(at, "a SpecialToken's id must be a string");
        const JsonValue* tok = specials.find(name.as_string());
        if (!tok) refuse(at, "special token '" + name.as_string() + "' is not in 'special_tokens'");
        const JsonValue& ids = need(*tok, "ids", at + " special_tokens['" + name.as_string() + "']");
        if (!ids.is_array()) refuse(at, "special_tokens['" + name.as_string() + "'].ids must be a list");
        for (const JsonValue& id : ids.items()) {
          if (!id.is_integer() || id.as_int() < 0 || id.as_int() >= (int64_t(1) << 31))
            refuse(at, "special token ids must be non-negative integers");
          (seen_sequence ? post.after : post.before).push_back(static_cast<int32_t>(id.as_int()));
        }
      } else {
        refuse(at, "template items must be {\"Sequence\": ...} or {\"SpecialToken\": ...}");
      }
    }
    if (!seen_sequence) refuse(at, "the single template must hold sequence A");
    return;
  }
  if (type == "BertProcessing" || type == "RobertaProcessing") {
    check_fields(v, at, {"sep", "cls", "trim_offsets", "add_prefix_space"});
    auto id_of = [&](const char* key) {
      const JsonValue& p = need(v, key, at);
      if (!p.is_array() || p.items().size() != 2 || !p.items()[1].is_integer())
        refuse(at, std::string("field '") + key + "' must be [token, id]");
      return static_cast<int32_t>(p.items()[1].as_int());
    };
    post.before.push_back(id_of("cls"));
    post.after.push_back(id_of("sep"));
    return;
  }
  refuse(where,
         "type '" + type + "' is not supported (supported: TemplateProcessing, ByteLevel, BertProcessing, RobertaProcessing, Sequence)");
}

}  // namespace hf
}  // namespace data
}  // namespace frugal
