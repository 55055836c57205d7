// frugal — train neural networks in less memory. The command line (main.cpp calls it): dispatches to
// the subcommands and turns errors into exit codes (2: the user's mistake, one line: UsageError from the command line,
// std::invalid_argument from below it; 1: a failure while working).
#include <c10/util/Exception.h>
#include <torch/version.h>

#include <algorithm>
#include <cstdlib>
#include <cstring>
#include <iostream>
#include <stdexcept>
#include <string>

#include "args.h"
#include "commands.h"
#include "frugal/memory/cuda_runtime.h"
#include "frugal/memory/process.h"
#include "frugal/bench/hardware.h"
#include "frugal/dist/launch.h"
#include "frugal/io/atomic_file.h"
#include "frugal/io/files.h"
#include "frugal/io/units.h"
#include "build_info.h"  // FRUGAL_*: this build's facts (CMakeLists.txt)

namespace {

const char* kUsage =
    "usage: frugal COMMAND [flags]\n"
    "\n"
    "Train neural networks in less memory: see where every byte goes, then cut it.\n"
    "\n"
    "commands:\n"
    "  train     train or fine-tune a Llama-style language model from a YAML recipe (frugal train default)\n"
    "  generate  continue a prompt (text or token ids) with a checkpoint: greedy, top-k, top-p\n"
    "  eval      a checkpoint's mean loss and perplexity on held-out text or tokens\n"
    "  tokenizer train a SentencePiece tokenizer on a corpus, or encode text with one\n"
    "  account   measure parameter, gradient, optimizer and activation memory of a Transformer stack,\n"
    "            with and without activation checkpointing\n"
    "  report    turn allocation traces into an HTML page (several side by side), or a snapshot for\n"
    "            PyTorch's memory viewer\n"
    "  bench     run a benchmark and print its ratios against the plain version (frugal bench --help)\n"
    "\n"
    "'frugal COMMAND --help' describes a command's flags; 'frugal --version' prints the versions.\n";

// A LibTorch error in our words where we know what it means: the CPU allocator's refusal
// ("[enforce fail at alloc_cpu.cpp:75] ... you tried to allocate N bytes. Error code 12 ...") is
// this machine running out of memory for the sizes asked for.
std::string describe(const c10::Error& e) {
  const std::string what = e.what_without_backtrace();
  const std::string tried = "you tried to allocate ";
  const auto at = what.find(tried);
  if (what.find("can't allocate memory") != std::string::npos && at != std::string::npos) {
    const long long bytes = std::strtoll(what.c_str() + at + tried.size(), nullptr, 10);
    return "out of memory: allocating " + frugal::io::human_bytes(bytes) +
           " failed (the sizes asked for need more memory than this machine can give)";
  }
  return what;
}

// The last guard of "no raw file bytes on the terminal" (messages quote file content through
// io::printable): a control byte left in a message (a NUL, an escape sequence, a line break) is
// written as \xNN, so an error is one line of text.
std::string one_line(const std::string& what) {
  static const char hex[] = "0123456789abcdef";
  std::string out;
  for (const char ch : what) {
    const auto c = static_cast<unsigned char>(ch);
    if (c < 0x20 || c == 0x7f) {
      out += "\\x";
      out += hex[c >> 4];
      out += hex[c & 15];
    } else {
      out += ch;
    }
  }
  return out;
}

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

int run(int argc, char** argv) {
  if (argc < 2) {
    std::cerr << "frugal: a command is needed (account, bench, train, generate, eval, tokenizer, report); 'frugal --help' lists them\n";
    return 2;
  }
  if (!std::strcmp(argv[1], "--help") || !std::strcmp(argv[1], "-h")) {
    std::cout << kUsage;
    return 0;
  }
  if (!std::strcmp(argv[1], "--version")) {
    std::cout << "frugal " << FRUGAL_VERSION << " (" << (*FRUGAL_BUILD_TYPE ? FRUGAL_BUILD_TYPE : "no build type") << " build), LibTorch "
              << TORCH_VERSION << "\n";
    return 0;
  }
  const std::string command = argv[1];
  try {
    // FRUGAL_NUM_THREADS is read deep in a run (the threads of bf16 products, a rank's share): a
    // bad value is refused here, before any command does work.
    dist::launcher_threads();
    // LibTorch's CUDA half and frugal's CUDA module, before anything could make a CUDA tensor: only
    // where an NVIDIA driver is installed (memory/cuda_runtime.h), so a CPU machine does not carry
    // the CUDA libraries' ~250 MiB (a bad FRUGAL_CUDA is refused here).
    memory::load_cuda();
    // A training step frees and takes back the same bytes every step: glibc keeps them mapped
    // rather than refaulting them (memory/process.h; the environment's own MALLOC_* settings win).
    memory::keep_freed_heap();
    if (command == "account") return run_account(argc, argv);
    if (command == "bench") return run_bench(argc, argv);
    if (command == "train") return run_train(argc, argv);
    if (command == "generate") return run_generate(argc, argv);
    if (command == "eval") return run_eval(argc, argv);
    if (command == "tokenizer") return run_tokenizer(argc, argv);
    if (command == "report") return run_report(argc, argv);
    throw UsageError("unknown command '" + command + "' (allowed: account, bench, train, generate, eval, tokenizer, report)");
  } catch (const UsageError& e) {
    std::cerr << "frugal: " << one_line(e.what()) << "\n";
    return 2;
  } catch (const std::invalid_argument& e) {
    // The input's fault, found below the command line: a recipe check that fired after loading
    // (RecipeError), a file that is not what it must be (a token file, a tokenizer, a checkpoint),
    // a value the data cannot serve. The library's messages name the file or value.
    std::cerr << "frugal " << command << ": " << one_line(e.what()) << "\n";
    return 2;
  } catch (const c10::Error& e) {
    std::cerr << "frugal " << command << ": error: " << one_line(describe(e)) << "\n";
    return 1;
  } catch (const std::exception& e) {
    std::cerr << "frugal " << command << ": error: " << one_line(e.what()) << "\n";
    return 1;
  }
}

}  // namespace cli
}  // namespace frugal
