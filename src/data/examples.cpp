// Instruction and chat examples: JSON Lines (or one JSON array) read a record at a time, rendered
// with a template, tokenized with loss flags, written as an examples file (see examples.h).
#include "frugal/data/examples.h"

#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstdio>
#include <cstring>
#include <functional>
#include <memory>
#include <stdexcept>

#include "chat_text.h"
#include "example_reader.h"
#include "examples_format.h"
#include "fingerprint.h"
#include "frugal/io/atomic_file.h"
#include "frugal/io/files.h"
#include "frugal/io/json_value.h"

namespace frugal {
namespace data {

namespace {

// A bad example: the message names the field; the reader adds file and line.
struct BadExample : std::invalid_argument {
  using std::invalid_argument::invalid_argument;
};

// The special tokens a template writes as text, besides BOS and EOS.
std::vector<std::string> template_tokens(ChatTemplate t) {
  switch (t) {
    case ChatTemplate::llama3: return {"<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>"};
    case ChatTemplate::chatml: return {"<|im_start|>", "<|im_end|>"};
    default: return {};
  }
}

const io::JsonValue& field(const io::JsonValue& obj, const std::string& key, const std::string& shown) {
  const io::JsonValue* v = obj.find(key);
  if (!v) throw BadExample("field '" + shown + "': is missing");
  return *v;
}

const std::string& string_field(const io::JsonValue& obj, const std::string& key, const std::string& shown) {
  const io::JsonValue& v = field(obj, key, shown);
  if (!v.is_string()) throw BadExample("field '" + shown + "': is not a string");
  return v.as_string();
}

void check_answer(const std::string& text, const std::string& shown) {
  if (python_strip(text).empty()) throw BadExample("field '" + shown + "': is empty (an answer needs text)");
}

size_t common_prefix(const std::vector<int32_t>& a, const std::vector<int32_t>& b) {
  size_t n = 0;
  while (n < a.size() && n < b.size() && a[n] == b[n]) ++n;
  return n;
}

}  // namespace

ChatTemplate resolve_chat_template(const Tokenizer& tok, const ExampleOptions& opt) {
  if (opt.chat_template) return *opt.chat_template;
  switch (opt.format) {
    case ExampleFormat::alpaca: return ChatTemplate::alpaca;
    case ExampleFormat::prompt_completion: return ChatTemplate::plain;
    case ExampleFormat::messages: break;
  }
  std::string dir = io::parent_path(tok.path());
  struct stat st {};
  if (::stat(tok.path().c_str(), &st) == 0 && S_ISDIR(st.st_mode)) dir = tok.path();
  return folder_chat_template(dir.empty() ? "." : dir);
}

ExampleEncoder::ExampleEncoder(const Tokenizer& tok, const ExampleOptions& opt)
    : tok_(tok), opt_(opt), template_(resolve_chat_template(tok, opt)) {
  const char* name = chat_template_name(template_);
  if (tok.bos_id() >= 0) bos_ = tok.id_to_token(tok.bos_id());
  if (tok.eos_id() >= 0) eos_ = tok.id_to_token(tok.eos_id());
  std::vector<std::string> needed = template_tokens(template_);
  if (template_ == ChatTemplate::llama2 || template_ == ChatTemplate::llama3) {
    if (tok.bos_id() < 0)
      throw std::invalid_argument(std::string("the ") + name + " template writes a BOS token, and the tokenizer " + tok.path() +
                                  " has none");
    needed.push_back(bos_);
  }
  if (template_ == ChatTemplate::llama2) needed.push_back(eos_);
  for (const std::string& s : needed) {
    const int32_t id = tok.token_to_id(s);
    // A tokenizer.json must also find the token in text (an added token), as transformers encodes the rendered text.
    const bool found = id >= 0 && (!tok.recognizes_special_tokens() || tok.encode(s) == std::vector<int32_t>{id});
    if (!found) {
      throw std::invalid_argument(std::string("the ") + name + " chat template writes the token '" + s + "', which the tokenizer " +
                                  tok.path() + " lacks (not one of its added or special tokens)");
    }
    if (!tok.recognizes_special_tokens()) specials_.push_back({s, id});
    anchors_.push_back({s, id});
  }
  if (!tok.recognizes_special_tokens()) {
    // SentencePiece's control tokens spelled in the text become their ids, as in the model's tokenizer.json.
    for (const std::string& s : {bos_, eos_}) {
      if (!s.empty() && std::none_of(specials_.begin(), specials_.end(), [&](const auto& p) { return p.first == s; })) {
        specials_.push_back({s, tok.token_to_id(s)});
      }
    }
  }
}

namespace {

struct Match {
  size_t at = std::string::npos, len = 0;
  int32_t id = -1;
};

// The leftmost (then longest) occurrence of a spelling in text from pos.
Match next_special(const std::string& text, size_t pos, const std::vector<std::pair<std::string, int32_t>>& specials) {
  Match m;
  for (const auto& [s, id] : specials) {
    const size_t at = text.find(s, pos);
    if (at != std::string::npos && (at < m.at || (at == m.at && s.size() > m.len))) m = {at, s.size(), id};
  }
  return m;
}

}  // namespace

std::vector<int32_t> ExampleEncoder::encode_text(const std::string& text) const {
  if (specials_.empty()) return tok_.encode(text);
  std::vector<int32_t> out;
  size_t pos = 0;
  while (pos < text.size()) {
    const Match m = next_special(text, pos, specials_);
    const size_t best = m.at, best_len = m.len;
    const int32_t best_id = m.id;
    const size_t end = best == std::string::npos ? text.size() : best;
    if (end > pos) {
      const auto ids = tok_.encode(text.substr(pos, end - pos));
      out.insert(out.end(), ids.begin(), ids.end());
    }
    if (best == std::string::npos) break;
    out.push_back(best_id);
    pos = best + best_len;
  }
  return out;
}

std::vector<ChatMessage> ExampleEncoder::messages(const io::JsonValue& example) const {
  const ExampleFields& f = opt_.fields;
  if (!example.is_object()) throw BadExample("is not a JSON object");
  std::vector<ChatMessage> out;
  if (opt_.format == ExampleFormat::alpaca) {
    std::string user = string_field(example, f.instruction, f.instruction);
    const io::JsonValue* input = example.find(f.input);
    if (input && !input->is_null() && !input->is_string()) throw BadExample("field '" + f.input + "': is not a string");
    if (input && input->is_string() && !input->as_string().empty()) user += "\n\n" + input->as_string();
    out.push_back({"user", user});
    out.push_back({"assistant", string_field(example, f.output, f.output)});
    check_answer(out.back().content, f.output);
    return out;
  }
  if (opt_.format == ExampleFormat::prompt_completion) {
    out.push_back({"user", string_field(example, f.prompt, f.prompt)});
    out.push_back({"assistant", string_field(example, f.completion, f.completion)});
    check_answer(out.back().content, f.completion);
    return out;
  }
  const io::JsonValue& list = field(example, f.messages, f.messages);
  if (!list.is_array()) throw BadExample("field '" + f.messages + "': is not a list");
  if (list.items().empty()) throw BadExample("field '" + f.messages + "': is empty");
  const io::JsonValue* first_role = list.items()[0].is_object() ? list.items()[0].find(f.role) : nullptr;
  const bool system_first = first_role && first_role->is_string() && first_role->as_string() == "system";
  for (size_t i = 0; i < list.items().size(); ++i) {
    const io::JsonValue& m = list.items()[i];
    const std::string at = f.messages + "[" + std::to_string(i) + "]";
    if (!m.is_object()) throw BadExample("field '" + at + "': is not an object");
    const std::string& role = string_field(m, f.role, at + "." + f.role);
    const std::string& content = string_field(m, f.content, at + "." + f.content);
    if (role != "system" && role != "user" && role != "assistant") {
      throw BadExample("field '" + at + "." + f.role + "': unknown role '" + role + "' (allowed: system, user, assistant)");
    }
    // An optional system message, then user and assistant alternating from user.
    const size_t k = i - (system_first ? 1 : 0);
    const std::string expected = i == 0 && role == "system" ? "system" : k % 2 == 0 ? "user" : "assistant";
    if (role != expected) {
      throw BadExample("field '" + at + "." + f.role + "': '" + role + "' is out of order (expected '" + expected +
                       "': an optional system message first, then user and assistant alternating, ending with assistant)");
    }
    if (role == "assistant") check_answer(content, at + "." + f.content);
    out.push_back({role, content});
  }
  if (out.back().role != "assistant") {
    throw BadExample("field '" + f.messages + "': ends with a " + out.back().role + " message (the last must be the assistant's)");
  }
  return out;
}

EncodedExample ExampleEncoder::encode(const io::JsonValue& example) const {
  RenderedExample r;
  if (opt_.format == ExampleFormat::alpaca && template_ == ChatTemplate::alpaca) {
    // The instruction and the input apart (messages() joins them for the chat templates).
    if (!example.is_object()) throw BadExample("is not a JSON object");
    const ExampleFields& f = opt_.fields;
    const std::string& instruction = string_field(example, f.instruction, f.instruction);
    const io::JsonValue* input = example.find(f.input);
    if (input && !input->is_null() && !input->is_string()) throw BadExample("field '" + f.input + "': is not a string");
    const std::string& output = string_field(example, f.output, f.output);
    check_answer(output, f.output);
    const std::string prompt = alpaca_prompt(instruction, input && input->is_string() ? input->as_string() : "");
    r.text = prompt + output;
    r.answers.push_back({prompt.size(), r.text.size()});
    r.bos_id = tok_.add_bos() && tok_.bos_id() >= 0;
    r.eos_id = true;
  } else {
    try {
      r = render_messages(template_, messages(example), bos_, eos_, tok_.add_bos() && tok_.bos_id() >= 0);
    } catch (const BadExample&) {
      throw;
    } catch (const std::invalid_argument& e) {
      throw BadExample(e.what());
    }
  }
  EncodedExample out;
  out.text = r.text;
  const std::vector<int32_t> body = encode_text(r.text);
  const size_t offset = r.bos_id ? 1 : 0;
  if (r.bos_id) out.ids.push_back(tok_.bos_id());
  out.ids.insert(out.ids.end(), body.begin(), body.end());
  if (r.eos_id) out.ids.push_back(tok_.eos_id());
  out.loss.assign(out.ids.size(), opt_.train_on_prompt ? 1 : 0);
  // Anchors: the template's special tokens, where they stand in the text and in the ids. A special
  // token splits the text (a tokenizer.json's added tokens are matched first and the text between
  // them encoded on its own; the SentencePiece path splits there itself), so the ids of text[0:b]
  // are those of the ids before the last special token before b, then the ids of text from that
  // token to b: encoding that piece is enough. The piece starts with the token itself, so what
  // follows is no text's first piece (Metaspace's prepend_scheme "first"). Anchors are used only
  // when text and ids hold the same number of them; otherwise the whole prefix is encoded.
  std::vector<std::pair<size_t, size_t>> anchors;  // (byte where the token starts, its index in body)
  if (!anchors_.empty()) {
    for (size_t pos = 0;;) {
      const Match m = next_special(r.text, pos, anchors_);
      if (m.at == std::string::npos) break;
      anchors.push_back({m.at, 0});
      pos = m.at + m.len;
    }
    size_t k = 0;
    for (size_t i = 0; i < body.size(); ++i) {
      if (std::none_of(anchors_.begin(), anchors_.end(), [&](const auto& a) { return a.second == body[i]; })) continue;
      if (k == anchors.size()) {
        k = anchors.size() + 1;
        break;
      }
      anchors[k++].second = i;
    }
    if (k != anchors.size()) anchors.clear();
  }
  auto tokens_within = [&](size_t b) {  // how many leading ids of body lie wholly in text[0:b]
    if (b == r.text.size()) return body.size();
    // The last anchor starting before b.
    auto a = std::lower_bound(anchors.begin(), anchors.end(), b, [](const auto& x, size_t pos) { return x.first < pos; });
    if (a != anchors.begin()) {
      --a;
      const std::vector<int32_t> piece = encode_text(r.text.substr(a->first, b - a->first));
      if (!piece.empty() && piece[0] == body[a->second]) {  // else b cuts the token's spelling: no anchor
        size_t n = 0;
        while (n < piece.size() && a->second + n < body.size() && piece[n] == body[a->second + n]) ++n;
        return a->second + n;
      }
    }
    return common_prefix(encode_text(r.text.substr(0, b)), body);
  };
  for (const auto& [begin, end] : r.answers) {
    const size_t first = tokens_within(begin), last = tokens_within(end);
    for (size_t k = first; k < last; ++k) out.loss[offset + k] = 1;
  }
  if (r.eos_id) out.loss.back() = 1;
  if (out.ids.size() < 2) throw BadExample("renders to fewer than two tokens");
  if (std::find(out.loss.begin() + 1, out.loss.end(), 1) == out.loss.end()) throw BadExample("has no answer token to learn");
  return out;
}

std::string examples_fingerprint(const Tokenizer& tok, const ExampleOptions& opt) {
  const ExampleFields& f = opt.fields;
  std::string s =
      "examples v" + std::to_string(examples_format::kVersion) + "|tok=" + tok.fingerprint() + "|bos=" + std::to_string(tok.bos_id()) +
      "|eos=" + std::to_string(tok.eos_id()) + "|add_bos=" + std::to_string(tok.add_bos()) + "|format=" + example_format_name(opt.format) +
      "|template=" + chat_template_name(resolve_chat_template(tok, opt)) + "|train_on_prompt=" + std::to_string(opt.train_on_prompt) +
      "|skip_bad=" + std::to_string(opt.skip_bad) + "|max_line_bytes=" + std::to_string(opt.max_line_bytes);
  for (const std::string* k : {&f.instruction, &f.input, &f.output, &f.prompt, &f.completion, &f.messages, &f.role, &f.content}) {
    s.append("|").append(std::to_string(k->size())).append(":").append(*k);
  }
  return fnv1a64(s);
}

namespace {

// ---- Writing: the examples file, streamed ----

// An unnamed temporary file beside the output (removed at once, so nothing is left behind): the
// flags and offsets wait there until the tokens are written.
class Spill {
 public:
  explicit Spill(const std::string& near) {
    std::string name = near + ".spill-XXXXXX";
    fd_ = ::mkstemp(&name[0]);
    if (fd_ < 0) throw std::runtime_error("cannot create a temporary file next to " + near + ": " + std::strerror(errno));
    ::unlink(name.c_str());
  }
  ~Spill() { ::close(fd_); }
  Spill(const Spill&) = delete;
  Spill& operator=(const Spill&) = delete;
  void write(const void* p, size_t n) {
    const char* c = static_cast<const char*>(p);
    while (n > 0) {
      const ssize_t w = ::write(fd_, c, n);
      if (w < 0 && errno == EINTR) continue;
      if (w <= 0) throw std::runtime_error(std::string("cannot write a temporary file: ") + std::strerror(errno));
      c += w;
      n -= static_cast<size_t>(w);
    }
  }
  void copy_to(io::AtomicFileWriter& out) {
    if (::lseek(fd_, 0, SEEK_SET) != 0) throw std::runtime_error("cannot rewind a temporary file");
    std::vector<char> buf(1 << 20);
    for (;;) {
      const ssize_t n = ::read(fd_, buf.data(), buf.size());
      if (n < 0 && errno == EINTR) continue;
      if (n < 0) throw std::runtime_error(std::string("cannot read a temporary file: ") + std::strerror(errno));
      if (n == 0) break;
      out.write(buf.data(), static_cast<size_t>(n));
    }
  }

 private:
  int fd_ = -1;
};

class ExamplesWriter {
 public:
  ExamplesWriter(const std::string& path, int64_t vocab, const std::string& fingerprint)
      : out_(path), flags_(path), offsets_(path), vocab_(vocab), fingerprint_(fingerprint) {
    char header[examples_format::kHeaderBytes] = {};
    out_.write(header, sizeof(header));  // filled in by commit()
    out_.write(fingerprint.data(), fingerprint.size());
    pad(fingerprint.size());
    const uint64_t zero = 0;
    offsets_.write(&zero, 8);
  }
  void add(const EncodedExample& e) {
    tokens_.insert(tokens_.end(), e.ids.begin(), e.ids.end());
    flags_buf_.insert(flags_buf_.end(), e.loss.begin(), e.loss.end());
    total_ += e.ids.size();
    labels_ += static_cast<uint64_t>(std::count(e.loss.begin(), e.loss.end(), 1));
    offsets_buf_.push_back(total_);
    ++count_;
    if (tokens_.size() >= kBufferTokens || offsets_buf_.size() >= kBufferTokens) flush();
  }
  void commit() {
    flush();
    pad(total_ * 4);
    flags_.copy_to(out_);
    pad(total_);
    offsets_.copy_to(out_);
    char header[examples_format::kHeaderBytes] = {};
    std::memcpy(header, examples_format::kMagic, 8);
    const uint32_t version = examples_format::kVersion, fp = static_cast<uint32_t>(fingerprint_.size());
    const uint64_t vocab = static_cast<uint64_t>(vocab_);
    std::memcpy(header + 8, &version, 4);
    std::memcpy(header + 12, &fp, 4);
    std::memcpy(header + 16, &vocab, 8);
    std::memcpy(header + 24, &count_, 8);
    std::memcpy(header + 32, &total_, 8);
    std::memcpy(header + 40, &labels_, 8);
    out_.write_at(0, header, sizeof(header));
    out_.commit();
  }

 private:
  static constexpr size_t kBufferTokens = 1 << 16;
  void flush() {
    out_.write(tokens_.data(), tokens_.size() * sizeof(int32_t));
    flags_.write(flags_buf_.data(), flags_buf_.size());
    offsets_.write(offsets_buf_.data(), offsets_buf_.size() * sizeof(uint64_t));
    tokens_.clear();
    flags_buf_.clear();
    offsets_buf_.clear();
  }
  void pad(uint64_t bytes) {
    static const char zeros[8] = {};
    if (bytes % 8) out_.write(zeros, 8 - bytes % 8);
  }
  io::AtomicFileWriter out_;
  Spill flags_, offsets_;
  int64_t vocab_;
  std::string fingerprint_;
  std::vector<int32_t> tokens_;
  std::vector<uint8_t> flags_buf_;
  std::vector<uint64_t> offsets_buf_;
  uint64_t total_ = 0, labels_ = 0, count_ = 0;
};

}  // namespace

ExampleStats encode_examples(const std::vector<std::string>& paths, const Tokenizer& tok, const ExampleOptions& opt,
                             const std::function<void(const std::string&, int64_t, const EncodedExample&)>& on_example) {
  if (opt.max_line_bytes < 1) throw std::invalid_argument("max_line_bytes must be at least 1");
  const ExampleEncoder encoder(tok, opt);
  const std::vector<std::string> files = dataset_files(paths);
  ExampleStats stats;
  auto bad = [&](const std::string& where, const std::string& why) {
    if (!opt.skip_bad) throw std::invalid_argument(where + ": " + why);
    ++stats.skipped;
    if (stats.skipped_reasons.size() < 10) stats.skipped_reasons.push_back(where + ": " + why);
  };
  for (const std::string& file : files) {
    RecordReader reader(file, opt.max_line_bytes);
    Record rec;
    while (reader.next(rec)) {
      const std::string where = file + " line " + std::to_string(rec.line);
      if (rec.overlong) {
        bad(where, "is " + std::to_string(rec.bytes) + " bytes, longer than max_line_bytes (" + std::to_string(opt.max_line_bytes) + ")");
        continue;
      }
      const size_t at = invalid_utf8_at(rec.text);
      if (at != std::string::npos) {
        bad(where, "is not valid UTF-8 (byte " + std::to_string(at) + " of the line)");
        continue;
      }
      EncodedExample e;
      try {
        const io::JsonValue v = io::parse_json(rec.text);
        e = encoder.encode(v);
      } catch (const io::JsonError& err) {
        std::string why = err.what();
        if (why.rfind("JSON: ", 0) == 0) why = why.substr(6);
        bad(where, "not valid JSON: " + why);
        continue;
      } catch (const BadExample& err) {
        bad(where, err.what());
        continue;
      }
      stats.tokens += static_cast<int64_t>(e.ids.size());
      stats.label_tokens += static_cast<int64_t>(std::count(e.loss.begin(), e.loss.end(), 1));
      ++stats.examples;
      on_example(file, rec.line, e);
    }
    if (!reader.saw_anything()) bad(file, "is empty (no examples)");
  }
  if (stats.examples == 0) {
    throw std::invalid_argument(
        "the dataset (" + files[0] + (files.size() > 1 ? ", ..." : "") + ") holds no examples" +
        (stats.skipped ? " (" + std::to_string(stats.skipped) + " skipped as bad, first: " + stats.skipped_reasons[0] + ")" : ""));
  }
  return stats;
}

ExampleStats tokenize_examples(const std::vector<std::string>& paths, const Tokenizer& tok, const ExampleOptions& opt,
                               const std::string& out_path) {
  const std::string fingerprint = examples_fingerprint(tok, opt);
  std::unique_ptr<ExamplesWriter> writer;
  const ExampleStats stats = encode_examples(paths, tok, opt, [&](const std::string&, int64_t, const EncodedExample& e) {
    if (!writer) writer = std::make_unique<ExamplesWriter>(out_path, tok.vocab_size(), fingerprint);
    writer->add(e);
  });
  writer->commit();
  return stats;
}

}  // namespace data
}  // namespace frugal
