// frugal eval — a checkpoint's mean loss and perplexity on held-out text or tokens.
//   frugal eval --checkpoint out/tiny --text valid.txt
//   frugal eval --checkpoint hf-dir --tokens ids.txt --seq-len 128 --json-out eval.json --logits-out logits.safetensors
//   frugal eval --checkpoint hf-dir --jsonl docs.jsonl --dtype bf16
//   frugal eval --checkpoint out/alpaca-tiny --examples recipes/data/alpaca-tiny.val.jsonl --format alpaca
// Inputs: --text FILE (the whole file one document), --jsonl FILE (one {"text": ...} object per line,
// each line its own document), both encoded with the checkpoint's tokenizer as transformers' tokenizer(text)
// encodes them (BOS first when the tokenizer adds one); or --tokens FILE: a frugal token file ("FRUGALTK" header, data/corpus.h) or a text
// file of ids ("1 2 3", "1,2,3" or a JSON list), taken as one document as it is (no BOS added). Each document is cut into non-overlapping
// --seq-len windows and scored as models/evaluate.h says: the mean loss is over every predicted token (id t+1 from ids 0..t of its window),
// as transformers computes it with labels = input_ids. --examples FILE scores instruction or chat examples as training does
// (data/examples.h): each example one row, the loss on its answer tokens only (prompts masked, as labels of -100), the mean over every
// answer token.
#include <unistd.h>

#include <cmath>
#include <cstdlib>
#include <cstdio>
#include <iostream>
#include <sstream>

#include "args.h"
#include "commands.h"
#include "frugal/data/corpus.h"
#include "frugal/data/examples.h"
#include "frugal/io/files.h"
#include "frugal/io/json.h"
#include "frugal/io/json_value.h"
#include "frugal/io/safetensors.h"
#include "frugal/models/evaluate.h"
#include "frugal/models/hf_checkpoint.h"

namespace frugal {
namespace cli {
namespace {

// As transformers' tokenizer(text): BOS first (and EOS last) when the tokenizer adds them.
std::vector<int32_t> encode_document(const data::Tokenizer& tok, const std::string& text) {
  return tok.encode(text, /*add_special_tokens=*/true);
}

// The documents of --jsonl: one JSON object with a string "text" per non-empty line.
std::vector<std::string> read_jsonl(const std::string& path) {
  const std::string all = io::read_file(path, io::kWholeDataFileBytes, "--jsonl");
  std::vector<std::string> docs;
  size_t line_no = 0;
  for (size_t at = 0; at < all.size();) {
    size_t end = all.find('\n', at);
    if (end == std::string::npos) end = all.size();
    const std::string line = all.substr(at, end - at);
    at = end + 1;
    ++line_no;
    if (line.find_first_not_of(" \t\r") == std::string::npos) continue;
    try {
      const io::JsonValue v = io::parse_json(line);
      const io::JsonValue* text = v.is_object() ? v.find("text") : nullptr;
      if (!text || !text->is_string()) throw io::JsonError("not an object with a string \"text\"");
      docs.push_back(text->as_string());
    } catch (const io::JsonError& e) {
      throw UsageError("--jsonl " + path + " line " + std::to_string(line_no) + ": " + e.what());
    }
  }
  if (docs.empty()) throw UsageError("--jsonl " + path + " holds no documents");
  return docs;
}

std::vector<int32_t> read_token_ids(const std::string& path) {
  const std::string all = io::read_file(path, io::kWholeDataFileBytes, "--tokens");
  if (all.compare(0, 8, "FRUGALTK") == 0) {
    const data::TokenFile file(path);
    const at::Tensor t = file.tokens();  // (N) int32
    return std::vector<int32_t>(t.data_ptr<int32_t>(), t.data_ptr<int32_t>() + t.numel());
  }
  std::vector<int32_t> ids = parse_ids(all, "--tokens " + path);
  if (ids.empty()) throw UsageError("--tokens " + path + " holds no ids");
  return ids;
}

// The loss on the answers of instruction or chat examples: each example alone in a row (padded to
// the longest of its batch), its prompt tokens masked, as training computes it; the mean is over
// every answer token of every example.
models::EvalTotals score_examples(models::DecoderImpl& model, const data::Tokenizer& tok, const std::string& path,
                                  data::ExampleOptions options, int64_t seq_len, int64_t batch_size, int64_t* examples,
                                  int64_t* truncated) {
  try {
    options.chat_template = data::resolve_chat_template(tok, options);  // auto: the checkpoint's own, for messages
  } catch (const std::invalid_argument& e) {
    throw UsageError(std::string("--template: ") + e.what());
  }
  const io::TempDir tmp("frugal-eval");  // removed on every way out, signals included
  const std::string examples_path = tmp.path() + "/eval.examples";
  try {
    data::tokenize_examples({path}, tok, options, examples_path);
  } catch (const std::invalid_argument& e) {
    throw UsageError(std::string("--examples: ") + e.what());
  }
  auto file = std::make_shared<const data::ExampleFile>(examples_path);
  data::ExampleBatches::Options o;
  o.rows_per_step = o.micro_rows = batch_size;
  o.seq_len = seq_len;
  const data::ExampleBatches batches(file, 0, file->size(), o);
  *examples = file->size();
  *truncated = batches.truncated();
  models::EvalTotals t;
  at::NoGradGuard no_grad;
  model.eval();
  const models::LossOptions sum = models::LossOptions().reduction(loss::Reduction::sum);
  const c10::Device device = model.parameters().front().device();
  for (int64_t i = 0; i < batches.eval_batches(); ++i) {
    const data::ExampleBatch b = batches.eval_batch(i);
    t.loss_sum += model.loss(b.tokens.to(device), b.targets.to(device), sum).item<double>();
    t.tokens += b.label_tokens;
    t.windows += b.tokens.size(0);
  }
  return t;
}

}  // namespace

int run_eval(int argc, char** argv) {
  std::string dir, text_path, tokens_path, jsonl_path, examples_path, json_out, logits_out, dtype = "fp32";
  std::string format = "alpaca", chat_template = "auto";
  bool train_on_prompt = false;
  int64_t batch_size = 1, seq_len = 0;
  c10::Device device(c10::kCPU);
  Args args("eval", "Mean loss and perplexity of a checkpoint on held-out text or tokens (non-overlapping windows).");
  args.add_string("checkpoint", &dir, "a run folder (its latest checkpoint is used) or a checkpoint folder", "DIR");
  args.add_string("text", &text_path, "a text file, one document, encoded with the checkpoint's tokenizer", "FILE");
  args.add_string("jsonl", &jsonl_path, "one {\"text\": ...} object per line, each its own document", "FILE");
  args.add_string("tokens", &tokens_path, "a frugal token file, or ids as text (1 2 3, 1,2,3 or [1,2,3])", "FILE");
  args.add_string("examples", &examples_path,
                  "instruction or chat examples, one JSON object a line (as data.format takes them): the loss on the answers", "FILE");
  args.add_string("format", &format, "with --examples: alpaca, prompt_completion or messages", "FORMAT");
  args.add_string(
      "template", &chat_template,
      "with --examples: alpaca, plain, llama2, llama3, chatml, or auto (the format's own; for messages the checkpoint's chat_template)",
      "NAME");
  args.add_flag("train-on-prompt", &train_on_prompt, "with --examples: score the prompts' tokens too");
  args.add_int("seq-len", &seq_len, "window length in tokens (0: the model's max_seq_len, at most 2048)", 0, int64_t{1} << 24);
  args.add_int("batch-size", &batch_size, "windows per forward pass", 1, int64_t{1} << 24);
  args.add_string("dtype", &dtype, "fp32 or bf16 (weights and compute; loss always in fp32)", "DTYPE");
  args.add_device("device", &device, "where the model runs");
  args.add_output("json-out", &json_out, "also write {loss, perplexity, tokens, windows, ...} as JSON");
  args.add_output("logits-out", &logits_out, "write the last window's input_ids (1, n) and fp32 logits (1, n, V) as safetensors");
  if (!args.parse(argc, argv, 2)) return 0;
  const int inputs = !text_path.empty() + !tokens_path.empty() + !jsonl_path.empty() + !examples_path.empty();
  if (inputs != 1) throw UsageError("give exactly one of --text, --tokens, --jsonl, --examples");
  data::ExampleOptions example_options;
  if (!examples_path.empty()) {
    const auto f = data::parse_example_format(format);
    if (!f) throw UsageError("--format must be alpaca, prompt_completion or messages, not '" + format + "'");
    example_options.format = *f;
    if (chat_template != "auto") {
      const auto t = data::parse_chat_template(chat_template);
      if (!t) throw UsageError("--template must be auto, alpaca, plain, llama2, llama3 or chatml, not '" + chat_template + "'");
      example_options.chat_template = *t;
    }
    example_options.train_on_prompt = train_on_prompt;
    if (!logits_out.empty()) throw UsageError("--logits-out takes windows of --text, --tokens or --jsonl, not --examples");
  } else if (format != "alpaca" || chat_template != "auto" || train_on_prompt) {
    throw UsageError("--format, --template and --train-on-prompt go with --examples");
  }
  const at::TensorOptions weights = weights_dtype_option(dtype, /*allow_auto=*/false);
  for (const auto& [flag, p] : {std::pair<const char*, const std::string*>{"--text", &text_path},
                                {"--tokens", &tokens_path},
                                {"--jsonl", &jsonl_path},
                                {"--examples", &examples_path}}) {
    if (p->empty()) continue;
    try {
      io::open_regular_file(*p, flag);  // before the checkpoint loads: a FIFO, a device or a folder named as such
    } catch (const std::invalid_argument& e) {
      throw UsageError(e.what());
    }
  }
  const std::string step_dir = resolve_checkpoint_dir(dir);
  models::Decoder model;
  std::optional<data::Tokenizer> tok;
  try {
    model = models::load_hf_checkpoint(step_dir, weights.device(device));
    if (tokens_path.empty()) tok = load_checkpoint_tokenizer(step_dir);
  } catch (const std::invalid_argument& e) {
    throw UsageError(e.what());
  }
  if (tokens_path.empty() && !tok) throw UsageError("--checkpoint " + step_dir + " has no tokenizer.model: give --tokens instead");
  const int64_t window = seq_len > 0 ? seq_len : std::min<int64_t>(model->config().max_seq_len, 2048);
  if (window > model->config().max_seq_len) {
    throw UsageError("--seq-len " + std::to_string(window) + " exceeds the model's max_seq_len " +
                     std::to_string(model->config().max_seq_len));
  }
  if (!examples_path.empty()) {
    int64_t examples = 0, truncated = 0;
    const models::EvalTotals t = score_examples(*model, *tok, examples_path, example_options, window, batch_size, &examples, &truncated);
    if (t.tokens == 0) throw UsageError("--examples " + examples_path + ": no answer token to score");
    std::printf("loss %.6f  perplexity %.4f  answer tokens %lld  examples %lld  truncated %lld  seq_len %lld\n", t.mean_loss(),
                t.perplexity(), static_cast<long long>(t.tokens), static_cast<long long>(examples), static_cast<long long>(truncated),
                static_cast<long long>(window));
    if (!json_out.empty()) {
      std::ostringstream s;
      io::JsonWriter w(s);
      w.begin_object().key("checkpoint").value(step_dir).key("loss").value(t.mean_loss()).key("perplexity").value(t.perplexity());
      w.key("loss_sum").value(t.loss_sum).key("tokens").value(t.tokens).key("examples").value(examples).key("truncated").value(truncated);
      w.key("seq_len").value(window).key("dtype").value(dtype).end_object();
      s << "\n";
      write_output(json_out, s.str());
    }
    return 0;
  }
  std::vector<std::vector<int32_t>> documents;
  if (!tokens_path.empty()) {
    documents.push_back(read_token_ids(tokens_path));
  } else if (!text_path.empty()) {
    const std::string text = io::read_file(text_path, io::kWholeDataFileBytes, "--text");
    if (text.empty()) throw UsageError("--text " + text_path + " is empty");
    documents.push_back(encode_document(*tok, text));
  } else {
    for (const std::string& d : read_jsonl(jsonl_path)) documents.push_back(encode_document(*tok, d));
  }
  std::vector<std::vector<int32_t>> windows;
  for (const auto& d : documents) {
    for (auto& w : models::cut_windows(d, window)) windows.push_back(std::move(w));
  }
  const models::EvalTotals t = models::score_windows(*model, windows, batch_size, !logits_out.empty());
  if (t.tokens == 0) throw UsageError("the input has no token to predict (every window holds one id)");
  std::printf("loss %.6f  perplexity %.4f  tokens %lld  windows %lld  documents %zu  seq_len %lld\n", t.mean_loss(), t.perplexity(),
              static_cast<long long>(t.tokens), static_cast<long long>(t.windows), documents.size(), static_cast<long long>(window));
  if (!json_out.empty()) {
    std::ostringstream s;
    io::JsonWriter w(s);
    w.begin_object().key("checkpoint").value(step_dir).key("loss").value(t.mean_loss()).key("perplexity").value(t.perplexity());
    w.key("loss_sum").value(t.loss_sum).key("tokens").value(t.tokens).key("windows").value(t.windows);
    w.key("documents").value(static_cast<int64_t>(documents.size())).key("seq_len").value(window).key("dtype").value(dtype).end_object();
    s << "\n";
    write_output(json_out, s.str());
  }
  if (!logits_out.empty()) {
    if (!t.last_logits.defined()) throw UsageError("--logits-out: the last window holds one id, so it has nothing scored");
    const auto& last = windows.back();
    const at::Tensor ids = at::tensor(std::vector<int64_t>(last.begin(), last.end()), at::kLong).unsqueeze(0);  // (1, n)
    io::write_safetensors(logits_out, {{"input_ids", ids}, {"logits", t.last_logits}});
  }
  return 0;
}

}  // namespace cli
}  // namespace frugal
