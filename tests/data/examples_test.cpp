// Instruction and chat examples: templates (exact strings), ids and loss flags on a byte-level
// tokenizer the tests make (every byte its own token, so each flag's text is known), SentencePiece
// against its own tokenizer.json, every kind of bad input, the examples file (hostile copies
// refused), padding and packing batches, deterministic epochs, and memory flat in dataset size.
#include <gtest/gtest.h>
#include <malloc.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <cstdio>
#include <cstring>
#include <fstream>
#include <functional>
#include <map>
#include <set>
#include <sstream>
#include <thread>
#include <type_traits>

#include "../support/peak_in_child.h"
#include "frugal/data/examples.h"
#include "frugal/data/tokenizer.h"
#include "frugal/io/files.h"
#include "frugal/io/json.h"
#include "frugal/io/json_value.h"
#include "frugal/io/utf8.h"
#include "../support/common.h"
#include "build_info.h"  // FRUGAL_*: this build's facts (CMakeLists.txt)

using namespace frugal::data;

namespace {

using frugal::testing::write_file;

const std::vector<std::string> kSpecials = {"<s>",        "</s>",         "<|start_header_id|>", "<|end_header_id|>",
                                            "<|eot_id|>", "<|im_start|>", "<|im_end|>"};

std::string examples_dir(const std::string& name) {
  const std::string d = ::testing::TempDir() + "/frugal_examples_" + name;
  frugal::io::remove_tree(d);
  frugal::io::make_directories(d);
  return d;
}

// A byte-level BPE without merges: byte b is token b; the special tokens follow from 256 in
// kSpecials' order (those in `specials` only, the rest absent).
std::string byte_tokenizer_json(const std::vector<std::string>& specials) {
  std::vector<uint32_t> chars(256);
  int extra = 0;
  for (uint32_t b = 0; b < 256; ++b) {
    const bool printable = (b >= 33 && b <= 126) || (b >= 161 && b <= 172) || (b >= 174);
    chars[b] = printable ? b : 256 + extra++;
  }
  std::ostringstream out;
  frugal::io::JsonWriter w(out, 0);
  w.begin_object().key("version").value("1.0").key("truncation").null().key("padding").null();
  w.key("added_tokens").begin_array();
  for (size_t i = 0; i < kSpecials.size(); ++i) {
    if (std::find(specials.begin(), specials.end(), kSpecials[i]) == specials.end()) continue;
    w.begin_object().key("id").value(static_cast<int64_t>(256 + i)).key("content").value(kSpecials[i]);
    w.key("single_word").value(false).key("lstrip").value(false).key("rstrip").value(false);
    w.key("normalized").value(false).key("special").value(true).end_object();
  }
  w.end_array().key("normalizer").null();
  w.key("pre_tokenizer").begin_object().key("type").value("ByteLevel").key("add_prefix_space").value(false);
  w.key("trim_offsets").value(true).key("use_regex").value(true).end_object();
  w.key("post_processor").null();
  w.key("decoder").begin_object().key("type").value("ByteLevel").key("add_prefix_space").value(true);
  w.key("trim_offsets").value(true).key("use_regex").value(true).end_object();
  w.key("model").begin_object().key("type").value("BPE").key("dropout").null().key("unk_token").null();
  w.key("continuing_subword_prefix").null().key("end_of_word_suffix").null().key("fuse_unk").value(false);
  w.key("byte_fallback").value(false).key("ignore_merges").value(false).key("vocab").begin_object();
  for (uint32_t b = 0; b < 256; ++b) {
    std::string c;
    frugal::io::append_utf8(c, chars[b]);
    w.key(c).value(static_cast<int64_t>(b));
  }
  w.end_object().key("merges").begin_array().end_array().end_object().end_object();
  return out.str();
}

// A model folder with that tokenizer: BOS <s>, EOS </s>, and (when given) a chat_template.
std::string byte_folder(const std::string& name, bool add_bos, const std::string& chat_template = "",
                        const std::vector<std::string>& specials = kSpecials) {
  const std::string d = examples_dir(name);
  write_file(d + "/tokenizer.json", byte_tokenizer_json(specials));
  std::ostringstream config;
  frugal::io::JsonWriter w(config, 0);
  w.begin_object().key("bos_token").value("<s>").key("eos_token").value("</s>").key("add_bos_token").value(add_bos);
  if (!chat_template.empty()) w.key("chat_template").value(chat_template);
  w.end_object();
  write_file(d + "/tokenizer_config.json", config.str());
  return d;
}

struct Expected {
  std::vector<int32_t> ids;
  std::vector<std::pair<size_t, size_t>> spans;  // each token's bytes in the text
};

// The byte tokenizer's ids for a text, special spellings as their tokens.
Expected byte_ids(const std::string& text) {
  Expected e;
  size_t i = 0;
  while (i < text.size()) {
    bool special = false;
    for (size_t k = 0; k < kSpecials.size(); ++k) {
      if (text.compare(i, kSpecials[k].size(), kSpecials[k]) == 0) {
        e.ids.push_back(static_cast<int32_t>(256 + k));
        e.spans.push_back({i, i + kSpecials[k].size()});
        i += kSpecials[k].size();
        special = true;
        break;
      }
    }
    if (!special) {
      e.ids.push_back(static_cast<unsigned char>(text[i]));
      e.spans.push_back({i, i + 1});
      ++i;
    }
  }
  return e;
}

frugal::io::JsonValue json(const std::string& text) { return frugal::io::parse_json(text); }

template <typename F>
std::string error_of(F&& f) {
  try {
    f();
  } catch (const std::invalid_argument& e) {
    return e.what();
  }
  return "(no error)";
}

#define EXPECT_HAS(text, needle) EXPECT_NE(std::string(text).find(needle), std::string::npos) << (text)

const std::vector<ChatMessage> kChat = {{"system", " Be brief. "},
                                        {"user", " Hi "},
                                        {"assistant", " Hello! "},
                                        {"user", "Again"},
                                        {"assistant", "Bye\xE3\x80\x80"}};  // ends with U+3000

}  // namespace

TEST(ExamplesNames, RoundTrip) {
  for (auto f : {ExampleFormat::alpaca, ExampleFormat::prompt_completion, ExampleFormat::messages}) {
    EXPECT_EQ(parse_example_format(example_format_name(f)), f);
  }
  for (auto t : {ChatTemplate::plain, ChatTemplate::alpaca, ChatTemplate::llama2, ChatTemplate::llama3, ChatTemplate::chatml}) {
    EXPECT_EQ(parse_chat_template(chat_template_name(t)), t);
  }
  EXPECT_FALSE(parse_example_format("sharegpt"));
  EXPECT_FALSE(parse_chat_template("Llama3"));
  EXPECT_EQ(std::string(chat_template_name(ChatTemplate::chatml)), "chatml");
}

TEST(ExamplesTemplates, RenderExactStrings) {
  auto answers = [](const RenderedExample& r) {
    std::vector<std::string> out;
    for (auto [b, e] : r.answers) out.push_back(r.text.substr(b, e - b));
    return out;
  };
  const RenderedExample l2 = render_messages(ChatTemplate::llama2, kChat, "<s>", "</s>", true);
  EXPECT_EQ(l2.text, "<s>[INST] <<SYS>>\n Be brief. \n<</SYS>>\n\n Hi [/INST] Hello! </s><s>[INST] Again [/INST] Bye </s>");
  EXPECT_EQ(answers(l2), (std::vector<std::string>{" Hello! </s>", " Bye </s>"}));
  EXPECT_FALSE(l2.bos_id || l2.eos_id);
  const RenderedExample l3 = render_messages(ChatTemplate::llama3, kChat, "<s>", "</s>", true);
  EXPECT_EQ(l3.text,
            "<s><|start_header_id|>system<|end_header_id|>\n\nBe brief.<|eot_id|><|start_header_id|>user<|end_header_id|>\n\n"
            "Hi<|eot_id|><|start_header_id|>assistant<|end_header_id|>\n\nHello!<|eot_id|><|start_header_id|>user"
            "<|end_header_id|>\n\nAgain<|eot_id|><|start_header_id|>assistant<|end_header_id|>\n\nBye<|eot_id|>");
  EXPECT_EQ(answers(l3), (std::vector<std::string>{"Hello!<|eot_id|>", "Bye<|eot_id|>"}));
  const RenderedExample cm = render_messages(ChatTemplate::chatml, kChat, "<s>", "</s>", true);
  EXPECT_EQ(cm.text,
            "<|im_start|>system\n Be brief. <|im_end|>\n<|im_start|>user\n Hi <|im_end|>\n<|im_start|>assistant\n Hello! "
            "<|im_end|>\n<|im_start|>user\nAgain<|im_end|>\n<|im_start|>assistant\nBye\xE3\x80\x80<|im_end|>\n");
  EXPECT_EQ(answers(cm), (std::vector<std::string>{" Hello! <|im_end|>", "Bye\xE3\x80\x80<|im_end|>"}));
  // Without a system message, llama2's first user message has no <<SYS>> block.
  const RenderedExample l2b = render_messages(ChatTemplate::llama2, {{"user", "Q"}, {"assistant", "A"}}, "<s>", "</s>", false);
  EXPECT_EQ(l2b.text, "<s>[INST] Q [/INST] A </s>");

  EXPECT_EQ(alpaca_prompt("Do X", ""),
            "Below is an instruction that describes a task. Write a response that appropriately completes the request.\n\n"
            "### Instruction:\nDo X\n\n### Response:\n");
  EXPECT_EQ(alpaca_prompt("Do X", "on Y"),
            "Below is an instruction that describes a task, paired with an input that provides further context. Write a "
            "response that appropriately completes the request.\n\n### Instruction:\nDo X\n\n### Input:\non Y\n\n### Response:\n");
  const RenderedExample al = render_messages(ChatTemplate::alpaca, {{"user", "Do X"}, {"assistant", "Done"}}, "<s>", "</s>", true);
  EXPECT_EQ(al.text, alpaca_prompt("Do X", "") + "Done");
  EXPECT_EQ(answers(al), (std::vector<std::string>{"Done"}));
  EXPECT_TRUE(al.bos_id && al.eos_id);
  const RenderedExample pl = render_messages(ChatTemplate::plain, {{"user", "1+1="}, {"assistant", " 2"}}, "<s>", "</s>", false);
  EXPECT_EQ(pl.text, "1+1= 2");
  EXPECT_EQ(answers(pl), (std::vector<std::string>{" 2"}));
  EXPECT_TRUE(!pl.bos_id && pl.eos_id);
  // alpaca and plain take one user and one assistant message only.
  EXPECT_HAS(error_of([&] { render_messages(ChatTemplate::alpaca, kChat, "<s>", "</s>", true); }), "one user message and one assistant");
  EXPECT_HAS(error_of([&] {
               render_messages(ChatTemplate::plain, {{"system", "s"}, {"user", "u"}, {"assistant", "a"}}, "", "</s>", false);
             }),
             "no system message");
}

TEST(ExamplesTemplates, RecognizesTheKnownJinjaTextsAndNoOthers) {
  for (auto t : {ChatTemplate::llama2, ChatTemplate::llama3, ChatTemplate::chatml}) {
    EXPECT_EQ(recognize_chat_template(chat_template_jinja(t)), t) << chat_template_name(t);
  }
  EXPECT_TRUE(chat_template_jinja(ChatTemplate::alpaca).empty());
  // Reformatted: tags over lines with whitespace control, '\n' escapes written as newlines, spacing.
  const std::string chatml_pretty =
      "{%- for message in messages %}\n    {{- '<|im_start|>' + message['role'] + '\n' + message['content'] + "
      "'<|im_end|>' + '\\n' }}\n{%- endfor %}\n{%- if add_generation_prompt %}\n    {{- '<|im_start|>assistant\\n' }}\n"
      "{%- endif %}\n";
  EXPECT_EQ(recognize_chat_template(chatml_pretty), ChatTemplate::chatml);
  std::string llama3_escaped = chat_template_jinja(ChatTemplate::llama3);
  for (size_t at; (at = llama3_escaped.find('\n')) != std::string::npos;) llama3_escaped.replace(at, 1, "\\n");
  EXPECT_EQ(recognize_chat_template(llama3_escaped), ChatTemplate::llama3);
  std::string llama2_spaced = chat_template_jinja(ChatTemplate::llama2);
  llama2_spaced.replace(llama2_spaced.find("{{ ' '  + content"), 17, "{{' ' + content");
  EXPECT_EQ(recognize_chat_template(llama2_spaced), ChatTemplate::llama2);
  // Different output: no recognition. ChatML without the newline after <|im_end|>; Qwen's default
  // system message; Llama-3's first release, which always ended with an assistant header.
  std::string chatml_changed = chat_template_jinja(ChatTemplate::chatml);
  chatml_changed.replace(chatml_changed.find("+ '<|im_end|>' + '\n'"), 21, "+ '<|im_end|>'");
  EXPECT_FALSE(recognize_chat_template(chatml_changed));
  EXPECT_FALSE(recognize_chat_template(
      "{% for message in messages %}{% if loop.first and messages[0]['role'] != 'system' %}{{ '<|im_start|>system\nYou are "
      "a helpful assistant.<|im_end|>\n' }}{% endif %}{{'<|im_start|>' + message['role'] + '\n' + message['content'] + "
      "'<|im_end|>' + '\n'}}{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"));
  std::string llama3_old = chat_template_jinja(ChatTemplate::llama3);
  llama3_old.replace(llama3_old.find("{% if add_generation_prompt %}"), 30, "");
  llama3_old.replace(llama3_old.rfind("{% endif %}"), 11, "");
  EXPECT_FALSE(recognize_chat_template(llama3_old));
  // Text outside tags counts when it reaches the output: not a newline after a block tag
  // (trim_blocks) and the template's last newline; anything more.
  EXPECT_EQ(recognize_chat_template(chat_template_jinja(ChatTemplate::chatml) + "\n\n"), ChatTemplate::chatml);
  EXPECT_FALSE(recognize_chat_template(chat_template_jinja(ChatTemplate::chatml) + "\n\n\n"));
  EXPECT_FALSE(recognize_chat_template(chat_template_jinja(ChatTemplate::chatml) + " "));
  EXPECT_FALSE(recognize_chat_template(""));

  // Folders: their tokenizer_config.json's chat_template.
  EXPECT_EQ(folder_chat_template(byte_folder("fold_l3", true, chat_template_jinja(ChatTemplate::llama3))), ChatTemplate::llama3);
  const std::string none = error_of([&] { folder_chat_template(byte_folder("fold_none", true)); });
  EXPECT_HAS(none, "has no chat_template");
  EXPECT_HAS(none, "set data.template");
  const std::string unknown = error_of([&] { folder_chat_template(byte_folder("fold_unknown", true, "{{ messages }}")); });
  EXPECT_HAS(unknown, "tokenizer_config.json's chat_template is not one frugal knows (built in: alpaca, plain, llama2, llama3, chatml)");
  EXPECT_HAS(unknown, "set data.template to one of them");
  // chat_template.jinja, as transformers 5 saves it, wins over the config's; a list's "default".
  const std::string both = byte_folder("fold_jinja", true, chat_template_jinja(ChatTemplate::llama3));
  write_file(both + "/chat_template.jinja", chat_template_jinja(ChatTemplate::chatml) + "\n");
  EXPECT_EQ(folder_chat_template(both), ChatTemplate::chatml);
  write_file(both + "/chat_template.jinja", "{{ messages }}");
  EXPECT_HAS(error_of([&] { folder_chat_template(both); }), "chat_template.jinja is not one frugal knows");
  const std::string listed = byte_folder("fold_list", true);
  std::ostringstream config;
  frugal::io::JsonWriter w(config, 0);
  w.begin_object().key("eos_token").value("</s>").key("chat_template").begin_array();
  w.begin_object().key("name").value("tool_use").key("template").value("{{ tools }}").end_object();
  w.begin_object().key("name").value("default").key("template").value(chat_template_jinja(ChatTemplate::llama2)).end_object();
  w.end_array().end_object();
  write_file(listed + "/tokenizer_config.json", config.str());
  EXPECT_EQ(folder_chat_template(listed), ChatTemplate::llama2);
}

// Every template on the byte tokenizer: ids are the text's bytes with special spellings as their
// tokens (BOS/EOS ids around alpaca and plain), and exactly the answer bytes and their closing
// token have loss; with train_on_prompt every token has.
TEST(ExamplesEncoder, IdsAndLossFlagsOnAByteTokenizer) {
  const Tokenizer tok = Tokenizer::load_folder(byte_folder("enc", /*add_bos=*/true, chat_template_jinja(ChatTemplate::chatml)));
  const std::string chat = R"({"messages": [{"role": "system", "content": " Be brief. "}, {"role": "user", "content": " Hi "},
      {"role": "assistant", "content": " Hello! "}, {"role": "user", "content": "Again"},
      {"role": "assistant", "content": "Bye\u3000"}], "id": 3})";
  struct Case {
    ExampleFormat format;
    std::optional<ChatTemplate> templ;
    std::string line;
    ChatTemplate resolved;
  };
  const std::vector<Case> cases = {
      {ExampleFormat::messages, ChatTemplate::llama2, chat, ChatTemplate::llama2},
      {ExampleFormat::messages, ChatTemplate::llama3, chat, ChatTemplate::llama3},
      {ExampleFormat::messages, std::nullopt, chat, ChatTemplate::chatml},  // the folder's template
      {ExampleFormat::alpaca, std::nullopt, R"({"instruction": "Add", "input": "2+2", "output": "4"})", ChatTemplate::alpaca},
      {ExampleFormat::alpaca, ChatTemplate::llama3, R"({"instruction": "Add", "input": "2+2", "output": "4"})", ChatTemplate::llama3},
      {ExampleFormat::prompt_completion, std::nullopt, R"({"prompt": "1+1=", "completion": " 2"})", ChatTemplate::plain},
      {ExampleFormat::prompt_completion, ChatTemplate::chatml, R"({"prompt": "1+1=", "completion": " 2"})", ChatTemplate::chatml},
      {ExampleFormat::messages, ChatTemplate::alpaca,
       R"({"messages": [{"role": "user", "content": "Do X"}, {"role": "assistant", "content": "Done"}]})", ChatTemplate::alpaca},
  };
  for (const Case& c : cases) {
    SCOPED_TRACE(std::string(example_format_name(c.format)) + " / " + chat_template_name(c.resolved));
    ExampleOptions opt;
    opt.format = c.format;
    opt.chat_template = c.templ;
    const ExampleEncoder enc(tok, opt);
    EXPECT_EQ(enc.chat_template(), c.resolved);
    const EncodedExample e = enc.encode(json(c.line));
    const auto msgs = enc.messages(json(c.line));
    RenderedExample r;
    if (c.format == ExampleFormat::alpaca && c.resolved == ChatTemplate::alpaca) {
      r.text = alpaca_prompt("Add", "2+2") + "4";
      r.answers = {{alpaca_prompt("Add", "2+2").size(), r.text.size()}};
      r.bos_id = r.eos_id = true;
    } else {
      r = render_messages(c.resolved, msgs, "<s>", "</s>", true);
    }
    EXPECT_EQ(e.text, r.text);
    const Expected want = byte_ids(r.text);
    std::vector<int32_t> ids = want.ids;
    std::vector<uint8_t> loss;
    for (auto [b, end] : want.spans) {
      bool in = false;
      for (auto [ab, ae] : r.answers) in = in || (b >= ab && end <= ae);
      loss.push_back(in);
    }
    if (r.bos_id) ids.insert(ids.begin(), 256), loss.insert(loss.begin(), 0);
    if (r.eos_id) ids.push_back(257), loss.push_back(1);
    EXPECT_EQ(e.ids, ids);
    EXPECT_EQ(e.loss, loss);
    opt.train_on_prompt = true;
    const EncodedExample all = ExampleEncoder(tok, opt).encode(json(c.line));
    EXPECT_EQ(all.ids, ids);
    EXPECT_EQ(std::count(all.loss.begin(), all.loss.end(), 1), static_cast<long>(ids.size()));
  }
  // alpaca's input joins the instruction as the user message for the chat templates.
  ExampleOptions opt;
  opt.chat_template = ChatTemplate::llama3;
  const auto msgs = ExampleEncoder(tok, opt).messages(json(R"({"instruction": "Add", "input": "2+2", "output": "4"})"));
  ASSERT_EQ(msgs.size(), 2u);
  EXPECT_EQ(msgs[0].content, "Add\n\n2+2");
  EXPECT_EQ(ExampleEncoder(tok, opt).messages(json(R"({"instruction": "Add", "input": "", "output": "4"})"))[0].content, "Add");
}

TEST(ExamplesEncoder, ATemplatesMissingSpecialTokenIsRefusedByName) {
  const Tokenizer tok = Tokenizer::load_folder(byte_folder("missing", true, "", {"<s>", "</s>", "<|im_end|>"}));
  ExampleOptions opt;
  opt.format = ExampleFormat::messages;
  opt.chat_template = ChatTemplate::chatml;
  EXPECT_HAS(error_of([&] { ExampleEncoder(tok, opt); }), "writes the token '<|im_start|>', which the tokenizer");
  opt.chat_template = ChatTemplate::llama3;
  EXPECT_HAS(error_of([&] { ExampleEncoder(tok, opt); }), "'<|start_header_id|>'");
  opt.chat_template = ChatTemplate::llama2;  // <s> and </s> are there
  EXPECT_NO_THROW(ExampleEncoder(tok, opt));
  opt.chat_template.reset();  // messages without a template: the folder's, and it has none
  EXPECT_HAS(error_of([&] { ExampleEncoder(tok, opt); }), "has no chat_template");
}

// A SentencePiece model does not find "<s>" in text; the encoder splits the template's special
// spellings out, so its ids equal those of the model's own tokenizer.json (which `tokenizers` and
// transformers use), masks too.
TEST(ExamplesEncoder, SentencePieceGivesItsTokenizerJsonsIds) {
  const std::string d = examples_dir("spm");
  std::vector<std::string> docs;
  const char* words[] = {"the", "cat", "sat", "on", "a", "mat", "and", "dog", "ran", "far", "away", "home"};
  for (int i = 0; i < 400; ++i) {
    std::string doc;
    for (int j = 0; j < 12; ++j) doc += std::string(words[(i * 7 + j * 3) % 12]) + (j == 11 ? ".\n" : " ");
    docs.push_back(doc);
  }
  train_tokenizer(docs, d + "/tok", TokenizerTrainOptions().vocab_size(320));
  const Tokenizer spm = Tokenizer::load(d + "/tok.model");
  spm.save_folder(d + "/folder");
  const Tokenizer json_tok = Tokenizer::load(d + "/folder/tokenizer.json");
  ASSERT_FALSE(spm.recognizes_special_tokens());
  ASSERT_TRUE(json_tok.recognizes_special_tokens());
  const std::vector<std::string> lines = {
      R"({"messages": [{"role": "system", "content": "the cat"}, {"role": "user", "content": " sat on a mat "},
          {"role": "assistant", "content": "the dog ran"}, {"role": "user", "content": "far"}, {"role": "assistant", "content": "away home."}]})",
      R"({"messages": [{"role": "user", "content": "a </s> in the text"}, {"role": "assistant", "content": "<s>home"}]})",
  };
  for (auto templ : {ChatTemplate::llama2, ChatTemplate::plain, ChatTemplate::alpaca}) {
    ExampleOptions opt;
    opt.format = ExampleFormat::messages;
    opt.chat_template = templ;
    for (const auto& line : lines) {
      if (templ != ChatTemplate::llama2 && line.find("system") != std::string::npos) continue;
      SCOPED_TRACE(std::string(chat_template_name(templ)) + ": " + line);
      const EncodedExample a = ExampleEncoder(spm, opt).encode(json(line));
      const EncodedExample b = ExampleEncoder(json_tok, opt).encode(json(line));
      EXPECT_EQ(a.ids, b.ids);
      EXPECT_EQ(a.loss, b.loss);
      EXPECT_EQ(a.text, b.text);
      // llama2: two BOS, from two user turns or from one and "<s>" in an answer's text.
      if (templ == ChatTemplate::llama2) {
        EXPECT_EQ(std::count(a.ids.begin(), a.ids.end(), spm.bos_id()), 2);
      }
    }
  }
}

// With real merges a token may span an answer's start: it has loss; the tokens before it spell a
// prefix of the prompt, the loss tokens end with the answer.
TEST(ExamplesEncoder, LossStartsAtTheTokenHoldingTheAnswersFirstByte) {
  const std::string fixtures = std::string(FRUGAL_SOURCE_DIR) + "/tests/data/fixtures/";
  for (const char* name : {"gpt2.json", "llama2.json", "mistral.json"}) {
    SCOPED_TRACE(name);
    const Tokenizer tok = Tokenizer::load(fixtures + name);
    ExampleOptions opt;
    opt.format = ExampleFormat::prompt_completion;
    for (const char* line : {R"({"prompt": "The quick brown", "completion": " fox jumps over the lazy dog."})",
                             R"({"prompt": "Numbers: 3.1", "completion": "4159, 2,718"})",
                             R"j({"prompt": "def main():\n", "completion": "    print('hello world')"})j"}) {
      const EncodedExample e = ExampleEncoder(tok, opt).encode(json(line));
      const auto v = json(line);
      const std::string prompt = v.at("prompt").as_string(), completion = v.at("completion").as_string();
      const size_t first = static_cast<size_t>(std::find(e.loss.begin(), e.loss.end(), 1) - e.loss.begin());
      ASSERT_LT(first, e.ids.size());
      EXPECT_TRUE(std::all_of(e.loss.begin() + first, e.loss.end(), [](uint8_t l) { return l == 1; }));
      const std::vector<int32_t> before(e.ids.begin(), e.ids.begin() + first);
      const std::vector<int32_t> through(e.ids.begin(), e.ids.begin() + first + 1);
      const std::vector<int32_t> all(e.ids.begin(), e.ids.end() - 1);
      EXPECT_EQ(tok.decode(all), prompt + completion);
      EXPECT_EQ(prompt.compare(0, tok.decode(before).size(), tok.decode(before)), 0) << tok.decode(before);  // all prompt
      EXPECT_GT(tok.decode(through).size(), prompt.size()) << tok.decode(through);  // the first loss token reaches the answer
      EXPECT_EQ(e.ids.back(), tok.eos_id());
    }
  }
}

// The chat templates encode only from the last special token before an answer's ends; on tokenizers
// with real merges (the fixtures, given the templates' tokens) the flags equal those of encoding
// every whole prefix, and the ids those of one encode call over the text.
TEST(ExamplesEncoder, AnchoredBoundariesEqualWholePrefixEncoding) {
  const std::string fixtures = std::string(FRUGAL_SOURCE_DIR) + "/tests/data/fixtures/";
  const auto expected = frugal::io::parse_json(frugal::io::read_file(fixtures + "expected_ids.json", frugal::io::kTokenizerFileBytes));
  const std::vector<std::string> added = {"<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>", "<|im_start|>", "<|im_end|>"};
  for (const char* name : {"gpt2", "llama3", "llama2", "mistral"}) {
    SCOPED_TRACE(name);
    std::string text = frugal::io::read_file(fixtures + name + ".json", frugal::io::kTokenizerFileBytes);
    const int64_t vocab = expected.at(name).at("vocab_size").as_int();
    std::string tokens;
    for (size_t i = 0; i < added.size(); ++i) {
      tokens += "{\"id\": " + std::to_string(vocab + static_cast<int64_t>(i)) + ", \"content\": \"" + added[i] +
                "\", \"single_word\": false, \"lstrip\": false, \"rstrip\": false, \"normalized\": false, \"special\": true}, ";
    }
    const size_t key = text.find("\"added_tokens\"");
    ASSERT_NE(key, std::string::npos);
    text.insert(text.find('[', key) + 1, tokens);
    const std::string d = examples_dir(std::string("anchor_") + name);
    write_file(d + "/tokenizer.json", text);
    const bool has_bos = std::string(name) != "gpt2";
    write_file(d + "/tokenizer_config.json", has_bos ? R"({"bos_token": ")" +
                                                           std::string(std::string(name) == "llama3" ? "<|begin_of_text|>" : "<s>") +
                                                           R"(", "eos_token": "<|eot_id|>"})"
                                                     : R"({"eos_token": "<|im_end|>"})");
    const Tokenizer tok = Tokenizer::load_folder(d);
    const std::vector<std::vector<ChatMessage>> chats = {
        kChat,
        {{"user", "def main():\n    print('hello world')"},
         {"assistant", "  It prints.\n\nThen returns."},
         {"user", "ok"},
         {"assistant", "\nx"}},
        {{"system", "日本語"}, {"user", "Numbers: 3.14159, 2,718"}, {"assistant", "1e-9 <|im_end|> 0x1F 😀"}},
    };
    for (auto templ : {ChatTemplate::llama2, ChatTemplate::llama3, ChatTemplate::chatml}) {
      if (!has_bos && templ != ChatTemplate::chatml) continue;
      SCOPED_TRACE(chat_template_name(templ));
      ExampleOptions opt;
      opt.format = ExampleFormat::messages;
      opt.chat_template = templ;
      const ExampleEncoder enc(tok, opt);
      for (const auto& chat : chats) {
        std::ostringstream line;
        frugal::io::JsonWriter w(line, 0);
        w.begin_object().key("messages").begin_array();
        for (const auto& m : chat) w.begin_object().key("role").value(m.role).key("content").value(m.content).end_object();
        w.end_array().end_object();
        const EncodedExample e = enc.encode(json(line.str()));
        const RenderedExample r = render_messages(templ, chat, tok.id_to_token(tok.bos_id()), tok.id_to_token(tok.eos_id()), true);
        const std::vector<int32_t> body = tok.encode(r.text);
        ASSERT_EQ(e.ids, body);
        std::vector<uint8_t> want(body.size(), 0);
        auto within = [&](size_t b) {
          const auto prefix = tok.encode(r.text.substr(0, b));
          size_t n = 0;
          while (n < prefix.size() && prefix[n] == body[n]) ++n;
          return n;
        };
        for (auto [b, end] : r.answers) {
          for (size_t k = within(b); k < within(end); ++k) want[k] = 1;
        }
        EXPECT_EQ(e.loss, want) << r.text;
        EXPECT_GT(std::count(want.begin(), want.end(), 1), 0);
      }
    }
  }
}

namespace {

std::vector<std::pair<std::string, int64_t>> read_order(const std::vector<std::string>& paths, const Tokenizer& tok,
                                                        const ExampleOptions& opt, ExampleStats* stats = nullptr) {
  std::vector<std::pair<std::string, int64_t>> out;
  const ExampleStats s = encode_examples(paths, tok, opt, [&](const std::string& f, int64_t line, const EncodedExample&) {
    out.push_back({f.substr(f.rfind('/') + 1), line});
  });
  if (stats) *stats = s;
  return out;
}

}  // namespace

TEST(ExamplesReading, FormatsFoldersArraysBomCrlfAndBlankLines) {
  const Tokenizer tok = Tokenizer::load_folder(byte_folder("read_tok", false));
  const std::string d = examples_dir("read");
  frugal::io::make_directories(d + "/b");
  write_file(
      d + "/c.jsonl",
      "\xEF\xBB\xBF{\"instruction\": \"x\", \"output\": \"y\"}\r\n\r\n  \n{\"instruction\": \"x\", \"input\": null, \"output\": \"y\", "
      "\"extra\": [1]}\r\n");
  write_file(d + "/b/2.jsonl", "{\"instruction\": \"x\", \"output\": \"y\"}");  // no final newline
  write_file(d + "/a.json",
             "\n[\n  {\"instruction\": \"x\",\n   \"output\": \"y, ] \\\" }\"},\n  {\"instruction\": \"z\", \"output\": \"w\"}\n]\n");
  write_file(d + "/notes.txt", "not read");
  ExampleOptions opt;
  ExampleStats stats;
  const auto order = read_order({d}, tok, opt, &stats);
  const std::vector<std::pair<std::string, int64_t>> want = {{"a.json", 3}, {"a.json", 5}, {"2.jsonl", 1}, {"c.jsonl", 1}, {"c.jsonl", 4}};
  EXPECT_EQ(order, want);
  EXPECT_EQ(stats.examples, 5);
  EXPECT_EQ(stats.skipped, 0);
  // An array item's text is what it says: the output with its ", ] \" }".
  std::vector<std::string> texts;
  encode_examples({d + "/a.json"}, tok, opt, [&](const std::string&, int64_t, const EncodedExample& e) { texts.push_back(e.text); });
  ASSERT_EQ(texts.size(), 2u);
  EXPECT_EQ(texts[0], alpaca_prompt("x", "") + "y, ] \" }");
  // Other field names.
  write_file(d + "/qa.jsonl", R"({"question": "Why?", "answer": "Because."})"
                              "\n");
  opt.format = ExampleFormat::prompt_completion;
  opt.fields.prompt = "question";
  opt.fields.completion = "answer";
  texts.clear();
  encode_examples({d + "/qa.jsonl"}, tok, opt, [&](const std::string&, int64_t, const EncodedExample& e) { texts.push_back(e.text); });
  EXPECT_EQ(texts, std::vector<std::string>{"Why?Because."});
  write_file(d + "/sg.jsonl", R"({"conversations": [{"from": "user", "value": "Hi"}, {"from": "assistant", "value": "Yo"}]})"
                              "\n");
  opt = ExampleOptions();
  opt.format = ExampleFormat::messages;
  opt.chat_template = ChatTemplate::chatml;
  opt.fields.messages = "conversations";
  opt.fields.role = "from";
  opt.fields.content = "value";
  texts.clear();
  encode_examples({d + "/sg.jsonl"}, tok, opt, [&](const std::string&, int64_t, const EncodedExample& e) { texts.push_back(e.text); });
  EXPECT_EQ(texts, std::vector<std::string>{"<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\nYo<|im_end|>\n"});
}

// Each bad input: one std::invalid_argument naming file, line and field; no examples file left.
TEST(ExamplesReading, BadInputIsNamedWithFileLineAndField) {
  const Tokenizer tok = Tokenizer::load_folder(byte_folder("bad_tok", false));
  const std::string d = examples_dir("bad");
  const std::string good = R"({"instruction": "x", "output": "y"})";
  const std::string chat_head = R"({"messages": [)";
  struct Case {
    std::string name, text, needle;
    ExampleFormat format = ExampleFormat::alpaca;
  };
  const std::vector<Case> cases = {
      {"malformed", good + "\n" + R"({"instruction": "x", "output": "y")", "line 2: not valid JSON: "},
      {"not_object", "\"just text\"\n", "line 1: is not a JSON object"},
      {"missing", good + "\n\n" + R"({"instruction": "x"})", "line 3: field 'output': is missing"},
      {"not_string", R"({"instruction": "x", "output": 5})", "line 1: field 'output': is not a string"},
      {"input_not_string", R"({"instruction": "x", "input": 1, "output": "y"})", "line 1: field 'input': is not a string"},
      {"empty_answer", R"({"instruction": "x", "output": " \n "})", "line 1: field 'output': is empty"},
      {"bad_utf8", "{\"instruction\": \"x\xff\", \"output\": \"y\"}", "line 1: is not valid UTF-8"},
      {"overlong_utf8", "{\"instruction\": \"\xC0\xAF\", \"output\": \"y\"}", "line 1: is not valid UTF-8"},
      {"not_list", R"({"messages": "hi"})", "line 1: field 'messages': is not a list", ExampleFormat::messages},
      {"empty_list", R"({"messages": []})", "line 1: field 'messages': is empty", ExampleFormat::messages},
      {"item", chat_head + R"("hi"]})", "field 'messages[0]': is not an object", ExampleFormat::messages},
      {"role_order", chat_head + R"({"role": "user", "content": "a"}, {"role": "user", "content": "b"}]})",
       "line 1: field 'messages[1].role': 'user' is out of order (expected 'assistant'", ExampleFormat::messages},
      {"system_late", chat_head + R"({"role": "user", "content": "a"}, {"role": "system", "content": "b"}]})",
       "field 'messages[1].role': 'system' is out of order", ExampleFormat::messages},
      {"starts_assistant", chat_head + R"({"role": "assistant", "content": "a"}]})",
       "field 'messages[0].role': 'assistant' is out of order (expected 'user'", ExampleFormat::messages},
      {"unknown_role", chat_head + R"({"role": "user", "content": "a"}, {"role": "tool", "content": "b"}]})",
       "field 'messages[1].role': unknown role 'tool' (allowed: system, user, assistant)", ExampleFormat::messages},
      {"ends_user",
       chat_head + R"({"role": "user", "content": "a"}, {"role": "assistant", "content": "b"}, {"role": "user", "content": "c"}]})",
       "field 'messages': ends with a user message", ExampleFormat::messages},
      {"content_list", chat_head + R"({"role": "user", "content": ["a"]}]})", "field 'messages[0].content': is not a string",
       ExampleFormat::messages},
      {"no_role", chat_head + R"({"content": "a"}]})", "field 'messages[0].role': is missing", ExampleFormat::messages},
      {"empty_assistant", chat_head + R"({"role": "user", "content": "a"}, {"role": "assistant", "content": ""}]})",
       "field 'messages[1].content': is empty", ExampleFormat::messages},
      {"empty", "", "is empty (no examples)"},
      {"blank", "\xEF\xBB\xBF\n  \r\n", "is empty (no examples)"},
      {"empty_array", "[ ]", "is empty (no examples)"},
      {"array_open", "[" + good + ",", "not valid JSON: the array is not closed"},
      {"array_trailing", "[" + good + "] x", "bytes after the array's closing ']'"},
      {"array_comma", "[" + good + " " + good + "]", "expected ',' or ']' after an item"},
  };
  for (const Case& c : cases) {
    SCOPED_TRACE(c.name);
    const std::string path = d + "/" + c.name + ".jsonl";
    write_file(path, c.text);
    ExampleOptions opt;
    opt.format = c.format;
    opt.chat_template = ChatTemplate::chatml;
    const std::string out = d + "/" + c.name + ".examples";
    const std::string what = error_of([&] { tokenize_examples({path}, tok, opt, out); });
    EXPECT_HAS(what, path);
    EXPECT_HAS(what, c.needle);
    EXPECT_EQ(what.find('\n'), std::string::npos) << what;
    EXPECT_FALSE(frugal::io::path_exists(out));
  }
  // A line over max_line_bytes, never held whole.
  ExampleOptions opt;
  opt.max_line_bytes = 100;
  const std::string long_line = "{\"instruction\": \"" + std::string(1000, 'x') + "\", \"output\": \"y\"}";
  write_file(d + "/long.jsonl", good + "\n" + long_line + "\r\n" + good + "\n");
  EXPECT_HAS(error_of([&] { tokenize_examples({d + "/long.jsonl"}, tok, opt, d + "/long.examples"); }),
             "long.jsonl line 2: is " + std::to_string(long_line.size() + 1) + " bytes, longer than max_line_bytes (100)");
  // Paths: missing, a FIFO (never blocks: opened O_NONBLOCK and refused by fstat), a folder without data.
  EXPECT_HAS(error_of([&] { tokenize_examples({d + "/nope.jsonl"}, tok, ExampleOptions(), d + "/x.examples"); }),
             "nope.jsonl does not exist");
  ASSERT_EQ(::mkfifo((d + "/fifo.jsonl").c_str(), 0600), 0);
  EXPECT_HAS(error_of([&] { tokenize_examples({d + "/fifo.jsonl"}, tok, ExampleOptions(), d + "/x.examples"); }),
             "is not a regular file (a FIFO)");
  const std::string empty_dir = examples_dir("bad_empty_dir");
  write_file(empty_dir + "/readme.md", "no data");
  EXPECT_HAS(error_of([&] { tokenize_examples({empty_dir}, tok, ExampleOptions(), d + "/x.examples"); }), "no *.jsonl or *.json files");
  // Every example bad and skipped: no examples is still an error, naming the first reason.
  opt = ExampleOptions();
  opt.skip_bad = true;
  const std::string all_bad = error_of([&] { tokenize_examples({d + "/not_string.jsonl"}, tok, opt, d + "/x.examples"); });
  EXPECT_HAS(all_bad, "holds no examples (1 skipped as bad, first: ");
  EXPECT_HAS(all_bad, "field 'output': is not a string");
  // An array's structure cannot be stepped over: an error with skip_bad too.
  EXPECT_HAS(error_of([&] { tokenize_examples({d + "/array_open.jsonl"}, tok, opt, d + "/x.examples"); }), "the array is not closed");
}

TEST(ExamplesReading, SkipBadCountsAndKeepsTheFirstReasons) {
  const Tokenizer tok = Tokenizer::load_folder(byte_folder("skip_tok", false));
  const std::string d = examples_dir("skip");
  std::string text;
  for (int i = 0; i < 30; ++i) {
    text += i % 3 == 1 ? R"({"instruction": "x", "output": 1})" : i % 3 == 2 ? "{bad json" : R"({"instruction": "x", "output": "y"})";
    text += "\n";
  }
  text += "{\"instruction\": \"" + std::string(500, 'z') + "\", \"output\": \"y\"}\n";
  write_file(d + "/mixed.jsonl", text);
  write_file(d + "/zero.jsonl", "");
  ExampleOptions opt;
  opt.skip_bad = true;
  opt.max_line_bytes = 200;
  const ExampleStats s = tokenize_examples({d}, tok, opt, d + "/out.examples");
  EXPECT_EQ(s.examples, 10);
  EXPECT_EQ(s.skipped, 10 + 10 + 1 + 1);  // wrong types, bad JSON, the long line, the empty file
  ASSERT_EQ(s.skipped_reasons.size(), 10u);
  EXPECT_HAS(s.skipped_reasons[0], "mixed.jsonl line 2: field 'output': is not a string");
  EXPECT_HAS(s.skipped_reasons[1], "mixed.jsonl line 3: not valid JSON");
  const ExampleFile f(d + "/out.examples");
  EXPECT_EQ(f.size(), 10);
  EXPECT_EQ(f.total_tokens(), s.tokens);
  EXPECT_EQ(f.label_tokens(), s.label_tokens);
}

namespace {

std::string read_bytes(const std::string& path) { return frugal::io::read_file(path, frugal::io::kTokenizerFileBytes); }

template <typename T>
void put(std::string& bytes, size_t at, T value) {
  std::memcpy(&bytes[at], &value, sizeof(T));
}

}  // namespace

TEST(ExampleFile, RoundTripsAndRefusesHostileCopies) {
  const std::string folder = byte_folder("file_tok", true, chat_template_jinja(ChatTemplate::llama3));
  const Tokenizer tok = Tokenizer::load_folder(folder);
  const std::string d = examples_dir("file");
  std::string text;
  for (int i = 0; i < 50; ++i) {
    text += R"({"messages": [{"role": "user", "content": "q)" + std::to_string(i) + R"("}, {"role": "assistant", "content": "a)" +
            std::string(static_cast<size_t>(i % 7 + 1), 'x') + "\"}]}\n";
  }
  write_file(d + "/chats.jsonl", text);
  ExampleOptions opt;
  opt.format = ExampleFormat::messages;
  std::vector<EncodedExample> want;
  encode_examples({d + "/chats.jsonl"}, tok, opt, [&](const std::string&, int64_t, const EncodedExample& e) { want.push_back(e); });
  const std::string path = d + "/chats.examples";
  const ExampleStats s = tokenize_examples({d + "/chats.jsonl"}, tok, opt, path);
  {
    const ExampleFile f(path);
    ASSERT_EQ(f.size(), 50);
    EXPECT_EQ(f.vocab_size(), tok.vocab_size());
    EXPECT_EQ(f.total_tokens(), s.tokens);
    EXPECT_EQ(f.fingerprint(), examples_fingerprint(tok, opt));
    for (int64_t i = 0; i < f.size(); ++i) {
      const auto& e = want[static_cast<size_t>(i)];
      ASSERT_EQ(f.length(i), static_cast<int64_t>(e.ids.size()));
      EXPECT_TRUE(std::equal(e.ids.begin(), e.ids.end(), f.tokens(i)));
      EXPECT_TRUE(std::equal(e.loss.begin(), e.loss.end(), f.loss(i)));
    }
  }
  // The fingerprint follows the template (the folder's, or set), train_on_prompt and the tokenizer.
  ExampleOptions other = opt;
  other.chat_template = ChatTemplate::chatml;
  EXPECT_NE(examples_fingerprint(tok, other), examples_fingerprint(tok, opt));
  other = opt;
  other.chat_template = ChatTemplate::llama3;  // the same template as the folder's: the same file
  EXPECT_EQ(examples_fingerprint(tok, other), examples_fingerprint(tok, opt));
  other.train_on_prompt = true;
  EXPECT_NE(examples_fingerprint(tok, other), examples_fingerprint(tok, opt));
  const Tokenizer no_bos = Tokenizer::load_folder(byte_folder("file_tok2", false, chat_template_jinja(ChatTemplate::llama3)));
  EXPECT_NE(examples_fingerprint(no_bos, opt), examples_fingerprint(tok, opt));

  // Hostile copies: each refused with std::invalid_argument, none read out of bounds.
  const std::string bytes = read_bytes(path);
  uint32_t fp = 0;
  uint64_t count = 0, total = 0;
  std::memcpy(&fp, &bytes[12], 4);
  std::memcpy(&count, &bytes[24], 8);
  std::memcpy(&total, &bytes[32], 8);
  const size_t tokens_at = 64 + ((fp + 7) & ~7u);
  const size_t flags_at = tokens_at + ((total * 4 + 7) & ~size_t(7));
  const size_t offsets_at = flags_at + ((total + 7) & ~size_t(7));
  ASSERT_EQ(offsets_at + (count + 1) * 8, bytes.size());
  std::vector<std::pair<std::string, std::string>> hostile;
  auto variant = [&](const std::string& name, const std::function<void(std::string&)>& change, const std::string& needle) {
    std::string b = bytes;
    change(b);
    write_file(d + "/" + name, b);
    hostile.push_back({name, needle});
  };
  variant(
      "magic", [](std::string& b) { b[0] = 'X'; }, "bad magic");
  variant(
      "version", [](std::string& b) { put<uint32_t>(b, 8, 2); }, "has version 2");
  variant(
      "vocab", [](std::string& b) { put<uint64_t>(b, 16, 0); }, "bad vocabulary size");
  variant(
      "fp_long", [](std::string& b) { put<uint32_t>(b, 12, 0xFFFFFFFFu); }, "fingerprint is longer");
  variant(
      "total_huge", [](std::string& b) { put<uint64_t>(b, 32, uint64_t(1) << 62); }, "more than its size allows");
  variant(
      "count_huge", [](std::string& b) { put<uint64_t>(b, 24, ~uint64_t(0)); }, "examples but its size says otherwise");
  variant(
      "count_zero", [](std::string& b) { put<uint64_t>(b, 24, 0); }, "examples but its size says otherwise");
  variant(
      "truncated", [](std::string& b) { b.resize(b.size() - 8); }, "its size says otherwise");
  variant(
      "short", [](std::string& b) { b.resize(40); }, "too short to have a header");
  variant(
      "offset_back", [&](std::string& b) { put<uint64_t>(b, offsets_at + 8 * 5, 3); }, "fewer than two tokens, or offsets that go back");
  variant(
      "offset_end", [&](std::string& b) { put<uint64_t>(b, offsets_at + 8 * count, total + 1000); }, "do not run from 0");
  variant(
      "offset_start", [&](std::string& b) { put<uint64_t>(b, offsets_at, 1); }, "do not run from 0");
  variant(
      "token_vocab", [&](std::string& b) { put<int32_t>(b, tokens_at + 4 * 17, static_cast<int32_t>(tok.vocab_size())); },
      "outside its vocabulary");
  variant(
      "token_negative", [&](std::string& b) { put<int32_t>(b, tokens_at, -5); }, "holds token -5");
  variant(
      "flag", [&](std::string& b) { b[flags_at + 3] = 2; }, "loss flag other than 0 or 1");
  variant(
      "labels", [&](std::string& b) { put<uint64_t>(b, 40, 1); }, "answer tokens but its flags count");
  for (const auto& [name, needle] : hostile) {
    SCOPED_TRACE(name);
    EXPECT_HAS(error_of([&, n = name] { ExampleFile f(d + "/" + n); }), needle);
  }
  // Random damage to the header and the offsets: loaded or refused, never a crash.
  uint64_t x = 12345;
  for (int trial = 0; trial < 300; ++trial) {
    std::string b = bytes;
    for (int k = 0; k < 3; ++k) {
      x = x * 6364136223846793005ull + 1442695040888963407ull;
      const size_t region = (x >> 33) % 2;
      const size_t at = region == 0 ? (x >> 40) % 64 : offsets_at + (x >> 40) % (b.size() - offsets_at);
      b[at] = static_cast<char>(x >> 24);
    }
    write_file(d + "/fuzz", b);
    try {
      const ExampleFile f(d + "/fuzz");
      int64_t sum = 0;  // every example's last token and flag read: in bounds when the checks hold
      for (int64_t i = 0; i < f.size(); ++i) sum += f.tokens(i)[f.length(i) - 1] + f.loss(i)[f.length(i) - 1];
      EXPECT_GE(sum, 0);
    } catch (const std::invalid_argument&) {
    }
  }
}

namespace {

// Plain examples on the byte tokenizer without BOS: example i is "p" + char('a' + i % 26) + ('A' +
// i / 26), then i % 9 + 1 'x's as the completion, then EOS: i % 9 + 5 tokens (positions: one less),
// only the completion and EOS with loss.
std::shared_ptr<const ExampleFile> numbered_examples(const std::string& name, int n) {
  const Tokenizer tok = Tokenizer::load_folder(byte_folder(name + "_tok", false));
  const std::string d = examples_dir(name);
  std::string text;
  for (int i = 0; i < n; ++i) {
    text += "{\"prompt\": \"p" + std::string(1, static_cast<char>('a' + i % 26)) + std::string(1, static_cast<char>('A' + i / 26)) +
            "\", \"completion\": \"" + std::string(static_cast<size_t>(i % 9 + 1), 'x') + "\"}\n";
  }
  write_file(d + "/data.jsonl", text);
  ExampleOptions opt;
  opt.format = ExampleFormat::prompt_completion;
  tokenize_examples({d + "/data.jsonl"}, tok, opt, d + "/data.examples");
  return std::make_shared<const ExampleFile>(d + "/data.examples");
}

int example_of(const int64_t* row_tokens) { return (row_tokens[1] - 'a') + 26 * (row_tokens[2] - 'A'); }

// Checks one example's stretch of a row: its tokens and targets as the file says.
void expect_example_at(const ExampleFile& f, int e, const int64_t* tokens, const int64_t* targets, int64_t p) {
  ASSERT_LE(p, f.length(e) - 1);
  for (int64_t t = 0; t < p; ++t) {
    EXPECT_EQ(tokens[t], f.tokens(e)[t]);
    EXPECT_EQ(targets[t], f.loss(e)[t + 1] ? f.tokens(e)[t + 1] : -100) << "example " << e << " position " << t;
  }
}

// The examples of one epoch, each with where it was seen; checks rows, padding and segments.
std::vector<int> epoch_examples(const ExampleBatches& b, const ExampleFile& f, int64_t epoch, bool packing, int64_t seq_len) {
  std::vector<int> seen;
  for (int64_t s = epoch * b.steps_per_epoch(); s < (epoch + 1) * b.steps_per_epoch(); ++s) {
    for (const ExampleBatch& m : b.step(s)) {
      const int64_t R = m.tokens.size(0), T = m.tokens.size(1);
      EXPECT_EQ(m.targets.sizes(), m.tokens.sizes());
      EXPECT_EQ(m.segments.defined(), packing);
      if (packing) {
        EXPECT_EQ(T, seq_len);
      }
      int64_t real = 0, labels = 0;
      const int64_t* tok = m.tokens.data_ptr<int64_t>();
      const int64_t* tgt = m.targets.data_ptr<int64_t>();
      for (int64_t r = 0; r < R; ++r) {
        int64_t pos = 0, segment = 0;
        while (pos < T && tok[r * T + pos] == 'p') {  // an example starts with "p"
          const int e = example_of(tok + r * T + pos);
          const int64_t p = std::min(f.length(e) - 1, seq_len);
          expect_example_at(f, e, tok + r * T + pos, tgt + r * T + pos, p);
          if (packing) {
            const int64_t* seg = m.segments.data_ptr<int64_t>() + r * T + pos;
            EXPECT_TRUE(std::all_of(seg, seg + p, [&](int64_t v) { return v == segment; })) << "one segment per example";
          }
          seen.push_back(e);
          pos += p;
          ++segment;
          real += p;
          if (!packing) break;
        }
        for (int64_t t = pos; t < T; ++t) {
          EXPECT_EQ(tgt[r * T + t], -100);
          EXPECT_EQ(tok[r * T + t], 0);
          if (packing) {
            EXPECT_EQ(m.segments.data_ptr<int64_t>()[r * T + t], segment) << "trailing padding is its own segment";
          }
        }
      }
      for (int64_t k = 0; k < R * T; ++k) labels += tgt[k] != -100;
      EXPECT_EQ(m.real_tokens, real);
      EXPECT_EQ(m.padding_tokens, R * T - real);
      EXPECT_EQ(m.label_tokens, labels);
    }
  }
  return seen;
}

}  // namespace

TEST(ExampleBatches, PaddingRowsTargetsAndTheLastStepsPadding) {
  const auto f = numbered_examples("pad", 10);  // positions 4..12
  ExampleBatches b(f, 0, 10, {/*rows_per_step=*/4, /*micro_rows=*/2, /*seq_len=*/100});
  EXPECT_EQ(b.rows_per_epoch(), 10);
  EXPECT_EQ(b.steps_per_epoch(), 3);
  EXPECT_EQ(b.truncated(), 0);
  const auto step0 = b.step(0);
  ASSERT_EQ(step0.size(), 2u);
  for (const auto& m : step0) {  // each micro-batch as wide as its longest row
    const int64_t* tok = m.tokens.data_ptr<int64_t>();
    const int64_t T = m.tokens.size(1);
    EXPECT_EQ(T, std::max(f->length(example_of(tok)) - 1, f->length(example_of(tok + T)) - 1));
  }
  // The epoch's last step: 2 real rows, then a micro-batch of padding only.
  const auto last = b.step(2);
  EXPECT_EQ(last[1].real_tokens, 0);
  EXPECT_EQ(last[1].label_tokens, 0);
  EXPECT_TRUE((last[1].targets == -100).all().item<bool>());
  std::vector<int> seen = epoch_examples(b, *f, 0, false, 100);
  std::sort(seen.begin(), seen.end());
  EXPECT_EQ(seen, (std::vector<int>{0, 1, 2, 3, 4, 5, 6, 7, 8, 9}));
  // padding_share is epoch 0's padding over all its positions.
  int64_t pad = 0, all = 0;
  for (int64_t s = 0; s < b.steps_per_epoch(); ++s) {
    for (const auto& m : b.step(s)) pad += m.padding_tokens, all += m.tokens.numel();
  }
  EXPECT_DOUBLE_EQ(b.padding_share(), static_cast<double>(pad) / static_cast<double>(all));
  // One example: the prompt's tokens predict nothing, the completion and EOS are targets.
  ExampleBatches one(f, 3, 4, {1, 1, 100});
  const ExampleBatch m = one.step(0)[0];
  const std::vector<int64_t> tokens(m.tokens.data_ptr<int64_t>(), m.tokens.data_ptr<int64_t>() + m.tokens.numel());
  const std::vector<int64_t> targets(m.targets.data_ptr<int64_t>(), m.targets.data_ptr<int64_t>() + m.targets.numel());
  EXPECT_EQ(tokens, (std::vector<int64_t>{'p', 'd', 'A', 'x', 'x', 'x', 'x'}));
  EXPECT_EQ(targets, (std::vector<int64_t>{-100, -100, 'x', 'x', 'x', 'x', 257}));
}

TEST(ExampleBatches, PackingFillsRowsWithWholeExamplesAndSegments) {
  const auto f = numbered_examples("pack", 60);
  ExampleBatches::Options o{4, 2, 20, /*packing=*/true, false, /*seed=*/7};
  ExampleBatches b(f, 0, 60, o);
  int64_t positions = 0;
  for (int i = 0; i < 60; ++i) positions += f->length(i) - 1;
  EXPECT_LT(b.rows_per_epoch(), 60);
  EXPECT_GE(b.rows_per_epoch() * 20, positions);
  // Best-fit decreasing: within one row of the fewest rows that can hold every position.
  EXPECT_LE(b.rows_per_epoch(), (positions + 19) / 20 + 1) << positions << " positions";
  for (int64_t epoch = 0; epoch < 3; ++epoch) {
    std::vector<int> seen = epoch_examples(b, *f, epoch, true, 20);
    std::sort(seen.begin(), seen.end());
    std::vector<int> all(60);
    for (int i = 0; i < 60; ++i) all[static_cast<size_t>(i)] = i;
    EXPECT_EQ(seen, all) << "epoch " << epoch << ": every example exactly once";
  }
  EXPECT_GT(b.padding_share(), 0.0);
  EXPECT_LT(b.padding_share(), 0.5);
}

static_assert(std::is_move_constructible<ExampleBatches>::value && !std::is_copy_constructible<ExampleBatches>::value,
              "ExampleBatches moves (a trainer keeps one per split) and is not copied");

TEST(ExampleBatches, EpochsAreDeterministicAndDiffer) {
  const auto f = numbered_examples("epochs", 40);
  for (bool packing : {false, true}) {
    SCOPED_TRACE(packing ? "packing" : "padding");
    ExampleBatches::Options o{4, 4, 16, packing, false, 3};
    ExampleBatches a(f, 0, 40, o), same(f, 0, 40, o);
    o.seed = 4;
    ExampleBatches other_seed(f, 0, 40, o);
    const int64_t spe = a.steps_per_epoch();
    for (int64_t s : {int64_t(0), spe - 1, spe, 5 * spe + 2}) {
      const auto x = a.step(s), y = same.step(s), again = a.step(s);
      ASSERT_EQ(x.size(), y.size());
      for (size_t m = 0; m < x.size(); ++m) {
        EXPECT_TRUE(x[m].tokens.equal(y[m].tokens) && x[m].targets.equal(again[m].targets)) << "step " << s;
      }
    }
    // Steps of different epochs from several threads at once: each as computed alone.
    std::vector<std::vector<ExampleBatch>> from_threads(8);
    std::vector<std::thread> threads;
    for (size_t k = 0; k < from_threads.size(); ++k) {
      threads.emplace_back([&, k] { from_threads[k] = a.step(static_cast<int64_t>(k) * spe + 1); });
    }
    for (auto& t : threads) t.join();
    for (size_t k = 0; k < from_threads.size(); ++k) {
      EXPECT_TRUE(from_threads[k][0].tokens.equal(same.step(static_cast<int64_t>(k) * spe + 1)[0].tokens)) << "thread " << k;
    }
    ExampleBatches moved(std::move(other_seed));
    EXPECT_TRUE(moved.step(3)[0].tokens.equal(ExampleBatches(f, 0, 40, o).step(3)[0].tokens));
    const auto e0 = epoch_examples(a, *f, 0, packing, 16), e1 = epoch_examples(a, *f, 1, packing, 16);
    EXPECT_NE(e0, e1);
    EXPECT_NE(e0, epoch_examples(moved, *f, 0, packing, 16));
    auto s0 = e0, s1 = e1;
    std::sort(s0.begin(), s0.end());
    std::sort(s1.begin(), s1.end());
    EXPECT_EQ(s0, s1);
    EXPECT_EQ(s0.size(), 40u);
  }
}

TEST(ExampleBatches, OverlongExamplesAreCutOrDroppedAndCounted) {
  const auto f = numbered_examples("long", 9);  // positions 4..12
  ExampleBatches cut(f, 0, 9, {3, 3, 6});
  EXPECT_EQ(cut.truncated(), 6);  // positions 7..12
  EXPECT_EQ(cut.dropped(), 0);
  EXPECT_EQ(cut.rows_per_epoch(), 9);
  std::vector<int> seen = epoch_examples(cut, *f, 0, false, 6);
  EXPECT_EQ(seen.size(), 9u);
  for (const auto& m : cut.step(0)) EXPECT_LE(m.tokens.size(1), 6);
  ExampleBatches drop(f, 0, 9, {3, 3, 6, false, /*drop_overlong=*/true});
  EXPECT_EQ(drop.dropped(), 6);
  EXPECT_EQ(drop.truncated(), 0);
  EXPECT_EQ(drop.rows_per_epoch(), 3);
  EXPECT_EQ(drop.steps_per_epoch(), 1);
  ExampleBatches packed(f, 0, 9, {3, 3, 6, /*packing=*/true});
  EXPECT_EQ(packed.truncated(), 6);
  epoch_examples(packed, *f, 0, true, 6);
  EXPECT_HAS(error_of([&] { ExampleBatches(f, 4, 9, {1, 1, 6, false, true}); }), "every example of [4, 9) is longer than seq_len 6");
}

TEST(ExampleBatches, EvalBatchesRunInFileOrderOnce) {
  const auto f = numbered_examples("eval", 10);
  for (bool packing : {false, true}) {
    ExampleBatches b(f, 2, 10, {6, 3, 30, packing});
    std::vector<int> seen;
    for (int64_t i = 0; i < b.eval_batches(); ++i) {
      const ExampleBatch m = b.eval_batch(i);
      EXPECT_EQ(m.tokens.size(0), 3);
      const int64_t T = m.tokens.size(1);
      const int64_t* tok = m.tokens.data_ptr<int64_t>();
      for (int64_t r = 0; r < 3; ++r) {
        for (int64_t pos = 0; pos < T && tok[r * T + pos] == 'p';) {
          const int e = example_of(tok + r * T + pos);
          seen.push_back(e);
          pos += f->length(e) - 1;
          if (!packing) break;
        }
      }
    }
    EXPECT_EQ(seen, (std::vector<int>{2, 3, 4, 5, 6, 7, 8, 9})) << (packing ? "packing" : "padding");
    EXPECT_TRUE(b.eval_batch(b.eval_batches()).tokens.equal(b.eval_batch(0).tokens));
  }
  ExampleBatches b(f, 0, 10, {4, 4, 30});
  EXPECT_EQ(b.eval_batches(), 3);
  EXPECT_EQ(b.eval_batch(2).real_tokens, f->length(8) - 1 + f->length(9) - 1);
}

TEST(ExampleBatches, BadOptionsAreRefused) {
  const auto f = numbered_examples("opts", 5);
  EXPECT_HAS(error_of([&] { ExampleBatches(f, 0, 5, {3, 2, 8}); }), "must be a positive multiple");
  EXPECT_HAS(error_of([&] { ExampleBatches(f, 0, 5, {2, 0, 8}); }), "must be a positive multiple");
  EXPECT_HAS(error_of([&] { ExampleBatches(f, 0, 5, {2, 2, 0}); }), "seq_len");
  EXPECT_HAS(error_of([&] { ExampleBatches(f, 3, 3, {2, 2, 8}); }), "is empty or outside");
  EXPECT_HAS(error_of([&] { ExampleBatches(f, 0, 6, {2, 2, 8}); }), "is empty or outside");
}

namespace {

struct ExamplesChildRun {
  int64_t rss_growth = 0, examples = 0, tokens = 0;
};

// tokenize_examples in a child process: its peak RSS growth (VmHWM after, less VmRSS when the peak
// was reset just before). held: the dataset is also read into memory first (a control: the measure
// must see memory that grows with the dataset).
ExamplesChildRun tokenize_examples_in_child(const std::string& data, const Tokenizer& tok, const std::string& out, bool held = false) {
  struct Counts {
    int64_t examples = 0, tokens = 0;
  };
  const auto r = frugal::testing::peak_in_child<Counts>([&] {
    const std::string copy = held ? frugal::io::read_file(data, frugal::io::kTokenizerFileBytes) : std::string();
    const ExampleStats s = tokenize_examples({data}, tok, ExampleOptions(), out);
    if (held && copy.empty()) throw std::runtime_error("the held copy is empty");
    return Counts{static_cast<int64_t>(s.examples), static_cast<int64_t>(s.tokens)};
  });
  return ExamplesChildRun{r.rss_growth, r.value.examples, r.value.tokens};
}

}  // namespace

// Memory flat in dataset size: N and 4N bytes of alpaca lines give 4x the examples and tokens while
// the tokenizing process's peak RSS grows by less than 2 MiB more (the same datasets held in memory
// grow by more than the 3N bytes added, so the measure sees such growth).
TEST(ExamplesMemory, TokenizingIsFlatInDatasetSize) {
  const Tokenizer tok = Tokenizer::load_folder(byte_folder("flat_tok", false));
  const std::string d = examples_dir("flat");
  std::string lines;
  for (int i = 0; lines.size() < (size_t(1) << 20); ++i) {
    lines += "{\"instruction\": \"Repeat the words " + std::to_string(i) + "\", \"input\": \"the cat sat on the mat\", \"output\": \"" +
             std::string(static_cast<size_t>(200 + i % 300), static_cast<char>('a' + i % 26)) + "\"}\n";
  }
  write_file(d + "/n.jsonl", lines);
  std::string four;
  for (int i = 0; i < 4; ++i) four += lines;
  write_file(d + "/4n.jsonl", four);
  const ExamplesChildRun small = tokenize_examples_in_child(d + "/n.jsonl", tok, d + "/n.examples");
  const ExamplesChildRun big = tokenize_examples_in_child(d + "/4n.jsonl", tok, d + "/4n.examples");
  EXPECT_EQ(big.examples, 4 * small.examples);
  EXPECT_EQ(big.tokens, 4 * small.tokens);
  RecordProperty("rss_growth_n", std::to_string(small.rss_growth));
  RecordProperty("rss_growth_4n", std::to_string(big.rss_growth));
  EXPECT_LT(big.rss_growth - small.rss_growth, int64_t(2) << 20)
      << "peak RSS growth " << small.rss_growth << " B for " << lines.size() << " B, " << big.rss_growth << " B for 4x";
  EXPECT_EQ(ExampleFile(d + "/4n.examples").size(), big.examples);
  const ExamplesChildRun small_held = tokenize_examples_in_child(d + "/n.jsonl", tok, d + "/n_held.examples", true);
  const ExamplesChildRun big_held = tokenize_examples_in_child(d + "/4n.jsonl", tok, d + "/4n_held.examples", true);
  EXPECT_GT(big_held.rss_growth - small_held.rss_growth, static_cast<int64_t>(2 * lines.size()));
  EXPECT_EQ(read_bytes(d + "/4n_held.examples"), read_bytes(d + "/4n.examples"));
}
