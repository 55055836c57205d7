// apps/frugal/commands.h — one entry point per subcommand; each returns the process exit code.
#pragma once

#include <string>

namespace frugal {
namespace cli {

int run_account(int argc, char** argv);  // argv[0] = "frugal", argv[1] = "account"
int run_bench(int argc, char** argv);    // argv[1] = "bench", argv[2] = NAME
int run_train(int argc, char** argv);
int run_generate(int argc, char** argv);
int run_tokenizer(int argc, char** argv);
int run_report(int argc, char** argv);

// The benchmarks, one file each (bench_NAME.cpp); flags start at argv[3].
int bench_checkpoint(int argc, char** argv);
int bench_chunked_loss(int argc, char** argv);
int bench_optim_in_backward(int argc, char** argv);
int bench_train(int argc, char** argv);
int bench_optim_state(int argc, char** argv);

// Prints one line when matrix products run at reference-BLAS speed (call once the arguments are
// known to be good, before the work).
void warn_if_slow_blas();

// Writes text to path atomically, or to stdout when path is "-".
void write_output(const std::string& path, const std::string& text);

}  // namespace cli
}  // namespace frugal
