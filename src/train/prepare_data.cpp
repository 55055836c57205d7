// prepare_data: the run's tokenizer and token file, or its examples files, made when missing or
// made from other sources, another tokenizer or other options (trainer.h).
#include <sys/stat.h>

#include <string>
#include <vector>

#include "frugal/data/corpus.h"
#include "frugal/io/atomic_file.h"
#include "frugal/io/files.h"
#include "frugal/train/trainer.h"

namespace frugal {
namespace train {

namespace {

// What decides an examples file's contents besides the tokenizer and the options: each source's
// path, size and modification time (an edited file is tokenized again).
std::string sources_stamp(const std::vector<std::string>& paths) {
  std::string out;
  for (const std::string& path : paths) {
    struct stat st {};
    if (::stat(path.c_str(), &st) != 0) throw RecipeError("data: " + path + " does not exist");
    out += path + " " + std::to_string(st.st_size) + " " + std::to_string(static_cast<int64_t>(st.st_mtim.tv_sec)) + "." +
           std::to_string(static_cast<int64_t>(st.st_mtim.tv_nsec)) + "\n";
  }
  return out;
}

// Tokenizes the examples at `sources` into `path` unless it is current (its stamp file says it was
// made from the same sources with the same tokenizer and options).
data::ExampleStats make_examples(const std::vector<std::string>& sources, const data::Tokenizer& tok, const data::ExampleOptions& options,
                                 const std::string& path, const std::string& key, const LogFn& log) {
  const std::string stamp_path = path + ".stamp";
  const std::string stamp = data::examples_fingerprint(tok, options) + "\n" + sources_stamp(sources);
  if (io::path_exists(path) && io::path_exists(stamp_path) && io::read_file(stamp_path, io::kMetadataFileBytes) == stamp) return {};
  io::make_directories(io::parent_path(path));
  data::ExampleStats made;
  try {
    made = data::tokenize_examples(sources, tok, options, path);
  } catch (const std::invalid_argument& e) {
    throw RecipeError(key + ": " + e.what());
  }
  io::write_file_atomic(stamp_path, stamp);
  std::string line = "tokenized " + std::to_string(made.examples) + " examples (" + std::to_string(made.tokens) + " tokens, " +
                     std::to_string(made.label_tokens) + " with loss) from " + key + " into " + path;
  if (made.skipped > 0) {
    line += "; skipped " + std::to_string(made.skipped) + " bad ones";
    if (!made.skipped_reasons.empty()) line += " (first: " + made.skipped_reasons.front() + ")";
  }
  log(line);
  return made;
}

}  // namespace

PreparedData prepare_data(const Recipe& r, const LogFn& log) {
  PreparedData p;
  p.tokenizer_path = r.tokenizer;
  p.tokens_path = r.tokens;
  std::vector<std::string> docs;
  auto corpus = [&]() -> const std::vector<std::string>& {
    if (docs.empty()) {
      if (r.corpus.empty()) throw RecipeError("data.corpus is needed to make " + r.tokenizer + " or " + r.tokens);
      docs = data::read_corpus(r.corpus);
      log("read " + std::to_string(docs.size()) + " documents from " + r.corpus);
    }
    return docs;
  };
  if (p.tokenizer_path.empty()) throw RecipeError("data.tokenizer must be set");
  // Said once the data is ready: a refused input is the only line a bad run prints.
  bool from_model = false;
  auto say_tokenizer = [&] {
    if (from_model) log("using the tokenizer of " + r.init_from);
  };
  // A model fine-tuned from a folder reads its ids with that folder's tokenizer: a new one would
  // give its embeddings other meanings.
  if (!r.init_from.empty() && !r.train_tokenizer && data::Tokenizer::folder_has_tokenizer(r.init_from)) {
    p.tokenizer_path = r.init_from;
    from_model = true;
  }
  if (!io::path_exists(p.tokenizer_path) && !r.text_data()) {
    throw RecipeError("data.tokenizer " + p.tokenizer_path +
                      " does not exist: examples are tokenized with the model's tokenizer "
                      "(model.init_from's, or data.tokenizer); frugal trains tokenizers on text corpora only (frugal tokenizer train)");
  }
  if (!io::path_exists(p.tokenizer_path)) {
    const std::string suffix = ".model";
    if (p.tokenizer_path.size() <= suffix.size() ||
        p.tokenizer_path.compare(p.tokenizer_path.size() - suffix.size(), suffix.size(), suffix) != 0) {
      throw RecipeError("data.tokenizer " + p.tokenizer_path + " does not exist (and must end in .model to be trained)");
    }
    if (!r.init_from.empty() && !r.train_tokenizer) {
      throw RecipeError("model.init_from " + r.init_from + " has no tokenizer (tokenizer.json or tokenizer.model) and data.tokenizer " +
                        p.tokenizer_path +
                        " does not exist: give the model's tokenizer as data.tokenizer, or set "
                        "data.train_tokenizer: true to train a new one (the model's ids then mean other text)");
    }
    const int64_t vocab = r.model.vocab_size > 0 ? r.model.vocab_size : 4096;
    log("training a " + std::to_string(vocab) + "-piece tokenizer into " + p.tokenizer_path);
    io::make_directories(io::parent_path(p.tokenizer_path));
    // Trained under a temporary name and renamed, so a concurrent run never reads half a file.
    const std::string prefix = p.tokenizer_path.substr(0, p.tokenizer_path.size() - suffix.size());
    const std::string tmp_prefix = prefix + ".tmp-" + std::to_string(::getpid());
    data::train_tokenizer(corpus(), tmp_prefix, data::TokenizerTrainOptions().vocab_size(vocab));
    std::rename((tmp_prefix + ".vocab").c_str(), (prefix + ".vocab").c_str());
    if (std::rename((tmp_prefix + ".model").c_str(), p.tokenizer_path.c_str()) != 0) {
      throw std::runtime_error("cannot move the trained tokenizer to " + p.tokenizer_path);
    }
  }
  data::Tokenizer tok;
  try {
    tok = data::Tokenizer::load(p.tokenizer_path);
  } catch (const std::invalid_argument& e) {
    throw RecipeError(e.what());
  }
  p.vocab_size = tok.vocab_size();
  if (!r.init_from.empty()) {
    // The model's vocabulary is the file's; a smaller tokenizer leaves rows unused (padded vocabularies).
    if (p.vocab_size > r.model.vocab_size) {
      throw RecipeError("the tokenizer " + p.tokenizer_path + " has " + std::to_string(p.vocab_size) +
                        " pieces, more than the vocab_size " + std::to_string(r.model.vocab_size) + " of model.init_from " + r.init_from +
                        " (its last tokens would have no embedding)");
    }
  } else if (r.model.vocab_size > 0 && r.model.vocab_size != p.vocab_size) {
    throw RecipeError("model.vocab_size " + std::to_string(r.model.vocab_size) + " differs from the tokenizer's " +
                      std::to_string(p.vocab_size) + " (set model.vocab_size=0 to take the tokenizer's)");
  }
  if (!r.text_data()) {
    const std::vector<std::string> sources = r.corpus_paths();
    if (sources.empty()) throw RecipeError("data.corpus must name the JSON Lines examples");
    data::ExampleOptions options = r.example_options();
    try {
      // auto: the format's own; for messages the model's chat_template, when it is one frugal has built in.
      options.chat_template = data::resolve_chat_template(tok, options);
    } catch (const std::invalid_argument& e) {
      throw RecipeError(std::string("data.template: ") + e.what());
    }
    p.chat_template = options.chat_template;
    std::vector<std::string> made;
    auto remember = [&made](const std::string& line) { made.push_back(line); };
    p.made = make_examples(sources, tok, options, p.tokens_path, "data.corpus", remember);
    if (!r.validation.empty()) {
      p.val_examples_path = p.tokens_path + ".val";
      p.val_made = make_examples(r.validation_paths(), tok, options, p.val_examples_path, "data.validation", remember);
    }
    say_tokenizer();
    for (const std::string& line : made) log(line);
    return p;
  }
  // The token file records the tokenizer it was made with (<tokens>.tokenizer holds its fingerprint):
  // a file made with another tokenizer, even one of the same size, is remade.
  const std::string stamp_path = p.tokens_path + ".tokenizer";
  const std::string stamp = tok.fingerprint() + "\n";
  bool fresh = !io::path_exists(p.tokens_path);
  if (!fresh) {
    data::TokenFile f(p.tokens_path);
    fresh = f.vocab_size() != p.vocab_size || !io::path_exists(stamp_path) || io::read_file(stamp_path, io::kMetadataFileBytes) != stamp;
    if (fresh) log(p.tokens_path + " was made with another tokenizer: remaking it");
  }
  if (fresh) {
    if (r.corpus.empty()) throw RecipeError("data.corpus is needed to make " + r.tokens);
    std::vector<std::string>().swap(docs);  // the tokenizer's training copy; tokenizing streams the corpus
    io::make_directories(io::parent_path(p.tokens_path));
    const data::CorpusTokens made = data::tokenize_corpus(r.corpus, tok, p.tokens_path);
    io::write_file_atomic(stamp_path, stamp);
    log("tokenized " + std::to_string(made.documents) + (made.documents == 1 ? " document" : " documents") + " from " + r.corpus +
        " into " + std::to_string(made.tokens) + " tokens: " + p.tokens_path);
  }
  say_tokenizer();
  return p;
}

}  // namespace train
}  // namespace frugal
