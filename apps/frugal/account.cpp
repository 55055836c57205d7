// frugal account — where the training memory of a Transformer stack goes, with and without
// activation checkpointing. Prints a table, writes the JSON (see train/memory_account.h).
#include <iostream>
#include <sstream>

#include "args.h"
#include "commands.h"
#include "frugal/bench/memory_account.h"
#include "frugal/io/units.h"

namespace frugal {
namespace cli {

int run_account(int argc, char** argv) {
  bench::AccountConfig config;
  int64_t seed = 0;
  std::string json_out = "account.json";
  bool skip_timing = false;
  int64_t budget = -1;
  std::string trace_out;
  Args args("account",
            "Measure parameter, gradient and AdamW-state bytes of a stack of pre-LN Transformer blocks, and\n"
            "the activation bytes kept for backward with no checkpointing, full, every second block and\n"
            "selective checkpointing, against a per-layer formula. With --budget, also plans which blocks\n"
            "to checkpoint to fit an activation budget and measures the plan. Prints a table and writes JSON.");
  add_stack_flags(args, config);
  args.add_int("seed", &seed, "random seed", 0);
  args.add_string("json-out", &json_out, "where to write the JSON ('-' for standard output)", "FILE");
  args.add_bytes("budget", &budget,
                  "activation budget: plan which blocks to checkpoint so the activation peak fits, then measure it");
  args.add_string("trace-out", &trace_out, "write the allocation timeline (JSON; frugal report reads it)", "FILE");
  args.add_flag("skip-timing", &skip_timing, "do not time forward+backward (time_s is null)");
  if (!args.parse(argc, argv, 2)) return 0;
  config.seed = static_cast<uint64_t>(seed);
  config.timing = !skip_timing;
  if (budget >= 0) config.budget_bytes.push_back(budget);
  const std::string invalid = bench::validate(config);
  if (!invalid.empty()) throw UsageError("--" + invalid);

  warn_if_slow_blas();
  const bool json_to_stdout = json_out == "-";
  bench::AccountResult result = bench::run_memory_account(config, [](const std::string& line) {
    std::cerr << "frugal account: " << line << "\n";
  });
  if (!result.budgets.empty() && !result.budgets.front().feasible) {
    const auto& b = result.budgets.front();
    throw UsageError("--budget " + std::to_string(b.budget_bytes) + " (" + io::human_bytes(b.budget_bytes) +
                     ") cannot be met: the smallest achievable activation peak for this stack is " +
                     std::to_string(b.min_achievable_bytes) + " bytes (" + io::human_bytes(b.min_achievable_bytes) + ")");
  }
  std::ostringstream table, json;
  bench::write_account_table(result, table);
  bench::write_account_json(result, json);
  (json_to_stdout ? std::cerr : std::cout) << table.str();
  write_output(json_out, json.str());
  if (!json_to_stdout) std::cout << "\nwrote " << json_out << "\n";
  if (!trace_out.empty()) {
    std::ostringstream trace;
    result.tracker->write_timeline_json(trace);
    write_output(trace_out, trace.str());
    std::cout << "wrote " << trace_out << " (" << result.tracker->events().size() << " events)\n";
  }

  if (result.n_params != result.n_params_formula) {
    throw std::runtime_error("parameter count " + std::to_string(result.n_params) + " differs from L*(12d^2+13d) = " +
                             std::to_string(result.n_params_formula));
  }
  for (const auto* check : {&result.param_bytes, &result.grad_bytes, &result.adamw_state_bytes}) {
    if (!check->agree()) throw std::runtime_error("a byte count differs between formula, tensors and tracker (see MISMATCH)");
  }
  return 0;
}

}  // namespace cli
}  // namespace frugal
