// apps/frugal/args.h — the CLI's flag parser: typed flags, defaults, help text, one-line errors.
//
//   Args args("account", "Measure where training memory goes");
//   int64_t layers = 6;  args.add_int("layers", &layers, "number of blocks", 1, 4096);
//   if (!args.parse(argc, argv, 2)) return 0;     // --help printed
#pragma once

#include <c10/core/Device.h>

#include <cstdint>
#include <functional>
#include <stdexcept>
#include <string>
#include <utility>
#include <vector>

#include "frugal/models/activation_bytes.h"

namespace frugal {
namespace cli {

// A user mistake on the command line: printed as one line, exit code 2.
struct UsageError : std::runtime_error {
  using std::runtime_error::runtime_error;
};

// Bounds the commands share. Counts of things (steps, runs, rounds of a benchmark) stop far past
// any real job and early enough that sums and doubles of them cannot wrap.
constexpr int64_t kMaxBytes = models::kMaxSizeBytes;  // 2^56 (64 PiB): the bound of every size frugal computes
constexpr int64_t kMaxSteps = int64_t{1} << 40;       // the recipe's train.steps bound
constexpr int64_t kMaxRanks = 4096;                   // dist/: WORLD_SIZE's bound
constexpr int64_t kMaxSeed = INT64_MAX;
constexpr int64_t kMaxRuns = 1000000;         // timed runs of a benchmark
constexpr double kMaxTimeoutSeconds = 86400;  // a day

class Args {
 public:
  Args(std::string command, std::string summary);

  // Numeric flags are parsed strictly (io/numbers.h: the whole value one decimal number, no
  // overflow, finite) and must lie in [min_value, max_value]; the help states the range and the
  // metavar says what the number is (N, X, SECONDS, BYTES: tests/hostile/numbers_test.sh finds
  // every numeric flag by these). Refusals: "--NAME must be an integer from MIN to MAX, not 'TEXT'".
  // An integer flag --name N.
  void add_int(const std::string& name, int64_t* target, const std::string& help, int64_t min_value, int64_t max_value,
               const std::string& metavar = "N");
  void add_string(const std::string& name, std::string* target, const std::string& help, const std::string& metavar = "VALUE");
  // A file the command writes (add_string, then check_output_path on the value while parsing).
  void add_output(const std::string& name, std::string* target, const std::string& help, const std::string& metavar = "FILE");
  // A byte count: 123, 64MiB, 1.5GiB, 20M, 512K, from min_value to max_value (default 2^56, 64 PiB,
  // the largest size models/ computes). Unset flags keep *target at -1 (help shows no default).
  void add_bytes(const std::string& name, int64_t* target, const std::string& help, int64_t min_value, int64_t max_value = kMaxBytes);
  // A device flag: "cpu", "cuda", "cuda:N".
  void add_device(const std::string& name, c10::Device* target, const std::string& help);
  void add_flag(const std::string& name, bool* target, const std::string& help);
  // A real-valued flag --name X.
  void add_double(const std::string& name, double* target, const std::string& help, double min_value, double max_value,
                  const std::string& metavar = "X");
  // Arguments after the positionals that are not flags (e.g. key=value overrides).
  void add_rest(std::vector<std::string>* target, const std::string& metavar);
  // Positional arguments, in order (all required).
  void add_positional(const std::string& name, std::string* target, const std::string& help);
  // A one-letter alias of a flag added before: add_short('o', "out") makes -o FILE mean --out FILE.
  void add_short(char letter, const std::string& name);

  // Parses argv[first..argc). Returns false when --help was asked for (the help is printed).
  // Throws UsageError on an unknown flag, a missing or bad value, or a missing positional.
  bool parse(int argc, char** argv, int first);
  std::string help() const;

 private:
  struct Flag {
    std::string name, help, metavar, default_text, range_text;
    bool takes_value;
    std::function<void(const std::string&)> set;
  };
  std::string command_, summary_;
  std::vector<Flag> flags_;
  std::vector<Flag> positionals_;
  std::vector<std::pair<std::string, std::string>> shorts_;  // ("-o", "out")
  std::vector<std::string>* rest_ = nullptr;
  std::string rest_metavar_;
};

// Refuses, before any work, an output path the command could not write at its end: a folder, a
// name ending in '/', or one whose parent is not a folder and cannot be made. "-" (stdout) passes.
void check_output_path(const std::string& flag, const std::string& path);

// The shape flags of a Transformer stack (--layers --width --heads --batch --seq --device), for any
// config with those fields.
template <typename StackConfig>
void add_stack_flags(Args& args, StackConfig& c) {
  // The recipe's bounds (train/recipe.cpp); their products are checked by bench::validate.
  args.add_int("layers", &c.layers, "number of Transformer blocks", 1, 4096);
  args.add_int("width", &c.width, "model width d_model (divisible by --heads)", 1, (int64_t{1} << 31) - 1);
  args.add_int("heads", &c.heads, "attention heads", 1, (int64_t{1} << 31) - 1);
  args.add_int("batch", &c.batch, "batch size B", 1, int64_t{1} << 24);
  args.add_int("seq", &c.seq, "sequence length T", 1, int64_t{1} << 24);
  args.add_device("device", &c.device, "where the model and activations live");
}

// Refuses a stack whose sizes, each within its flag's range, multiply past kMaxBytes: its weights
// with their gradients and AdamW state (16 bytes a parameter), or the activations one forward
// keeps (about 20 values per token and width, plus the attention's heads x seq per token),
// counted in doubles so the check itself cannot wrap.
template <typename StackConfig>
void check_stack_size(const StackConfig& c) {
  const double L = static_cast<double>(c.layers), d = static_cast<double>(c.width), H = static_cast<double>(c.heads);
  const double B = static_cast<double>(c.batch), T = static_cast<double>(c.seq);
  const double params = 16 * L * 12 * d * d, activations = 4 * L * B * T * (20 * d + 2 * H * T);
  if (params > static_cast<double>(kMaxBytes) || activations > static_cast<double>(kMaxBytes)) {
    throw UsageError("--layers " + std::to_string(c.layers) + " --width " + std::to_string(c.width) + " --heads " +
                     std::to_string(c.heads) + " --batch " + std::to_string(c.batch) + " --seq " + std::to_string(c.seq) +
                     " would need more than 2^56 bytes (64 PiB) for the " + (params > activations ? "parameters" : "activations") +
                     ", past the sizes frugal computes");
  }
}

}  // namespace cli
}  // namespace frugal
