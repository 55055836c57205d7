// frugal — train neural networks in less memory. Entry point: dispatches to the subcommands and
// turns errors into exit codes (2: the user's mistake, one line; 1: a failure while working).
#include <c10/util/Exception.h>
#include <torch/version.h>

#include <algorithm>
#include <cstring>
#include <iostream>
#include <string>

#include "args.h"
#include "commands.h"
#include "frugal/bench/hardware.h"
#include "frugal/io/atomic_file.h"
#include "frugal/io/files.h"
#include "frugal/train/recipe.h"

namespace {

const char* kUsage =
    "usage: frugal COMMAND [flags]\n"
    "\n"
    "Train neural networks in less memory: see where every byte goes, then cut it.\n"
    "\n"
    "commands:\n"
    "  train     train or fine-tune a Llama-style language model from a YAML recipe (frugal train default)\n"
    "  generate  sample text from a trained checkpoint\n"
    "  tokenizer train a SentencePiece tokenizer on a corpus, or encode text with one\n"
    "  account   measure parameter, gradient, optimizer and activation memory of a Transformer stack,\n"
    "            with and without activation checkpointing\n"
    "  report    turn allocation traces into an HTML page (several side by side), or a snapshot for\n"
    "            PyTorch's memory viewer\n"
    "  bench     run a benchmark and print its ratios against the plain version (frugal bench --help)\n"
    "\n"
    "'frugal COMMAND --help' describes a command's flags; 'frugal --version' prints the versions.\n";

}  // namespace

namespace frugal {
namespace cli {

void warn_if_slow_blas() {
  const std::string warning = bench::slow_blas_warning(bench::loaded_blas_library());
  if (!warning.empty()) std::cerr << "frugal: " << warning << "\n";
}

void write_output(const std::string& path, const std::string& text) {
  if (path == "-") {
    std::cout << text;
  } else {
    const std::string parent = io::parent_path(path);  // check_output_path found it can be made
    if (!parent.empty()) io::make_directories(parent);
    io::write_file_atomic(path, text);
  }
}

}  // namespace cli
}  // namespace frugal

int main(int argc, char** argv) {
  using namespace frugal;
  if (argc < 2) {
    std::cerr << "frugal: a command is needed (account, bench, train, generate, tokenizer, report); 'frugal --help' lists them\n";
    return 2;
  }
  if (!std::strcmp(argv[1], "--help") || !std::strcmp(argv[1], "-h")) {
    std::cout << kUsage;
    return 0;
  }
  if (!std::strcmp(argv[1], "--version")) {
    std::cout << "frugal " << FRUGAL_VERSION << " (" << (*FRUGAL_BUILD_TYPE ? FRUGAL_BUILD_TYPE : "no build type")
              << " build), LibTorch " << TORCH_VERSION << "\n";
    return 0;
  }
  const std::string command = argv[1];
  try {
    if (command == "account") return cli::run_account(argc, argv);
    if (command == "bench") return cli::run_bench(argc, argv);
    if (command == "train") return cli::run_train(argc, argv);
    if (command == "generate") return cli::run_generate(argc, argv);
    if (command == "tokenizer") return cli::run_tokenizer(argc, argv);
    if (command == "report") return cli::run_report(argc, argv);
    throw cli::UsageError("unknown command '" + command + "' (allowed: account, bench, train, generate, tokenizer, report)");
  } catch (const cli::UsageError& e) {
    std::cerr << "frugal: " << e.what() << "\n";
    return 2;
  } catch (const train::RecipeError& e) {  // a recipe check that fired after loading (the tokenizer's vocabulary)
    std::cerr << "frugal " << command << ": " << e.what() << "\n";
    return 2;
  } catch (const c10::Error& e) {
    std::cerr << "frugal " << command << ": error: " << e.what_without_backtrace() << "\n";
    return 1;
  } catch (const std::exception& e) {
    std::cerr << "frugal " << command << ": error: " << e.what() << "\n";
    return 1;
  }
}
