// frugal tokenizer — train a SentencePiece tokenizer on a corpus, or encode text with one.
#include <iostream>

#include "args.h"
#include "commands.h"
#include "frugal/data/corpus.h"
#include "frugal/data/tokenizer.h"

namespace frugal {
namespace cli {
namespace {

const char* kUsage =
    "usage: frugal tokenizer train CORPUS --out PREFIX [--vocab-size N] [--model-type bpe|unigram]\n"
    "       frugal tokenizer encode MODEL TEXT\n"
    "\n"
    "train: a SentencePiece model (Llama's tokenizer.model format) on a text file or folder; writes\n"
    "       PREFIX.model and PREFIX.vocab.\n"
    "encode: print the ids of TEXT, then the text decoded back.\n";

}  // namespace

int run_tokenizer(int argc, char** argv) {
  if (argc < 3) throw UsageError("tokenizer needs an action (train or encode); 'frugal tokenizer --help' describes them");
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
    args.add_int("vocab-size", &vocab, "number of pieces (at least 300 with byte fallback)", 16);
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
    std::string model, text;
    Args args("tokenizer encode", "Encode text with a SentencePiece model and decode it back.");
    args.add_positional("MODEL", &model, "a .model file");
    args.add_positional("TEXT", &text, "the text");
    if (!args.parse(argc, argv, 3)) return 0;
    data::Tokenizer tok;
    try {
      tok = data::Tokenizer::load(model);
    } catch (const std::invalid_argument& e) {
      throw UsageError(e.what());
    }
    const auto ids = tok.encode(text);
    for (size_t i = 0; i < ids.size(); ++i) std::cout << (i ? " " : "") << ids[i];
    std::cout << "\n" << tok.decode(ids) << "\n";
    return 0;
  }
  throw UsageError("unknown tokenizer action '" + action + "' (allowed: train, encode)");
}

}  // namespace cli
}  // namespace frugal
