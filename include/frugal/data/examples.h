// frugal/data/examples.h — instruction and chat datasets for fine-tuning: JSON Lines -> a chat
// template's text -> tokens with a per-token loss flag (answers only) -> an examples file -> batches.
//
// Formats: alpaca {"instruction", "input" (optional), "output"}, prompt_completion {"prompt",
// "completion"}, messages {"messages": [{"role", "content"}...]} (an optional system message, then
// user/assistant alternating from user, ending with assistant). Keys not named are allowed.
// Templates: alpaca, plain (prompt + completion + EOS), and the chat templates llama2, llama3 and
// chatml, whose ids equal transformers' apply_chat_template(messages, tokenize=True).
//
//   frugal::data::ExampleOptions opt;   opt.format = frugal::data::ExampleFormat::messages;
//   auto stats = frugal::data::tokenize_examples({"chats.jsonl"}, tok, opt, "out/chats.examples");
//   auto file = std::make_shared<const frugal::data::ExampleFile>("out/chats.examples");
//   frugal::data::ExampleBatches batches(file, 0, file->size(), {/*rows_per_step=*/8, /*micro_rows=*/4, /*seq_len=*/512});
//   for (const auto& micro : batches.step(7)) { /* micro.tokens, micro.targets: (4, T) */ }
#pragma once

#include <ATen/ATen.h>

#include <array>
#include <cstdint>
#include <functional>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "frugal/data/tokenizer.h"

namespace frugal {
namespace io {
class JsonValue;
}
namespace data {

enum class ExampleFormat { alpaca, prompt_completion, messages };
enum class ChatTemplate { plain, alpaca, llama2, llama3, chatml };
constexpr std::array<ExampleFormat, 3> kExampleFormats = {ExampleFormat::alpaca, ExampleFormat::prompt_completion, ExampleFormat::messages};
constexpr std::array<ChatTemplate, 5> kChatTemplates = {ChatTemplate::plain, ChatTemplate::alpaca, ChatTemplate::llama2,
                                                        ChatTemplate::llama3, ChatTemplate::chatml};

// "alpaca", "prompt_completion", "messages"; parse_example_format is the inverse (nullopt for any other text).
const char* example_format_name(ExampleFormat f);
std::optional<ExampleFormat> parse_example_format(const std::string& s);
// "plain", "alpaca", "llama2", "llama3", "chatml"; parse_chat_template is the inverse.
const char* chat_template_name(ChatTemplate t);
std::optional<ChatTemplate> parse_chat_template(const std::string& s);

// The JSON keys each format reads (datasets name them differently: "question"/"answer", "conversations"...).
struct ExampleFields {
  std::string instruction = "instruction", input = "input", output = "output", prompt = "prompt", completion = "completion",
              messages = "messages", role = "role", content = "content";
};

// How tokenize_examples reads and renders a dataset: format, template, keys, and what has loss.
struct ExampleOptions {
  ExampleFormat format = ExampleFormat::alpaca;
  // nullopt: the format's default: alpaca -> alpaca, prompt_completion -> plain, messages -> the
  // chat_template of tokenizer_config.json in the tokenizer's folder (folder_chat_template).
  std::optional<ChatTemplate> chat_template;
  ExampleFields fields;
  bool train_on_prompt = false;                // false: only answer tokens have loss
  bool skip_bad = false;                       // false: the first bad example throws; true: it is counted and skipped
  int64_t max_line_bytes = int64_t(64) << 20;  // a longer line (or array item) is a bad example, never held whole
};

// The template an ExampleOptions means for this tokenizer (the format's default when unset).
// Throws std::invalid_argument as folder_chat_template does.
ChatTemplate resolve_chat_template(const Tokenizer& tok, const ExampleOptions& opt);

// The built-in template whose canonical Jinja text (as Meta's Llama-2-chat and Llama-3-Instruct and
// the common ChatML tokenizer_config.json carry it) equals `jinja` once whitespace that does not reach
// the output is normalised away (outside string literals; Jinja's {%- -%} trims and transformers'
// trim_blocks/lstrip_blocks); string literals compare by value ('\n' and a newline are the same).
std::optional<ChatTemplate> recognize_chat_template(const std::string& jinja);
// A tokenizer folder's chat template, recognised: dir/chat_template.jinja (transformers 5 saves it
// there, and it wins) or tokenizer_config.json's chat_template (a string, or the "default" of a
// list of named ones). Throws std::invalid_argument "...has no chat_template" when absent,
// "...is not one frugal knows (built in: ...); set data.template to one of them" when unknown.
ChatTemplate folder_chat_template(const std::string& dir);
// The canonical Jinja text of a chat template (llama2, llama3, chatml); "" for plain and alpaca.
const std::string& chat_template_jinja(ChatTemplate t);

// One turn of a conversation: role ("system", "user" or "assistant") and text.
struct ChatMessage {
  std::string role, content;
};
// A conversation rendered as text: `answers` are the [begin, end) byte ranges whose tokens have loss
// (an assistant's content and its closing EOS/<|eot_id|>/<|im_end|> text); bos_id / eos_id: the
// tokenizer's BOS id goes before the text and its EOS id after it (alpaca and plain; the chat
// templates write them as text). Throws std::invalid_argument for a conversation the template
// cannot take (alpaca and plain: one user message and one assistant message, no system message).
struct RenderedExample {
  std::string text;
  std::vector<std::pair<size_t, size_t>> answers;
  bool bos_id = false, eos_id = false;
};
RenderedExample render_messages(ChatTemplate t, const std::vector<ChatMessage>& messages, const std::string& bos_token,
                                const std::string& eos_token, bool add_bos);
// Alpaca's prompt for an instruction and an input ("" selects the no-input variant).
std::string alpaca_prompt(const std::string& instruction, const std::string& input);

// One example's tokens, their loss flags, and the text they encode.
struct EncodedExample {
  std::vector<int32_t> ids;
  std::vector<uint8_t> loss;  // 1: predicting this token counts
  std::string text;           // what was encoded (special tokens as text)
};

// One example at a time. Tokens: the rendered text encoded whole as transformers does (a
// tokenizer.json recognises added tokens in it; for a SentencePiece model the text is split at the
// template's special-token spellings and their ids put in, as the model's converted tokenizer.json
// does). Loss flags: the tokens of an answer range are found by encoding the text up to each range's
// ends and taking the longest common prefix with the whole encoding, so a token spanning the start
// of an answer has loss. The chat templates' special tokens split the text, so only the text from
// the last of them before a range's end is encoded again: the cost stays linear in a conversation's
// length whatever its turns (alpaca and plain: one more encode, of the prompt).
class ExampleEncoder {
 public:
  // Resolves the template and checks the tokenizer has every special token it writes (BOS, EOS,
  // <|start_header_id|>, <|im_start|>...): std::invalid_argument naming the token otherwise.
  ExampleEncoder(const Tokenizer& tok, const ExampleOptions& opt);
  // The resolved template it renders with.
  ChatTemplate chat_template() const { return template_; }
  // std::invalid_argument "field 'output': is not a string" (no file or line: the caller adds them).
  EncodedExample encode(const io::JsonValue& example) const;
  std::vector<ChatMessage> messages(const io::JsonValue& example) const;  // the example as a conversation

 private:
  std::vector<int32_t> encode_text(const std::string& text) const;
  Tokenizer tok_;  // a copy (it shares the loaded model)
  ExampleOptions opt_;
  ChatTemplate template_;
  std::string bos_, eos_;                                  // the tokenizer's BOS/EOS spellings ("" when absent)
  std::vector<std::pair<std::string, int32_t>> specials_;  // SentencePiece: spellings split out of the text
  std::vector<std::pair<std::string, int32_t>> anchors_;   // the template's special tokens (see encode())
};

// What tokenize_examples or encode_examples read: examples kept and skipped, tokens, and tokens with loss.
struct ExampleStats {
  int64_t examples = 0, skipped = 0, tokens = 0, label_tokens = 0;
  std::vector<std::string> skipped_reasons;  // the first 10
};

// Reads JSON Lines from `paths` (files, or folders: every *.jsonl / *.json file below, sorted; a
// file starting with '[' is one JSON array of examples, alpaca_data.json's layout, read item by
// item), renders and tokenizes each example and writes the examples file at out_path atomically.
// Streamed: a line at a time, tokens and flags to disk in bounded pieces (memory flat in the
// dataset's size). A UTF-8 byte-order mark at a file's start and CRLF line ends are accepted; blank
// lines are skipped. Bad examples (malformed JSON, a missing or non-string field, an empty answer,
// roles out of order, invalid UTF-8, a line over max_line_bytes) throw std::invalid_argument
// "FILE line N: field 'output': is not a string" unless skip_bad; a path that is missing or not a
// regular file (a FIFO), or a dataset without examples, always throws.
ExampleStats tokenize_examples(const std::vector<std::string>& paths, const Tokenizer& tok, const ExampleOptions& opt,
                               const std::string& out_path);
// The same reading and checks, each example handed to on_example(file, line, example) instead of
// written (what `frugal tokenizer examples` prints).
ExampleStats encode_examples(const std::vector<std::string>& paths, const Tokenizer& tok, const ExampleOptions& opt,
                             const std::function<void(const std::string& file, int64_t line, const EncodedExample&)>& on_example);
// A hash of everything that decides an examples file's contents besides the dataset: the tokenizer
// (fingerprint, BOS/EOS and whether BOS is added), the resolved template and the options. Stored in
// the file (ExampleFile::fingerprint), so a changed tokenizer or template is seen.
std::string examples_fingerprint(const Tokenizer& tok, const ExampleOptions& opt);

// An examples file, memory-mapped. Format (little-endian): "FRUGALEX", u32 version 1, u32 fingerprint
// bytes F, u64 vocab, u64 examples N, u64 tokens M, u64 label tokens, 16 reserved bytes; the
// fingerprint; then, each section starting 8-aligned: M int32 tokens, M u8 loss flags, N+1 u64
// offsets (example i is tokens [offsets[i], offsets[i+1])).
class ExampleFile {
 public:
  // Checks the header, the sections against the file's size, the offsets (from 0, never
  // decreasing, ending at M) and every token against the vocabulary: std::invalid_argument naming
  // the problem, never a read out of bounds.
  explicit ExampleFile(const std::string& path);
  ~ExampleFile();
  ExampleFile(const ExampleFile&) = delete;
  ExampleFile& operator=(const ExampleFile&) = delete;
  // The number of examples, N.
  int64_t size() const { return count_; }
  // The vocabulary size from the header; every token is below it.
  int64_t vocab_size() const { return vocab_; }
  // The number of tokens over all examples, M.
  int64_t total_tokens() const { return tokens_total_; }
  // The number of tokens with loss (answer tokens) over all examples.
  int64_t label_tokens() const { return labels_total_; }
  // The examples_fingerprint the file was written with.
  const std::string& fingerprint() const { return fingerprint_; }
  int64_t length(int64_t i) const;         // tokens of example i
  const int32_t* tokens(int64_t i) const;  // length(i) ids, valid while this object lives
  const uint8_t* loss(int64_t i) const;    // length(i) flags: 1 = an answer token (predicting it counts)

 private:
  void* map_ = nullptr;
  size_t map_bytes_ = 0;
  int64_t count_ = 0, vocab_ = 0, tokens_total_ = 0, labels_total_ = 0;
  const int32_t* tokens_ = nullptr;
  const uint8_t* flags_ = nullptr;
  const uint64_t* offsets_ = nullptr;
  std::string fingerprint_;
};

// One micro-batch. tokens, targets: (R, T) int64. An example of n tokens fills n - 1 positions
// (inputs tokens[0..n-2], targets tokens[1..n-1]; cut to seq_len positions when longer);
// targets[r][t] = the next token of the same example when that token has loss, else -100; padding
// has token 0 and target -100. segments (R, T) int64, with packing only (undefined otherwise):
// positions of one example share a value (0, 1, ... along the row), trailing padding has its own.
// real_tokens: positions holding an example; padding_tokens = R * T - real_tokens; label_tokens:
// targets that are not -100 (normalise a step's summed loss by the step's label tokens).
struct ExampleBatch {
  at::Tensor tokens, targets, segments;
  int64_t real_tokens = 0, label_tokens = 0, padding_tokens = 0;
};

// Batches for training, a pure function of (seed, step). Padding: one example per row, each
// micro-batch as wide as its longest row; rows in a deterministic shuffle seeded by (seed, epoch)
// (splitmix64 and Fisher-Yates, the same on every LibTorch). Packing: examples (in a shuffle seeded
// by seed, for ties) packed best-fit decreasing into rows of seq_len positions (an example is never
// split; each goes, longest first, into the row it fills most tightly, or a new one) once, so every
// epoch has the same rows; each epoch shuffles the rows (seeded by (seed, epoch)). Either way every example is in exactly one row per
// epoch. Only O(examples) is precomputed (lengths, the rows, the current epoch's order), never the tokens. Movable, not copyable; step()
// and eval_batch() may be called from several threads.
class ExampleBatches {
 public:
  // How rows are made and grouped into steps.
  struct Options {
    int64_t rows_per_step = 8, micro_rows = 8;  // rows_per_step: a multiple of micro_rows
    int64_t seq_len = 512;                      // positions per row
    bool packing = false;
    bool drop_overlong = false;  // false: an example longer than seq_len is cut to it; true: left out
    uint64_t seed = 0;
  };
  // [first, end): the examples of this split. std::invalid_argument for bad options, an empty range
  // or a range where every example is dropped.
  ExampleBatches(std::shared_ptr<const ExampleFile> file, int64_t first, int64_t end, Options o);
  // The training rows of an epoch (the examples kept, or the packed rows with packing).
  int64_t rows_per_epoch() const { return static_cast<int64_t>(rows_.size()); }
  // ceil(rows of an epoch / rows_per_step); the last step's missing rows are all padding (no loss).
  int64_t steps_per_epoch() const { return (rows_per_epoch() + opt_.rows_per_step - 1) / opt_.rows_per_step; }
  // Examples longer than seq_len (per epoch), cut.
  int64_t truncated() const { return truncated_; }
  // Examples longer than seq_len, left out (drop_overlong).
  int64_t dropped() const { return dropped_; }
  // The rows_per_step / micro_rows micro-batches of `step` (epoch = step / steps_per_epoch).
  std::vector<ExampleBatch> step(int64_t step) const;
  // Validation: rows in file order (no shuffle; packed in file order with packing), the
  // index-th group of micro_rows rows, index taken modulo eval_batches(); the last group's missing
  // rows are padding, so eval_batches() consecutive calls see every example once.
  ExampleBatch eval_batch(int64_t index) const;
  int64_t eval_batches() const;  // ceil(validation rows / micro_rows)
  double padding_share() const;  // padding positions / all positions over epoch 0's steps

 private:
  struct Row {
    int64_t begin, end;  // into the example list the row draws from
  };
  std::vector<int64_t> epoch_order(int64_t epoch) const;  // row indices in the epoch's order
  ExampleBatch make_batch(const std::vector<const Row*>& rows, const std::vector<int64_t>& examples) const;
  int64_t positions(int64_t example) const;  // min(n - 1, seq_len)
  void pack_best_fit();                      // examples_ -> rows_ (packing)
  std::shared_ptr<const ExampleFile> file_;
  Options opt_;
  std::vector<int64_t> examples_;       // training order source: kept examples (packing: in the packing shuffle)
  std::vector<Row> rows_;               // rows over examples_
  std::vector<int64_t> eval_examples_;  // kept examples in file order
  std::vector<Row> eval_rows_;
  int64_t truncated_ = 0, dropped_ = 0;
  struct EpochCache {  // the current epoch's row order, for step() from several threads
    std::mutex mutex;
    int64_t epoch = -1;
    std::vector<int64_t> order;
  };
  std::unique_ptr<EpochCache> cache_ = std::make_unique<EpochCache>();  // movable, not copyable
};

}  // namespace data
}  // namespace frugal
