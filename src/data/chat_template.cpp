// Chat templates: names, the known Jinja texts and their recognition, and the rendering of a
// conversation as each template's Jinja renders it under transformers (see examples.h).
#include <algorithm>
#include <cctype>
#include <stdexcept>
#include <string>
#include <vector>

#include "frugal/data/examples.h"
#include "chat_text.h"
#include "frugal/io/files.h"
#include "frugal/io/json_value.h"
#include "frugal/io/utf8.h"

namespace frugal {
namespace data {
namespace {

constexpr ExampleFormat kAllFormats[] = {ExampleFormat::alpaca, ExampleFormat::prompt_completion, ExampleFormat::messages};
constexpr ChatTemplate kAllTemplates[] = {ChatTemplate::plain, ChatTemplate::alpaca, ChatTemplate::llama2, ChatTemplate::llama3,
                                          ChatTemplate::chatml};

// meta-llama/Llama-2-7b-chat-hf's tokenizer_config.json chat_template (the JSON string's value).
const char* const kLlama2Jinja =
    R"({% if messages[0]['role'] == 'system' %}{% set loop_messages = messages[1:] %}{% set system_message = messages[0]['content'] %}{% else %}{% set loop_messages = messages %}{% set system_message = false %}{% endif %}{% for message in loop_messages %}{% if (message['role'] == 'user') != (loop.index0 % 2 == 0) %}{{ raise_exception('Conversation roles must alternate user/assistant/user/assistant/...') }}{% endif %}{% if loop.index0 == 0 and system_message != false %}{% set content = '<<SYS>>\n' + system_message + '\n<</SYS>>\n\n' + message['content'] %}{% else %}{% set content = message['content'] %}{% endif %}{% if message['role'] == 'user' %}{{ bos_token + '[INST] ' + content.strip() + ' [/INST]' }}{% elif message['role'] == 'assistant' %}{{ ' '  + content.strip() + ' ' + eos_token }}{% endif %}{% endfor %})";
// meta-llama/Meta-Llama-3-8B-Instruct's (its string literals hold real newlines).
const char* const kLlama3Jinja =
    "{% set loop_messages = messages %}{% for message in loop_messages %}{% set content = '<|start_header_id|>' + "
    "message['role'] + '<|end_header_id|>\n\n'+ message['content'] | trim + '<|eot_id|>' %}{% if loop.index0 == 0 %}"
    "{% set content = bos_token + content %}{% endif %}{{ content }}{% endfor %}{% if add_generation_prompt %}"
    "{{ '<|start_header_id|>assistant<|end_header_id|>\n\n' }}{% endif %}";
// ChatML as transformers' documentation and many checkpoints (OpenHermes, SmolLM2...) carry it.
const char* const kChatmlJinja =
    "{% for message in messages %}{{'<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + "
    "'\n'}}{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}";
// The same ChatML with a guard that changes nothing rendered (zephyr's and alignment-handbook's).
const char* const kChatmlGuardedJinja =
    "{% if not add_generation_prompt is defined %}{% set add_generation_prompt = false %}{% endif %}"
    "{% for message in messages %}{{'<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + "
    "'\n'}}{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}";

bool is_ident(char c) { return std::isalnum(static_cast<unsigned char>(c)) || c == '_'; }
bool is_ws(char c) { return c == ' ' || c == '\t' || c == '\n' || c == '\r' || c == '\f' || c == '\v'; }

// A Jinja string literal's value (Python's escapes: \n \t \r \\ \' \" \xHH \uHHHH; others kept).
std::string unescape(const std::string& body) {
  std::string out;
  for (size_t i = 0; i < body.size(); ++i) {
    if (body[i] == '\r' && i + 1 < body.size() && body[i + 1] == '\n') continue;  // Jinja normalises newlines
    if (body[i] != '\\' || i + 1 == body.size()) {
      out += body[i];
      continue;
    }
    const char e = body[++i];
    auto hex = [&](size_t digits) {
      uint32_t cp = 0;
      for (size_t k = 1; k <= digits; ++k) {
        if (i + k >= body.size() || !std::isxdigit(static_cast<unsigned char>(body[i + k]))) return false;
        const char h = static_cast<char>(std::tolower(static_cast<unsigned char>(body[i + k])));
        cp = cp * 16 + static_cast<uint32_t>(h <= '9' ? h - '0' : h - 'a' + 10);
      }
      io::append_utf8(out, cp);
      i += digits;
      return true;
    };
    switch (e) {
      case 'n': out += '\n'; break;
      case 't': out += '\t'; break;
      case 'r': out += '\r'; break;
      case '\\': out += '\\'; break;
      case '\'': out += '\''; break;
      case '"': out += '"'; break;
      case '\n': break;  // a line continuation
      case 'x':
        if (!hex(2)) out += "\\x";
        break;
      case 'u':
        if (!hex(4)) out += "\\u";
        break;
      default: out += '\\'; out += e;
    }
  }
  return out;
}

// A tag's inside: string literals by value, whitespace dropped except one space between two word
// characters ("not x", "x in y").
std::string normalize_tag(const std::string& inner) {
  std::string out;
  bool space = false;
  for (size_t i = 0; i < inner.size(); ++i) {
    const char c = inner[i];
    if (is_ws(c)) {
      space = true;
      continue;
    }
    if (c == '\'' || c == '"') {
      size_t j = i + 1;
      while (j < inner.size() && inner[j] != c) j += inner[j] == '\\' ? 2 : 1;
      out += '\x01' + unescape(inner.substr(i + 1, std::min(j, inner.size()) - i - 1)) + '\x02';
      i = j;
      space = false;
      continue;
    }
    if (space && !out.empty() && is_ident(out.back()) && is_ident(c)) out += ' ';
    out += c;
    space = false;
  }
  return out;
}

// The template with every whitespace that cannot reach the output taken out: whitespace control
// ({%- -%}), transformers' trim_blocks (the newline after a block tag) and lstrip_blocks (spaces
// and tabs before a block tag on its line), the template's final newline, comments, and whitespace
// inside tags.
std::string normalize_jinja(const std::string& source) {
  // Jinja drops one newline that ends the template (keep_trailing_newline is off).
  std::string t = source;
  if (t.size() >= 2 && t.compare(t.size() - 2, 2, "\r\n") == 0)
    t.resize(t.size() - 2);
  else if (!t.empty() && t.back() == '\n')
    t.pop_back();
  struct Piece {
    bool tag;
    char kind;  // '{' expression, '%' statement, '#' comment
    bool trim_left, trim_right, keep_left, keep_right;
    std::string text;
  };
  std::vector<Piece> pieces;
  size_t i = 0;
  std::string text;
  while (i < t.size()) {
    if (t[i] == '{' && i + 1 < t.size() && (t[i + 1] == '{' || t[i + 1] == '%' || t[i + 1] == '#')) {
      const char kind = t[i + 1];
      const std::string close = kind == '{' ? "}}" : kind == '%' ? "%}" : "#}";
      size_t j = i + 2;
      Piece p{true, kind, false, false, false, false, ""};
      if (j < t.size() && (t[j] == '-' || t[j] == '+')) (t[j] == '-' ? p.trim_left : p.keep_left) = true, ++j;
      std::string inner;
      while (j < t.size() && t.compare(j, 2, close) != 0) {
        if (kind != '#' && (t[j] == '\'' || t[j] == '"')) {
          const size_t start = j;
          const char q = t[j++];
          while (j < t.size() && t[j] != q) j += t[j] == '\\' ? 2 : 1;
          j = std::min(j + 1, t.size());
          inner += t.substr(start, j - start);
          continue;
        }
        inner += t[j++];
      }
      if (!inner.empty() && (inner.back() == '-' || inner.back() == '+')) {
        (inner.back() == '-' ? p.trim_right : p.keep_right) = true;
        inner.pop_back();
      }
      pieces.push_back({false, 0, false, false, false, false, text});
      text.clear();
      p.text = kind == '#' ? "" : normalize_tag(inner);
      pieces.push_back(p);
      i = std::min(j + 2, t.size());
      continue;
    }
    text += t[i++];
  }
  pieces.push_back({false, 0, false, false, false, false, text});
  // Whitespace control applies to the text pieces around each tag.
  for (size_t k = 1; k + 1 < pieces.size(); k += 2) {
    Piece& tag = pieces[k];
    std::string& before = pieces[k - 1].text;
    std::string& after = pieces[k + 1].text;
    const bool block = tag.kind != '{';
    if (tag.trim_left) {
      while (!before.empty() && is_ws(before.back())) before.pop_back();
    } else if (block && !tag.keep_left) {  // lstrip_blocks
      size_t e = before.size();
      while (e > 0 && (before[e - 1] == ' ' || before[e - 1] == '\t')) --e;
      if (e == 0 ? k == 1 : before[e - 1] == '\n') before.resize(e);
    }
    if (tag.trim_right) {
      size_t s = 0;
      while (s < after.size() && is_ws(after[s])) ++s;
      after.erase(0, s);
    } else if (block && !tag.keep_right && !after.empty() && after[0] == '\n') {  // trim_blocks
      after.erase(0, 1);
    } else if (block && !tag.keep_right && after.compare(0, 2, "\r\n") == 0) {
      after.erase(0, 2);
    }
  }
  std::string out;
  for (const Piece& p : pieces) {
    if (!p.tag) {
      out += p.text;
    } else if (p.kind != '#') {
      out += std::string("\x03") + p.kind + p.text + "\x04";
    }
  }
  return out;
}

}  // namespace

const char* example_format_name(ExampleFormat f) {
  switch (f) {
    case ExampleFormat::alpaca: return "alpaca";
    case ExampleFormat::prompt_completion: return "prompt_completion";
    case ExampleFormat::messages: return "messages";
  }
  return "?";
}

std::optional<ExampleFormat> parse_example_format(const std::string& s) {
  for (ExampleFormat f : kAllFormats) {
    if (s == example_format_name(f)) return f;
  }
  return std::nullopt;
}

const char* chat_template_name(ChatTemplate t) {
  switch (t) {
    case ChatTemplate::plain: return "plain";
    case ChatTemplate::alpaca: return "alpaca";
    case ChatTemplate::llama2: return "llama2";
    case ChatTemplate::llama3: return "llama3";
    case ChatTemplate::chatml: return "chatml";
  }
  return "?";
}

std::optional<ChatTemplate> parse_chat_template(const std::string& s) {
  for (ChatTemplate t : kAllTemplates) {
    if (s == chat_template_name(t)) return t;
  }
  return std::nullopt;
}

const std::string& chat_template_jinja(ChatTemplate t) {
  static const std::string llama2 = kLlama2Jinja, llama3 = kLlama3Jinja, chatml = kChatmlJinja, none;
  switch (t) {
    case ChatTemplate::llama2: return llama2;
    case ChatTemplate::llama3: return llama3;
    case ChatTemplate::chatml: return chatml;
    default: return none;
  }
}

std::optional<ChatTemplate> recognize_chat_template(const std::string& jinja) {
  static const std::vector<std::pair<std::string, ChatTemplate>> known = {
      {normalize_jinja(kLlama2Jinja), ChatTemplate::llama2},
      {normalize_jinja(kLlama3Jinja), ChatTemplate::llama3},
      {normalize_jinja(kChatmlJinja), ChatTemplate::chatml},
      {normalize_jinja(kChatmlGuardedJinja), ChatTemplate::chatml},
  };
  const std::string n = normalize_jinja(jinja);
  for (const auto& [text, t] : known) {
    if (n == text) return t;
  }
  return std::nullopt;
}

ChatTemplate folder_chat_template(const std::string& dir) {
  const std::string hint = "; set data.template to one of them";
  const std::string builtin = " (built in: alpaca, plain, llama2, llama3, chatml)";
  auto recognized = [&](const std::string& jinja, const std::string& where) {
    if (const auto known = recognize_chat_template(jinja)) return *known;
    throw std::invalid_argument(where + " is not one frugal knows" + builtin + hint);
  };
  // transformers 5 saves the template as chat_template.jinja, which wins over the config's.
  const std::string jinja_path = dir + "/chat_template.jinja";
  if (io::path_exists(jinja_path)) return recognized(io::read_file(jinja_path, io::kMetadataFileBytes), jinja_path);
  const std::string path = dir + "/tokenizer_config.json";
  if (!io::path_exists(path)) {
    throw std::invalid_argument("the tokenizer folder " + dir + " has no chat_template (neither chat_template.jinja nor " +
                                "tokenizer_config.json)" + builtin + hint);
  }
  io::JsonValue config;
  try {
    config = io::parse_json(io::read_file(path, io::kMetadataFileBytes));
  } catch (const io::JsonError& e) {
    throw std::invalid_argument(path + " is not valid JSON: " + e.what());
  }
  const io::JsonValue* t = config.is_object() ? config.find("chat_template") : nullptr;
  if (!t || t->is_null()) throw std::invalid_argument(path + " has no chat_template" + builtin + hint);
  if (!t->is_string()) {
    // A list of named templates ([{"name": "default", "template": ...}]): apply_chat_template uses the default one.
    const io::JsonValue* chosen = nullptr;
    if (t->is_array()) {
      for (const auto& item : t->items()) {
        const io::JsonValue* name = item.is_object() ? item.find("name") : nullptr;
        if (name && name->is_string() && name->as_string() == "default") chosen = item.find("template");
      }
    }
    if (!chosen || !chosen->is_string())
      throw std::invalid_argument(path + "'s chat_template is neither a string nor a list with a 'default' template");
    t = chosen;
  }
  return recognized(t->as_string(), path + "'s chat_template");
}

namespace {

// Python's str.isspace() for one code point.
bool python_space(uint32_t cp) {
  return (cp >= 0x09 && cp <= 0x0D) || (cp >= 0x1C && cp <= 0x20) || cp == 0x85 || cp == 0xA0 || cp == 0x1680 ||
         (cp >= 0x2000 && cp <= 0x200A) || cp == 0x2028 || cp == 0x2029 || cp == 0x202F || cp == 0x205F || cp == 0x3000;
}

// The code point starting at s[i] and its length (valid UTF-8 is assumed; a bad byte is itself).
uint32_t decode_at(const std::string& s, size_t i, size_t& len) {
  const auto b = [&](size_t k) { return static_cast<uint32_t>(static_cast<unsigned char>(s[i + k])); };
  const uint32_t c = b(0);
  len = c < 0x80 ? 1 : (c >> 5) == 6 ? 2 : (c >> 4) == 14 ? 3 : (c >> 3) == 30 ? 4 : 1;
  if (i + len > s.size()) len = 1;
  if (len == 1) return c;
  uint32_t cp = c & (0x7F >> len);
  for (size_t k = 1; k < len; ++k) cp = (cp << 6) | (b(k) & 0x3F);
  return cp;
}

[[noreturn]] void refuse(const std::string& why) { throw std::invalid_argument(why); }

}  // namespace

std::string python_strip(const std::string& s) {
  size_t begin = 0, len = 0;
  while (begin < s.size() && python_space(decode_at(s, begin, len))) begin += len;
  size_t end = begin;
  for (size_t i = begin; i < s.size(); i += len) {
    if (!python_space(decode_at(s, i, len))) end = i + len;
  }
  return s.substr(begin, end - begin);
}

std::string alpaca_prompt(const std::string& instruction, const std::string& input) {
  if (input.empty()) {
    return "Below is an instruction that describes a task. Write a response that appropriately completes the request.\n\n"
           "### Instruction:\n" +
           instruction + "\n\n### Response:\n";
  }
  return "Below is an instruction that describes a task, paired with an input that provides further context. Write a "
         "response that appropriately completes the request.\n\n### Instruction:\n" +
         instruction + "\n\n### Input:\n" + input + "\n\n### Response:\n";
}

RenderedExample render_messages(ChatTemplate t, const std::vector<ChatMessage>& messages, const std::string& bos_token,
                                const std::string& eos_token, bool add_bos) {
  RenderedExample r;
  if (t == ChatTemplate::alpaca || t == ChatTemplate::plain) {
    if (messages.size() != 2 || messages[0].role != "user" || messages[1].role != "assistant") {
      refuse(std::string("the ") + chat_template_name(t) + " template takes one user message and one assistant message (no " +
             "system message, one turn); use a chat template (llama2, llama3, chatml) for conversations");
    }
    const std::string prompt = t == ChatTemplate::alpaca ? alpaca_prompt(messages[0].content, "") : messages[0].content;
    r.text = prompt + messages[1].content;
    r.answers.push_back({prompt.size(), r.text.size()});
    r.bos_id = add_bos;
    r.eos_id = true;
    return r;
  }
  const bool has_system = !messages.empty() && messages[0].role == "system";
  for (size_t i = 0; i < messages.size(); ++i) {
    const ChatMessage& m = messages[i];
    if (t == ChatTemplate::llama2) {
      if (has_system && i == 0) continue;         // folded into the first user message
      const size_t k = i - (has_system ? 1 : 0);  // loop.index0 over loop_messages
      if ((m.role == "user") != (k % 2 == 0)) refuse("Conversation roles must alternate user/assistant/user/assistant/...");
      const std::string content = k == 0 && has_system ? "<<SYS>>\n" + messages[0].content + "\n<</SYS>>\n\n" + m.content : m.content;
      if (m.role == "user") {
        r.text += bos_token + "[INST] " + python_strip(content) + " [/INST]";
      } else if (m.role == "assistant") {
        const size_t begin = r.text.size();
        // appended piece by piece: GCC 12 warns (-Wstringop-overflow) on " " + a temporary string here
        r.text.append(" ").append(python_strip(content)).append(" ").append(eos_token);
        r.answers.push_back({begin, r.text.size()});
      }
    } else if (t == ChatTemplate::llama3) {
      r.text += (i == 0 ? bos_token : std::string()) + "<|start_header_id|>" + m.role + "<|end_header_id|>\n\n";
      const size_t begin = r.text.size();
      r.text += python_strip(m.content) + "<|eot_id|>";
      if (m.role == "assistant") r.answers.push_back({begin, r.text.size()});
    } else {  // chatml
      r.text += "<|im_start|>" + m.role + "\n";
      const size_t begin = r.text.size();
      r.text += m.content + "<|im_end|>";
      if (m.role == "assistant") r.answers.push_back({begin, r.text.size()});
      r.text += "\n";
    }
  }
  return r;
}

}  // namespace data
}  // namespace frugal
