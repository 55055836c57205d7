// frugal tokenizer — train a SentencePiece tokenizer on a corpus, encode text with a tokenizer
// (a SentencePiece .model, a tokenizer.json or a model folder), or show how instruction and chat
// examples become tokens and loss flags.
#include <iostream>
#include <sstream>

#include "frugal/io/files.h"
#include "frugal/io/json.h"
#include "frugal/io/json_value.h"

#include "args.h"
#include "commands.h"
#include "frugal/data/corpus.h"
#include "frugal/data/examples.h"
#include "frugal/data/tokenizer.h"

namespace frugal {
namespace cli {
namespace {

const char* kUsage =
    "usage: frugal tokenizer train CORPUS --out PREFIX [--vocab-size N] [--model-type bpe|unigram]\n"
    "       frugal tokenizer encode TOKENIZER (TEXT | --text-file F | --texts-jsonl F) [--json] [--add-special-tokens]\n"
    "       frugal tokenizer examples TOKENIZER FILE... [--format alpaca|prompt_completion|messages]\n"
    "                [--template plain|alpaca|llama2|llama3|chatml] [--train-on-prompt] [--skip-bad]\n"
    "\n"
    "train: a SentencePiece model (Llama's tokenizer.model format) on a text file or folder; writes\n"
    "       PREFIX.model and PREFIX.vocab.\n"
    "encode: print the ids of TEXT, then the text decoded back. TOKENIZER is a .model, a tokenizer.json or\n"
    "       a model folder (tokenizer.json or tokenizer.model, and tokenizer_config.json); --text-file reads\n"
    "       the file's exact bytes; --json prints {\"ids\": [...], \"decoded\": ...} on one line;\n"
    "       --texts-jsonl encodes many texts in one run (one JSON string a line in, one --json line out each).\n"
    "examples: each example of the JSON Lines FILE(s) (or folders of *.jsonl / *.json) as one JSON line:\n"
    "       {\"file\", \"line\", \"text\" (rendered with the template), \"ids\", \"loss\" (1: the token is an answer\n"
    "       token, predicting it counts)}; then a summary line on stderr.\n";

}  // namespace

int run_tokenizer(int argc, char** argv) {
  if (argc < 3) throw UsageError("tokenizer needs an action (train, encode or examples); 'frugal tokenizer --help' describes them");
  if (std::string(argv[2]) == "--help" || std::string(argv[2]) == "-h") {
    std::cout << kUsage;
    return 0;
  }
  const std::string action = argv[2];
  if (action == "train") {
    std::string corpus, out, model_type = "bpe";
    int64_t vocab = 4096;
    Args args("tokenizer train", "Train a SentencePiece tokenizer on a text file or folder.");
    args.add_positional("CORPUS", &corpus, "a text file or a folder of them");
    args.add_output("out", &out, "output prefix, not a folder: writes PREFIX.model and PREFIX.vocab (out/tok -> out/tok.model)", "PREFIX");
    args.add_int("vocab-size", &vocab, "number of pieces (at least 300 with byte fallback)", 16, int64_t{1} << 24);
    args.add_string("model-type", &model_type, "bpe or unigram", "TYPE");
    if (!args.parse(argc, argv, 3)) return 0;
    if (out.empty()) throw UsageError("--out is required");
    std::vector<std::string> docs;
    try {
      docs = data::read_corpus(corpus);
      data::train_tokenizer(docs, out, data::TokenizerTrainOptions().vocab_size(vocab).model_type(model_type));
    } catch (const std::invalid_argument& e) {
      throw UsageError(e.what());
    }
    const auto tok = data::Tokenizer::load(out + ".model");
    std::cout << "trained " << out << ".model: " << tok.vocab_size() << " pieces from " << docs.size() << " documents\n";
    return 0;
  }
  if (action == "encode") {
    std::string model, text_file, texts_jsonl;
    std::vector<std::string> rest;
    bool json = false, add_special = false;
    Args args("tokenizer encode", "Encode text with a tokenizer and decode it back.");
    args.add_positional("TOKENIZER", &model, "a .model file, a tokenizer.json or a model folder");
    args.add_string("text-file", &text_file, "read the text from this file (its exact bytes)", "FILE");
    args.add_string("texts-jsonl", &texts_jsonl, "encode each text of this file (one JSON string a line), a --json line each", "FILE");
    args.add_flag("json", &json, "print {\"ids\": [...], \"decoded\": ...} on one line");
    args.add_flag("add-special-tokens", &add_special, "add BOS (and EOS) as the model's tokenizer does");
    args.add_rest(&rest, "TEXT");
    if (!args.parse(argc, argv, 3)) return 0;
    if (rest.size() + (text_file.empty() ? 0 : 1) + (texts_jsonl.empty() ? 0 : 1) != 1)
      throw UsageError("tokenizer encode needs the text: one TEXT argument, --text-file or --texts-jsonl");
    data::Tokenizer tok;
    std::vector<std::string> texts;
    try {
      tok = data::Tokenizer::load(model);
      if (!texts_jsonl.empty()) {
        std::istringstream lines(io::read_file(texts_jsonl, io::kWholeDataFileBytes, "--texts-jsonl"));
        std::string line;
        for (int64_t n = 1; std::getline(lines, line); ++n) {
          const io::JsonValue v = io::parse_json(line);
          if (!v.is_string())
            throw std::invalid_argument("--texts-jsonl " + texts_jsonl + " line " + std::to_string(n) + " is not a JSON string");
          texts.push_back(v.as_string());
        }
      } else {
        texts.push_back(text_file.empty() ? rest[0] : io::read_file(text_file, io::kWholeDataFileBytes, "--text-file"));
      }
    } catch (const std::invalid_argument& e) {
      throw UsageError(e.what());
    }
    for (const std::string& text : texts) {
      std::vector<int32_t> ids;
      try {
        ids = tok.encode(text, add_special);
      } catch (const std::invalid_argument& e) {
        throw UsageError(e.what());
      }
      if (json || !texts_jsonl.empty()) {
        io::JsonWriter w(std::cout, 0);
        w.begin_object().key("ids").begin_array();
        for (int32_t id : ids) w.value(static_cast<int64_t>(id));
        w.end_array().key("decoded").value(tok.decode(ids)).end_object();
        std::cout << "\n";
        continue;
      }
      for (size_t i = 0; i < ids.size(); ++i) std::cout << (i ? " " : "") << ids[i];
      std::cout << "\n" << tok.decode(ids) << "\n";
    }
    return 0;
  }
  if (action == "examples") {
    std::string model, format = "messages", templ;
    std::vector<std::string> files;
    bool train_on_prompt = false, skip_bad = false;
    Args args("tokenizer examples", "Show the tokens and loss flags of instruction or chat examples.");
    args.add_positional("TOKENIZER", &model, "a .model file, a tokenizer.json or a model folder");
    args.add_string("format", &format, "alpaca, prompt_completion or messages (default messages)", "FORMAT");
    args.add_string("template", &templ,
                    "plain, alpaca, llama2, llama3 or chatml (default: the format's; for messages, "
                    "the tokenizer folder's chat_template)",
                    "NAME");
    args.add_flag("train-on-prompt", &train_on_prompt, "every token has loss, not only the answers");
    args.add_flag("skip-bad", &skip_bad, "skip bad examples (counted) instead of stopping at the first");
    args.add_rest(&files, "FILE");
    if (!args.parse(argc, argv, 3)) return 0;
    if (files.empty()) throw UsageError("tokenizer examples needs at least one FILE (JSON Lines) or folder");
    data::ExampleOptions opt;
    const auto f = data::parse_example_format(format);
    if (!f) throw UsageError("--format '" + format + "' is not one of alpaca, prompt_completion, messages");
    opt.format = *f;
    if (!templ.empty()) {
      opt.chat_template = data::parse_chat_template(templ);
      if (!opt.chat_template) throw UsageError("--template '" + templ + "' is not one of plain, alpaca, llama2, llama3, chatml");
    }
    opt.train_on_prompt = train_on_prompt;
    opt.skip_bad = skip_bad;
    data::ExampleStats stats;
    try {
      const data::Tokenizer tok = data::Tokenizer::load(model);
      stats = data::encode_examples(files, tok, opt, [](const std::string& file, int64_t line, const data::EncodedExample& e) {
        io::JsonWriter w(std::cout, 0);
        w.begin_object().key("file").value(file).key("line").value(line).key("text").value(e.text);
        w.key("ids").begin_array();
        for (int32_t id : e.ids) w.value(static_cast<int64_t>(id));
        w.end_array().key("loss").begin_array();
        for (uint8_t l : e.loss) w.value(static_cast<int64_t>(l));
        w.end_array().end_object();
        std::cout << "\n";
      });
    } catch (const std::invalid_argument& e) {
      throw UsageError(e.what());
    }
    std::cerr << stats.examples << " examples, " << stats.tokens << " tokens (" << stats.label_tokens << " with loss), " << stats.skipped
              << " skipped\n";
    for (const auto& why : stats.skipped_reasons) std::cerr << "  skipped: " << why << "\n";
    return 0;
  }
  throw UsageError("unknown tokenizer action '" + action + "' (allowed: train, encode, examples)");
}

}  // namespace cli
}  // namespace frugal
