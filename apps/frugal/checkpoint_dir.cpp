// Finding a checkpoint for generate and eval: a Hugging Face folder, a frugal step-N folder, or a
// run folder whose latest checkpoint is used; and the tokenizer that came with it.
#include <sys/stat.h>

#include <algorithm>

#include "args.h"
#include "commands.h"
#include "frugal/io/files.h"
#include "frugal/train/run_state.h"

namespace frugal {
namespace cli {

std::string resolve_checkpoint_dir(const std::string& dir) {
  if (dir.empty()) throw UsageError("--checkpoint is required");
  struct stat st {};
  if (::stat(dir.c_str(), &st) != 0 || !S_ISDIR(st.st_mode)) throw UsageError("--checkpoint " + dir + " is not a folder");
  if (io::path_exists(dir + "/config.json")) return dir;
  std::string step_dir;
  try {
    step_dir = train::latest_checkpoint(dir);
  } catch (const std::invalid_argument& e) {
    throw UsageError(std::string("--checkpoint: ") + e.what());
  }
  if (step_dir.empty()) throw UsageError("--checkpoint " + dir + " holds no checkpoint (no config.json and no 'latest')");
  return step_dir;
}

// The one place that decides which tokenizer a checkpoint folder uses: tokenizer.json or
// tokenizer.model with tokenizer_config.json (data::Tokenizer::load_folder); none when it has neither.
std::optional<data::Tokenizer> load_checkpoint_tokenizer(const std::string& dir) {
  if (!data::Tokenizer::folder_has_tokenizer(dir)) return std::nullopt;
  return data::Tokenizer::load_folder(dir);
}

at::TensorOptions weights_dtype_option(const std::string& value, bool allow_auto) {
  if (value == "fp32") return at::TensorOptions().dtype(at::kFloat);
  if (value == "bf16") return at::TensorOptions().dtype(at::kBFloat16);
  if (allow_auto && value == "auto") return at::TensorOptions();  // load_hf_checkpoint takes the file's dtype
  throw UsageError("--dtype must be " + std::string(allow_auto ? "auto, fp32 or bf16" : "fp32 or bf16") + ", not '" + value + "'");
}

std::vector<int32_t> parse_ids(const std::string& text, const std::string& what) {
  std::vector<int32_t> ids;
  size_t i = 0;
  auto separator = [](char c) { return c == ',' || c == ' ' || c == '\t' || c == '\n' || c == '\r'; };
  while (i < text.size() && separator(text[i])) ++i;
  const bool bracketed = i < text.size() && text[i] == '[';
  if (bracketed) ++i;
  while (i < text.size()) {
    if (separator(text[i])) {
      ++i;
      continue;
    }
    if (bracketed && text[i] == ']') {
      ++i;
      while (i < text.size() && separator(text[i])) ++i;
      if (i != text.size()) throw UsageError(what + ": text after the closing ']'");
      return ids;
    }
    size_t end = i;
    while (end < text.size() && text[end] >= '0' && text[end] <= '9') ++end;
    if (end == i || end - i > 9) {
      throw UsageError(what + ": '" + io::printable(text.substr(i, std::min<size_t>(20, text.size() - i))) +
                       "' is not a token id (ids are non-negative integers separated by commas or spaces)");
    }
    ids.push_back(static_cast<int32_t>(std::stol(text.substr(i, end - i))));
    i = end;
  }
  if (bracketed) throw UsageError(what + ": the list has no closing ']'");
  return ids;
}

}  // namespace cli
}  // namespace frugal
