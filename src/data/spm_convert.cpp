// A SentencePiece BPE model (tokenizer.model) as the equivalent tokenizer.json: read from the model's
// protobuf bytes directly (no SentencePiece call), written in the Llama-2 style (Prepend "▁" +
// Replace " " -> "▁", no pre-tokenizer, BPE with byte fallback, merges ranked by the merged
// piece's score), which gives SentencePiece's ids for any text free of control-token spellings.
#include <algorithm>
#include <cstring>
#include <sstream>
#include <stdexcept>
#include <unordered_map>

#include "frugal/data/hf_tokenizer.h"
#include "frugal/io/files.h"
#include "frugal/io/json.h"
#include "hf_pipeline.h"

namespace frugal {
namespace data {
namespace {

// A minimal protobuf reader: varints, fixed 32/64-bit and length-delimited fields.
struct Reader {
  const unsigned char* p;
  const unsigned char* end;
  const std::string* name;
  [[noreturn]] void fail() const {
    throw std::invalid_argument("tokenizer " + *name + " is not a SentencePiece model (its bytes do not parse as one)");
  }
  bool done() const { return p >= end; }
  uint64_t varint() {
    uint64_t v = 0;
    for (int shift = 0; shift < 64; shift += 7) {
      if (p >= end) fail();
      const unsigned char b = *p++;
      v |= static_cast<uint64_t>(b & 0x7F) << shift;
      if (!(b & 0x80)) return v;
    }
    fail();
  }
  // Reads one field's key and value: wire type 0 -> number, 2 -> bytes, 5 -> fixed32 in number.
  bool next(uint32_t& field, uint64_t& number, std::string& bytes) {
    if (done()) return false;
    const uint64_t key = varint();
    field = static_cast<uint32_t>(key >> 3);
    switch (key & 7) {
      case 0: number = varint(); break;
      case 1:
        if (end - p < 8) fail();
        std::memcpy(&number, p, 8);
        p += 8;
        break;
      case 2: {
        const uint64_t n = varint();
        if (n > static_cast<uint64_t>(end - p)) fail();
        bytes.assign(reinterpret_cast<const char*>(p), n);
        p += n;
        break;
      }
      case 5: {
        if (end - p < 4) fail();
        uint32_t v;
        std::memcpy(&v, p, 4);
        number = v;
        p += 4;
        break;
      }
      default: fail();
    }
    return true;
  }
};

struct SpmPiece {
  std::string piece;
  float score = 0;
  int type = 1;  // NORMAL 1, UNKNOWN 2, CONTROL 3, USER_DEFINED 4, UNUSED 5, BYTE 6
};

// What the converter and the tokenizer need of a model: its pieces, TrainerSpec's model_type (3),
// byte_fallback (35), treat_whitespace_as_suffix (24), NormalizerSpec's name (1),
// precompiled_charsmap (2), add_dummy_prefix (3), remove_extra_whitespaces (4), escape_whitespaces (5).
struct SpmModel {
  std::vector<SpmPiece> pieces;
  int model_type = 1;
  bool byte_fallback = false, add_dummy_prefix = true, remove_extra_whitespaces = true, escape_whitespaces = true, suffix = false;
  std::string charsmap, norm_name;
};

SpmModel parse_model(const std::string& bytes, const std::string& name) {
  // A reader over a message's bytes (the model, or one of its fields), naming the file in errors.
  auto reader = [&name](const std::string& b) {
    return Reader{reinterpret_cast<const unsigned char*>(b.data()), reinterpret_cast<const unsigned char*>(b.data()) + b.size(), &name};
  };
  Reader r = reader(bytes);
  SpmModel m;
  uint32_t field;
  uint64_t number;
  std::string value;
  while (r.next(field, number, value)) {
    if (field == 1) {
      SpmPiece p;
      Reader sub = reader(value);
      uint32_t f;
      uint64_t n = 0;
      std::string b;
      while (sub.next(f, n, b)) {
        if (f == 1)
          p.piece = b;
        else if (f == 2) {
          const auto v = static_cast<uint32_t>(n);
          std::memcpy(&p.score, &v, 4);
        } else if (f == 3)
          p.type = static_cast<int>(n);
      }
      m.pieces.push_back(std::move(p));
    } else if (field == 2 || field == 3) {
      Reader sub = reader(value);
      uint32_t f;
      uint64_t n = 0;
      std::string b;
      while (sub.next(f, n, b)) {
        if (field == 2 && f == 3) m.model_type = static_cast<int>(n);
        if (field == 2 && f == 35) m.byte_fallback = n != 0;
        if (field == 2 && f == 24) m.suffix = n != 0;
        if (field == 3 && f == 1) m.norm_name = b;
        if (field == 3 && f == 2) m.charsmap = b;
        if (field == 3 && f == 3) m.add_dummy_prefix = n != 0;
        if (field == 3 && f == 4) m.remove_extra_whitespaces = n != 0;
        if (field == 3 && f == 5) m.escape_whitespaces = n != 0;
      }
    }
  }
  return m;
}

}  // namespace

namespace hf {

bool sentencepiece_prepends_space(const std::string& model_bytes, const std::string& name) {
  const SpmModel m = parse_model(model_bytes, name);
  return m.add_dummy_prefix && m.escape_whitespaces && !m.suffix;
}

}  // namespace hf

std::string sentencepiece_to_tokenizer_json(const std::string& model_path) {
  const std::string bytes = io::read_file(model_path, io::kTokenizerFileBytes, "tokenizer");
  SpmModel model = parse_model(bytes, model_path);
  std::vector<SpmPiece>& pieces = model.pieces;
  const int model_type = model.model_type;
  const bool byte_fallback = model.byte_fallback, add_dummy_prefix = model.add_dummy_prefix,
             remove_extra_whitespaces = model.remove_extra_whitespaces, escape_whitespaces = model.escape_whitespaces,
             suffix = model.suffix;
  const std::string &charsmap = model.charsmap, &norm_name = model.norm_name;
  auto refuse = [&](const std::string& why) -> void {
    throw std::invalid_argument("tokenizer " + model_path + " cannot be written as tokenizer.json: " + why);
  };
  if (pieces.empty()) refuse("it has no pieces");
  if (model_type != 2)
    refuse("only BPE models are converted (this one is " + std::string(model_type == 1 ? "unigram" : "word or char") + ")");
  if (!charsmap.empty()) refuse("its normalization '" + norm_name + "' is not the identity");
  if (remove_extra_whitespaces) refuse("it removes extra whitespace (remove_extra_whitespaces)");
  if (!escape_whitespaces || suffix) refuse("it does not mark word starts with \"▁\" in front");

  std::unordered_map<std::string, int32_t> ids;
  for (size_t i = 0; i < pieces.size(); ++i) ids.emplace(pieces[i].piece, static_cast<int32_t>(i));
  // Merges: every split of a normal piece into two normal pieces, ranked by the merged piece's
  // score (highest first), then by the halves' ids: SentencePiece merges the best-scored pair first.
  struct Merge {
    float score;
    int32_t left, right;
  };
  std::vector<Merge> merges;
  for (const SpmPiece& p : pieces) {
    if (p.type != 1) continue;
    for (size_t cut = 1; cut < p.piece.size(); ++cut) {
      if ((static_cast<unsigned char>(p.piece[cut]) & 0xC0) == 0x80) continue;
      const auto l = ids.find(p.piece.substr(0, cut)), rr = ids.find(p.piece.substr(cut));
      if (l == ids.end() || rr == ids.end() || pieces[static_cast<size_t>(l->second)].type != 1 ||
          pieces[static_cast<size_t>(rr->second)].type != 1) {
        continue;
      }
      merges.push_back(Merge{p.score, l->second, rr->second});
    }
  }
  std::stable_sort(merges.begin(), merges.end(), [](const Merge& a, const Merge& b) {
    return a.score != b.score ? a.score > b.score : (a.left != b.left ? a.left < b.left : a.right < b.right);
  });

  std::string unk, bos;
  for (const SpmPiece& p : pieces) {
    if (p.type == 2 && unk.empty()) unk = p.piece;
  }
  if (ids.count("<s>") && pieces[static_cast<size_t>(ids["<s>"])].type == 3) bos = "<s>";
  std::ostringstream out;
  io::JsonWriter w(out, 0);
  w.begin_object().key("version").value("1.0").key("truncation").null().key("padding").null();
  w.key("added_tokens").begin_array();
  for (size_t i = 0; i < pieces.size(); ++i) {
    const int t = pieces[i].type;
    if (t != 2 && t != 3 && t != 4) continue;
    w.begin_object().key("id").value(static_cast<int64_t>(i)).key("content").value(pieces[i].piece);
    w.key("single_word").value(false).key("lstrip").value(false).key("rstrip").value(false);
    w.key("normalized").value(false).key("special").value(t != 4).end_object();
  }
  w.end_array();
  w.key("normalizer").begin_object().key("type").value("Sequence").key("normalizers").begin_array();
  if (add_dummy_prefix) w.begin_object().key("type").value("Prepend").key("prepend").value("\xE2\x96\x81").end_object();
  w.begin_object().key("type").value("Replace").key("pattern").begin_object().key("String").value(" ").end_object();
  w.key("content").value("\xE2\x96\x81").end_object();
  w.end_array().end_object();
  w.key("pre_tokenizer").null();
  w.key("post_processor");
  if (bos.empty()) {
    w.null();
  } else {
    w.begin_object().key("type").value("TemplateProcessing");
    w.key("single").begin_array();
    w.begin_object().key("SpecialToken").begin_object().key("id").value(bos).key("type_id").value(0).end_object().end_object();
    w.begin_object().key("Sequence").begin_object().key("id").value("A").key("type_id").value(0).end_object().end_object();
    w.end_array();
    w.key("pair").begin_array();
    for (const char* seq : {"A", "B"}) {
      const int type_id = seq[0] == 'A' ? 0 : 1;
      w.begin_object().key("SpecialToken").begin_object().key("id").value(bos).key("type_id").value(type_id).end_object().end_object();
      w.begin_object().key("Sequence").begin_object().key("id").value(seq).key("type_id").value(type_id).end_object().end_object();
    }
    w.end_array();
    w.key("special_tokens").begin_object().key(bos).begin_object().key("id").value(bos);
    w.key("ids").begin_array().value(static_cast<int64_t>(ids[bos])).end_array();
    w.key("tokens").begin_array().value(bos).end_array().end_object().end_object();
    w.end_object();
  }
  w.key("decoder").begin_object().key("type").value("Sequence").key("decoders").begin_array();
  w.begin_object().key("type").value("Replace").key("pattern").begin_object().key("String").value("\xE2\x96\x81").end_object();
  w.key("content").value(" ").end_object();
  w.begin_object().key("type").value("ByteFallback").end_object();
  w.begin_object().key("type").value("Fuse").end_object();
  if (add_dummy_prefix)
    w.begin_object().key("type").value("Strip").key("content").value(" ").key("start").value(1).key("stop").value(0).end_object();
  w.end_array().end_object();
  w.key("model").begin_object().key("type").value("BPE").key("dropout").null();
  w.key("unk_token");
  if (unk.empty())
    w.null();
  else
    w.value(unk);
  w.key("continuing_subword_prefix").null().key("end_of_word_suffix").null();
  w.key("fuse_unk").value(true).key("byte_fallback").value(byte_fallback).key("ignore_merges").value(false);
  w.key("vocab").begin_object();
  for (size_t i = 0; i < pieces.size(); ++i) w.key(pieces[i].piece).value(static_cast<int64_t>(i));
  w.end_object();
  w.key("merges").begin_array();
  for (const Merge& m : merges) {
    w.begin_array().value(pieces[static_cast<size_t>(m.left)].piece).value(pieces[static_cast<size_t>(m.right)].piece).end_array();
  }
  w.end_array().end_object();
  w.end_object();
  return out.str();
}

}  // namespace data
}  // namespace frugal
