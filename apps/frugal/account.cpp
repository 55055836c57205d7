// frugal account — where the training memory of a Transformer stack goes, with and without
// activation checkpointing. Prints a table; --json-out writes the JSON (see bench/memory_account.h).
#include <cstdio>
#include <iomanip>
#include <iostream>
#include <sstream>

#include "args.h"
#include "commands.h"
#include "frugal/bench/memory_account.h"
#include "frugal/io/units.h"

namespace frugal {
namespace cli {
namespace {

void write_account_table(const bench::AccountResult& r, std::ostream& out) {
  const auto& c = r.config;
  out << "frugal account: " << c.layers << " pre-LN blocks, width " << c.width << ", " << c.heads << " heads, input (" << c.batch << ", "
      << c.seq << ", " << c.width << "), fp32 on " << c.device.str() << ", " << r.n_params << " parameters\n\n";
  out << std::left << std::setw(20) << "bucket" << std::right << std::setw(14) << "formula" << std::setw(14) << "tensors" << std::setw(14)
      << "tracker"
      << "\n";
  auto row = [&](const char* name, const bench::BytesCheck& b) {
    out << std::left << std::setw(20) << name << std::right << std::setw(14) << io::human_bytes(b.formula) << std::setw(14)
        << io::human_bytes(b.tensors) << std::setw(14) << io::human_bytes(b.tracked) << (b.agree() ? "" : "   MISMATCH") << "\n";
  };
  row("parameters", r.param_bytes);
  row("gradients", r.grad_bytes);
  row("AdamW state", r.adamw_state_bytes);

  const bench::VariantResult* none = r.find("none");
  out << "\n"
      << std::left << std::setw(20) << "checkpointing" << std::right << std::setw(14) << "kept" << std::setw(10) << "vs none"
      << std::setw(12) << "fwd+bwd" << std::setw(10) << "vs none" << std::setw(16) << "max grad diff"
      << "\n";
  for (const auto& v : r.variants) {
    char ratio[32], time[32], tratio[32], diff[32];
    std::snprintf(ratio, sizeof(ratio), "%.3f", none ? static_cast<double>(v.saved_bytes) / static_cast<double>(none->saved_bytes) : 0.0);
    std::snprintf(time, sizeof(time), v.time_s ? "%.1f ms" : "-", v.time_s ? *v.time_s * 1e3 : 0.0);
    std::snprintf(tratio, sizeof(tratio), (v.time_s && none && none->time_s) ? "%.2fx" : "-",
                  (v.time_s && none && none->time_s) ? *v.time_s / *none->time_s : 0.0);
    std::snprintf(diff, sizeof(diff), "%.2e", v.max_grad_diff);
    out << std::left << std::setw(20) << v.name << std::right << std::setw(14) << io::human_bytes(v.saved_bytes) << std::setw(10) << ratio
        << std::setw(12) << time << std::setw(10) << tratio << std::setw(16) << diff << "\n";
  }
  out << "\n"
      << std::left << std::setw(20) << "attention" << std::right << std::setw(14) << "kept" << std::setw(14) << "predicted" << std::setw(10)
      << "ratio" << std::setw(12) << "fwd+bwd" << std::setw(16) << "vs explicit"
      << "\n";
  for (const auto& a : r.attentions) {
    char ratio[32], time[32], diff[32];
    std::snprintf(ratio, sizeof(ratio), "%.4f", a.measured_over_predicted());
    std::snprintf(time, sizeof(time), a.time_s ? "%.1f ms" : "-", a.time_s ? *a.time_s * 1e3 : 0.0);
    std::snprintf(diff, sizeof(diff), "%.2e", a.max_grad_diff);
    out << std::left << std::setw(20) << models::attention_kernel_name(a.kernel) << std::right << std::setw(14)
        << io::human_bytes(a.saved_bytes) << std::setw(14) << io::human_bytes(a.predicted_saved_bytes) << std::setw(10) << ratio
        << std::setw(12) << time << std::setw(16) << diff << "\n";
  }
  out << "  (no checkpointing; kept = measured bytes between forward and backward, vs explicit = max grad diff)\n";
  char mop[64];
  std::snprintf(mop, sizeof(mop), "%.4f", r.measured_over_predicted());
  if (r.optimizer_modes) {
    const auto& o = *r.optimizer_modes;
    out << "\n"
        << std::left << std::setw(28) << "training step (AdamW)" << std::right << std::setw(14) << "peak" << std::setw(18)
        << "live gradients"
        << "\n";
    out << std::left << std::setw(28) << "  step after backward" << std::right << std::setw(14) << io::human_bytes(o.peak_bytes_standard)
        << std::setw(18) << io::human_bytes(o.max_live_grad_bytes_standard) << "\n";
    out << std::left << std::setw(28) << "  step inside backward" << std::right << std::setw(14)
        << io::human_bytes(o.peak_bytes_in_backward) << std::setw(18) << io::human_bytes(o.max_live_grad_bytes_in_backward)
        << "   (largest node " << io::human_bytes(o.largest_grad_bytes) << ")\n";
    out << "  (each the peak over the steady steps, from the second on, of a run with its own tracker: not part of\n"
           "  --trace-out, whose peak is the whole account's)\n";
  }
  for (const bench::BudgetResult& b : r.budgets) {
    out << "\nactivation budget " << io::human_bytes(b.budget_bytes) << " (plain run's activation peak "
        << io::human_bytes(r.activation_peak_none) << "):\n";
    if (!b.feasible) {
      out << "  impossible: the smallest achievable peak is " << io::human_bytes(b.min_achievable_bytes) << "\n";
      continue;
    }
    char line[256];
    std::snprintf(line, sizeof(line), "  plan            %s (%lld of %lld blocks recomputed)\n", b.plan.describe().c_str(),
                  static_cast<long long>(b.plan.checkpointed_blocks()), static_cast<long long>(r.config.layers));
    out << line;
    out << "  predicted peak  " << io::human_bytes(b.plan.predicted_bytes) << ", measured " << io::human_bytes(b.measured_bytes);
    std::snprintf(line, sizeof(line), " (%.3f), recompute %.1f ms",
                  static_cast<double>(b.measured_bytes) / static_cast<double>(b.plan.predicted_bytes), b.plan.recompute_s * 1e3);
    out << line << "\n";
    std::snprintf(line, sizeof(line), "  sqrt(n) rule    %s: predicted peak ", b.sqrt_n.describe().c_str());
    out << line << io::human_bytes(b.sqrt_n.predicted_bytes);
    std::snprintf(line, sizeof(line), ", recompute %.1f ms\n", b.sqrt_n.recompute_s * 1e3);
    out << line;
  }
  out << "\npredicted kept bytes without checkpointing: " << io::human_bytes(r.predicted_saved_bytes_none) << " ("
      << r.predicted_saved_bytes_none << " B); measured / predicted = " << mop << "\n";
}

}  // namespace

int run_account(int argc, char** argv) {
  bench::AccountConfig config;
  int64_t seed = 0;
  std::string json_out;  // none unless asked for
  bool skip_timing = false;
  int64_t budget = -1;
  std::string trace_out;
  Args args("account",
            "Measure parameter, gradient and AdamW-state bytes of a stack of pre-LN Transformer blocks, and\n"
            "the activation bytes kept for backward with no checkpointing, full, every second block and\n"
            "selective checkpointing, against a per-layer formula, and without checkpointing with each attention\n"
            "kernel the build has (explicit; sdpa on LibTorch 2.x). With --budget, also plans which blocks\n"
            "to checkpoint to fit an activation budget and measures the plan. Prints a table (and JSON with --json-out).");
  add_stack_flags(args, config);
  args.add_int("seed", &seed, "random seed", 0, kMaxSeed);
  args.add_output("json-out", &json_out, "also write the result as JSON here ('-' for standard output)", "FILE");
  args.add_bytes("budget", &budget, "activation budget: plan which blocks to checkpoint so the activation peak fits, then measure it", 0);
  args.add_output("trace-out", &trace_out, "write the allocation timeline (JSON; frugal report reads it)", "FILE");
  args.add_flag("skip-timing", &skip_timing, "do not time forward+backward (time_s is null)");
  if (!args.parse(argc, argv, 2)) return 0;
  config.seed = static_cast<uint64_t>(seed);
  check_stack_size(config);
  config.timing = !skip_timing;
  if (budget >= 0) config.budget_bytes.push_back(budget);
  const std::string invalid = bench::validate(config);
  if (!invalid.empty()) throw UsageError("--" + invalid);

  warn_if_slow_blas();
  const bool json_to_stdout = json_out == "-";
  bench::AccountResult result =
      bench::run_memory_account(config, [](const std::string& line) { std::cerr << "frugal account: " << line << "\n"; });
  if (!result.budgets.empty() && !result.budgets.front().feasible) {
    const auto& b = result.budgets.front();
    throw UsageError("--budget " + std::to_string(b.budget_bytes) + " (" + io::human_bytes(b.budget_bytes) +
                     ") cannot be met: the smallest achievable activation peak for this stack is " +
                     std::to_string(b.min_achievable_bytes) + " bytes (" + io::human_bytes(b.min_achievable_bytes) + ")");
  }
  std::ostringstream table, json;
  write_account_table(result, table);
  bench::write_account_json(result, json);
  (json_to_stdout ? std::cerr : std::cout) << table.str();
  if (!json_out.empty()) {
    write_output(json_out, json.str());
    if (!json_to_stdout) std::cout << "\nwrote " << json_out << "\n";
  }
  if (!trace_out.empty()) {
    std::ostringstream trace;
    result.tracker->write_timeline_json(trace);
    write_output(trace_out, trace.str());
    std::cout << "wrote " << trace_out << " (" << result.tracker->events().size() << " events; peak over the whole account "
              << io::human_bytes(result.tracker->peak_report().peak_bytes) << ", as frugal report shows it)\n";
  }

  if (result.n_params != result.n_params_formula) {
    throw std::runtime_error("parameter count " + std::to_string(result.n_params) +
                             " differs from L*(12d^2+13d) = " + std::to_string(result.n_params_formula));
  }
  for (const auto* check : {&result.param_bytes, &result.grad_bytes, &result.adamw_state_bytes}) {
    if (!check->agree()) throw std::runtime_error("a byte count differs between formula, tensors and tracker (see MISMATCH)");
  }
  return 0;
}

}  // namespace cli
}  // namespace frugal
