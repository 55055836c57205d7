// apps/frugal/commands.h — one entry point per subcommand; each returns the process exit code.
#pragma once

#include <c10/core/TensorOptions.h>

#include <cstdint>
#include <optional>
#include <string>
#include <vector>

#include "frugal/data/tokenizer.h"

namespace frugal {
namespace train {
struct Recipe;
}
namespace cli {

// The whole command line: `frugal COMMAND ...` (argv[0] = "frugal"); main() is this call.
int run(int argc, char** argv);

int run_account(int argc, char** argv);  // argv[0] = "frugal", argv[1] = "account"
int run_bench(int argc, char** argv);    // argv[1] = "bench", argv[2] = NAME
int run_train(int argc, char** argv);
int run_generate(int argc, char** argv);
int run_eval(int argc, char** argv);
int run_tokenizer(int argc, char** argv);
int run_report(int argc, char** argv);

// The benchmarks, one file each (bench_NAME.cpp); flags start at argv[3].
int bench_checkpoint(int argc, char** argv);
int bench_chunked_loss(int argc, char** argv);
int bench_optim_in_backward(int argc, char** argv);
int bench_train(int argc, char** argv);
int bench_optim_state(int argc, char** argv);
int bench_data_parallel(int argc, char** argv);
int bench_packing(int argc, char** argv);

// Prints one line when matrix products run at reference-BLAS speed (call once the arguments are
// known to be good, before the work).
void warn_if_slow_blas();

// A recipe path, or a shipped recipe's name (recipes/NAME.yaml here or in the source tree); UsageError otherwise.
std::string resolve_recipe(const std::string& arg);
// Refuses, before any work, what a recipe names that this machine cannot provide: a CUDA device
// it lacks, a model.init_from that is not a folder, train.out_dir or data files that are not what
// they must be, and (with data) a data.corpus that is missing when the tokenizer or tokens must be made.
void check_recipe_inputs(const train::Recipe& recipe, bool data);

// --checkpoint DIR as generate and eval take it: a folder with config.json (Hugging Face or a frugal
// step-N folder) as it is, or a run folder's latest checkpoint. UsageError when it is neither.
std::string resolve_checkpoint_dir(const std::string& dir);
// The checkpoint folder's tokenizer (tokenizer.json, or tokenizer.model, with tokenizer_config.json),
// or none when the folder has none.
std::optional<data::Tokenizer> load_checkpoint_tokenizer(const std::string& dir);
// --dtype as generate and eval take it: "fp32" or "bf16" for the weights and their products, and
// (when allow_auto) "auto": the checkpoint's own dtype (config.json's torch_dtype), as
// transformers 5's from_pretrained loads by default. UsageError for anything else.
at::TensorOptions weights_dtype_option(const std::string& value, bool allow_auto);

// Token ids written as "1,2,3", "1 2 3" or a JSON list "[1, 2, 3]". UsageError naming `what`.
std::vector<int32_t> parse_ids(const std::string& text, const std::string& what);

// The median of the values (0 for none).
double median(std::vector<double> values);

// Writes text to path atomically, or to stdout when path is "-".
void write_output(const std::string& path, const std::string& text);

}  // namespace cli
}  // namespace frugal
