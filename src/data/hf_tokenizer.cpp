// tokenizer.json: the top level (added tokens, the pipeline's order, encode and decode). The stages
// themselves live in hf_text.cpp (normalizers, pre-tokenizers) and hf_model.cpp (BPE, decoders,
// post-processors).
#include "frugal/data/hf_tokenizer.h"

#include <algorithm>
#include <stdexcept>
#include <unordered_map>
#include <unordered_set>

#include "frugal/io/files.h"
#include "frugal/io/json_value.h"
#include "hf_pipeline.h"

namespace frugal {
namespace data {

using io::JsonValue;

struct AddedToken {
  int32_t id = -1;
  std::string content;  // as matched: normalized ones hold the normalizer's output
  bool lstrip = false, rstrip = false, normalized = false, special = false;
};

struct HfTokenizer::Impl {
  std::string json;
  std::unique_ptr<hf::Normalizer> normalizer;
  std::unique_ptr<hf::PreTokenizer> pre_tokenizer;
  std::unique_ptr<hf::Bpe> model;
  std::unique_ptr<hf::Decoder> decoder;
  hf::PostProcessor post;
  std::vector<AddedToken> raw_added, normalized_added;  // matched before / after normalization
  std::unordered_map<int32_t, std::string> added_by_id;
  std::unordered_set<int32_t> special;
  std::vector<std::string> id_to_token;  // the model's vocabulary, by id
  int64_t vocab_size = 0;

  // One segment of text, or an added token's id (text empty).
  struct Segment {
    std::string text;
    int32_t id = -1;
    bool at_origin = false;
  };
  static void split_added(const std::string& text, bool at_origin, const std::vector<AddedToken>& tokens, std::vector<Segment>& out);
  void encode_text(const Segment& s, std::vector<int32_t>& out) const;
};

namespace {

bool ascii_space(char c) { return c == ' ' || c == '\t' || c == '\n' || c == '\r' || c == '\v' || c == '\f'; }

}  // namespace

// Leftmost-longest matches of the added tokens; lstrip / rstrip take the white space beside a match with it.
void HfTokenizer::Impl::split_added(const std::string& text, bool at_origin, const std::vector<AddedToken>& tokens,
                                    std::vector<Segment>& out) {
  bool first_byte[256] = {};
  for (const AddedToken& t : tokens) first_byte[static_cast<unsigned char>(t.content[0])] = true;
  size_t start = 0;  // of the text not yet emitted
  size_t i = 0;
  while (i < text.size()) {
    if (!first_byte[static_cast<unsigned char>(text[i])]) {
      ++i;
      continue;
    }
    const AddedToken* best = nullptr;
    for (const AddedToken& t : tokens) {
      if (t.content.size() > (best ? best->content.size() : 0) && text.compare(i, t.content.size(), t.content) == 0) best = &t;
    }
    if (!best) {
      ++i;
      continue;
    }
    size_t left = i, right = i + best->content.size();
    if (best->lstrip)
      while (left > start && ascii_space(text[left - 1])) --left;
    if (best->rstrip)
      while (right < text.size() && ascii_space(text[right])) ++right;
    if (left > start) out.push_back(Segment{text.substr(start, left - start), -1, at_origin && start == 0});
    out.push_back(Segment{"", best->id, false});
    start = i = right;
  }
  if (start < text.size() || (text.empty() && out.empty())) out.push_back(Segment{text.substr(start), -1, at_origin && start == 0});
}

void HfTokenizer::Impl::encode_text(const Segment& s, std::vector<int32_t>& out) const {
  std::string text = s.text;
  if (normalizer) normalizer->apply(text);
  std::vector<Segment> parts;
  if (normalized_added.empty())
    parts.push_back(Segment{std::move(text), -1, s.at_origin});
  else
    split_added(text, s.at_origin, normalized_added, parts);
  for (const Segment& part : parts) {
    if (part.id >= 0) {
      out.push_back(part.id);
      continue;
    }
    std::vector<hf::Piece> pieces;
    if (!part.text.empty()) pieces.push_back(hf::Piece{part.text, part.at_origin});
    if (pre_tokenizer && !pieces.empty()) pre_tokenizer->apply(pieces);
    for (const hf::Piece& p : pieces) {
      if (!p.text.empty()) model->encode_word(p.text, out);
    }
  }
}

HfTokenizer HfTokenizer::load(const std::string& path) { return parse(io::read_file(path, io::kTokenizerFileBytes, "tokenizer"), path); }

HfTokenizer HfTokenizer::parse(const std::string& json_text, const std::string& name) {
  JsonValue root;
  try {
    root = io::parse_json(json_text);
  } catch (const io::JsonError& e) {
    throw std::invalid_argument(name + " is not valid JSON: " + e.what());
  }
  try {
    auto impl = std::make_shared<Impl>();
    impl->json = json_text;
    if (!root.is_object()) hf::refuse("the file", "must hold a JSON object");
    hf::check_fields(
        root, "the top level",
        {"version", "truncation", "padding", "added_tokens", "normalizer", "pre_tokenizer", "model", "post_processor", "decoder"});
    for (const char* off : {"truncation", "padding"}) {
      const JsonValue* v = root.find(off);
      if (v && !v->is_null()) hf::refuse(off, "only null is supported (frugal encodes whole texts, one at a time)");
    }
    const JsonValue& model = hf::need(root, "model", "the top level");
    const JsonValue* mtype = model.is_object() ? model.find("type") : nullptr;
    if (mtype && (!mtype->is_string() || mtype->as_string() != "BPE")) {
      hf::refuse("model", "type '" + (mtype->is_string() ? mtype->as_string() : std::string("?")) + "' is not supported (supported: BPE)");
    }
    if (!mtype && !(model.is_object() && model.contains("merges"))) hf::refuse("model", "is not a BPE model (no 'type' and no 'merges')");
    impl->model = std::make_unique<hf::Bpe>(model, "model");
    static const JsonValue null_value;
    auto member = [&](const char* key) -> const JsonValue& {
      const JsonValue* v = root.find(key);
      return v ? *v : null_value;
    };
    impl->normalizer = hf::make_normalizer(member("normalizer"), "normalizer");
    impl->pre_tokenizer = hf::make_pre_tokenizer(member("pre_tokenizer"), "pre_tokenizer");
    impl->decoder = hf::make_decoder(member("decoder"), "decoder");
    hf::add_post_processor(member("post_processor"), "post_processor", impl->post);

    int64_t max_id = -1;
    impl->id_to_token.resize(impl->model->vocab().size());
    for (const auto& kv : impl->model->vocab()) {
      if (static_cast<size_t>(kv.second) >= impl->id_to_token.size()) impl->id_to_token.resize(static_cast<size_t>(kv.second) + 1);
      impl->id_to_token[static_cast<size_t>(kv.second)] = kv.first;
      max_id = std::max<int64_t>(max_id, kv.second);
    }
    const JsonValue& added = member("added_tokens");
    if (!added.is_null() && !added.is_array()) hf::refuse("added_tokens", "must be a list");
    for (size_t i = 0; !added.is_null() && i < added.items().size(); ++i) {
      const JsonValue& a = added.items()[i];
      const std::string at = "added_tokens[" + std::to_string(i) + "]";
      hf::check_fields(a, at, {"id", "content", "single_word", "lstrip", "rstrip", "normalized", "special"});
      AddedToken t;
      const JsonValue& id = hf::need(a, "id", at);
      const JsonValue& content = hf::need(a, "content", at);
      if (!id.is_integer() || id.as_int() < 0 || id.as_int() >= (int64_t(1) << 31))
        hf::refuse(at, "field 'id' must be a non-negative integer");
      if (!content.is_string() || content.as_string().empty()) hf::refuse(at, "field 'content' must be a non-empty string");
      auto flag = [&](const char* key) {
        const JsonValue* v = a.find(key);
        if (v && !v->is_bool()) hf::refuse(at, std::string("field '") + key + "' must be true or false");
        return v && v->as_bool();
      };
      if (flag("single_word")) hf::refuse(at, "single_word true is not supported");
      t.id = static_cast<int32_t>(id.as_int());
      t.content = content.as_string();
      t.lstrip = flag("lstrip");
      t.rstrip = flag("rstrip");
      t.special = flag("special");
      t.normalized = a.contains("normalized") ? flag("normalized") : !t.special;
      impl->added_by_id[t.id] = t.content;
      if (t.special) impl->special.insert(t.id);
      max_id = std::max<int64_t>(max_id, t.id);
      if (t.normalized && impl->normalizer) {
        impl->normalizer->apply(t.content);
        if (t.content.empty()) continue;
      }
      (t.normalized ? impl->normalized_added : impl->raw_added).push_back(std::move(t));
    }
    impl->vocab_size = max_id + 1;
    if (impl->vocab_size == 0) hf::refuse("model", "the vocab is empty");
    for (int32_t id : impl->post.before)
      if (id >= impl->vocab_size) hf::refuse("post_processor", "id " + std::to_string(id) + " is outside the vocabulary");
    for (int32_t id : impl->post.after)
      if (id >= impl->vocab_size) hf::refuse("post_processor", "id " + std::to_string(id) + " is outside the vocabulary");
    HfTokenizer t;
    t.impl_ = std::move(impl);
    return t;
  } catch (const io::JsonError& e) {
    throw std::invalid_argument(name + ": " + e.what());
  } catch (const std::invalid_argument& e) {
    std::string what = e.what();
    const std::string prefix = "tokenizer.json: ";
    if (what.rfind(prefix, 0) == 0) what = what.substr(prefix.size());
    throw std::invalid_argument(name + ": " + what);
  }
}

std::vector<int32_t> HfTokenizer::encode(const std::string& text, bool add_special_tokens) const {
  hf::check_utf8(text, "tokenizer: the text");
  std::vector<int32_t> out;
  if (add_special_tokens) out = impl_->post.before;
  std::vector<Impl::Segment> segments;
  Impl::split_added(text, true, impl_->raw_added, segments);
  for (const auto& s : segments) {
    if (s.id >= 0)
      out.push_back(s.id);
    else if (!s.text.empty())
      impl_->encode_text(s, out);
  }
  if (add_special_tokens) out.insert(out.end(), impl_->post.after.begin(), impl_->post.after.end());
  return out;
}

std::string HfTokenizer::decode(const std::vector<int32_t>& ids, bool skip_special_tokens) const {
  std::vector<std::string> tokens;
  tokens.reserve(ids.size());
  for (int32_t id : ids) {
    if (id < 0 || id >= impl_->vocab_size)
      throw std::invalid_argument("tokenizer: id " + std::to_string(id) + " is outside the vocabulary");
    if (skip_special_tokens && impl_->special.count(id)) continue;
    std::string t = id_to_token(id);
    if (t.empty()) throw std::invalid_argument("tokenizer: id " + std::to_string(id) + " has no token");
    tokens.push_back(std::move(t));
  }
  if (!impl_->decoder) {
    std::string out;
    for (size_t i = 0; i < tokens.size(); ++i) out += (i ? " " : "") + tokens[i];
    return out;
  }
  impl_->decoder->apply(tokens);
  std::string out;
  for (const auto& t : tokens) out += t;
  return out;
}

int64_t HfTokenizer::vocab_size() const { return impl_->vocab_size; }

int32_t HfTokenizer::token_to_id(const std::string& token) const {
  for (const auto& kv : impl_->added_by_id)
    if (kv.second == token) return kv.first;
  const auto it = impl_->model->vocab().find(token);
  return it == impl_->model->vocab().end() ? -1 : it->second;
}

std::string HfTokenizer::id_to_token(int32_t id) const {
  const auto it = impl_->added_by_id.find(id);
  if (it != impl_->added_by_id.end()) return it->second;
  if (id < 0 || static_cast<size_t>(id) >= impl_->id_to_token.size()) return "";
  return impl_->id_to_token[static_cast<size_t>(id)];
}

bool HfTokenizer::is_special(int32_t id) const { return impl_->special.count(id) > 0; }
const std::vector<int32_t>& HfTokenizer::prefix_ids() const { return impl_->post.before; }
const std::vector<int32_t>& HfTokenizer::suffix_ids() const { return impl_->post.after; }
const std::string& HfTokenizer::json() const { return impl_->json; }

}  // namespace data
}  // namespace frugal
