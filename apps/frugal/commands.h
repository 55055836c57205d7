// apps/frugal/commands.h — one entry point per subcommand; each returns the process exit code.
#pragma once

#include <string>

namespace frugal {
namespace cli {

int run_account(int argc, char** argv);  // argv[0] = "frugal", argv[1] = "account"
int run_bench(int argc, char** argv);    // argv[1] = "bench", argv[2] = NAME

// Writes text to path atomically, or to stdout when path is "-".
void write_output(const std::string& path, const std::string& text);

}  // namespace cli
}  // namespace frugal
