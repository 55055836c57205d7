// apps/frugal/args.h — the CLI's flag parser: typed flags, defaults, help text, one-line errors.
//
//   Args args("account", "Measure where training memory goes");
//   int64_t layers = 6;  args.add_int("layers", &layers, "number of blocks", 1);
//   if (!args.parse(argc, argv, 2)) return 0;     // --help printed
#pragma once

#include <c10/core/Device.h>

#include <cstdint>
#include <functional>
#include <stdexcept>
#include <string>
#include <utility>
#include <vector>

namespace frugal {
namespace cli {

// A user mistake on the command line: printed as one line, exit code 2.
struct UsageError : std::runtime_error {
  using std::runtime_error::runtime_error;
};

class Args {
 public:
  Args(std::string command, std::string summary);

  // An integer flag --name N with N >= min_value.
  void add_int(const std::string& name, int64_t* target, const std::string& help, int64_t min_value);
  void add_string(const std::string& name, std::string* target, const std::string& help,
                  const std::string& metavar = "VALUE");
  // A file the command writes (add_string, then check_output_path on the value while parsing).
  void add_output(const std::string& name, std::string* target, const std::string& help,
                  const std::string& metavar = "FILE");
  // A byte count: 123, 64MiB, 1.5GiB, 20M, 512K. Unset flags keep *target at -1 (help shows none).
  void add_bytes(const std::string& name, int64_t* target, const std::string& help);
  // A device flag: "cpu", "cuda", "cuda:N".
  void add_device(const std::string& name, c10::Device* target, const std::string& help);
  void add_flag(const std::string& name, bool* target, const std::string& help);
  void add_double(const std::string& name, double* target, const std::string& help, double min_value);
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
    std::string name, help, metavar, default_text;
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
  args.add_int("layers", &c.layers, "number of Transformer blocks", 1);
  args.add_int("width", &c.width, "model width d_model (divisible by --heads)", 1);
  args.add_int("heads", &c.heads, "attention heads", 1);
  args.add_int("batch", &c.batch, "batch size B", 1);
  args.add_int("seq", &c.seq, "sequence length T", 1);
  args.add_device("device", &c.device, "where the model and activations live");
}

}  // namespace cli
}  // namespace frugal
