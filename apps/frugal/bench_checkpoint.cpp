// frugal bench checkpoint — time and kept-activation ratios of each checkpointing policy against
// none, and the budget planner's plans at 25%, 50% and 75% of the plain activation peak.
#include <ATen/Parallel.h>

#include <cstdio>
#include <iostream>
#include <sstream>

#include "args.h"
#include "commands.h"
#include "frugal/bench/memory_account.h"
#include "frugal/io/json.h"
#include "frugal/io/units.h"

namespace frugal {
namespace cli {

int bench_checkpoint(int argc, char** argv) {
  bench::AccountConfig config;
  config.layers = 12;
  config.width = 256;
  config.timing_warmup = 2;
  config.timing_runs = 9;
  int64_t runs = config.timing_runs;
  std::string json_out = "-";
  Args args("bench checkpoint",
            "Times forward+backward (median of --runs after warm-up) and measures the activation bytes kept\n"
            "for backward for each checkpointing policy, and prints both as ratios against no checkpointing.");
  add_stack_flags(args, config);
  args.add_int("runs", &runs, "timed runs per policy", 1, kMaxRuns);
  args.add_output("json-out", &json_out, "where to write the JSON ('-' for standard output)", "FILE");
  if (!args.parse(argc, argv, 3)) return 0;
  config.timing_runs = static_cast<int>(runs);
  check_stack_size(config);
  config.budget_fractions = {0.25, 0.5, 0.75};
  config.optimizer_modes = false;
  const std::string invalid = bench::validate(config);
  if (!invalid.empty()) throw UsageError("--" + invalid);

  warn_if_slow_blas();
  const bench::AccountResult r =
      bench::run_memory_account(config, [](const std::string& line) { std::cerr << "frugal bench checkpoint: " << line << "\n"; });
  const bench::VariantResult* none = r.find("none");
  std::ostringstream json;
  io::JsonWriter w(json);
  w.begin_object().key("benchmark").value("checkpoint");
  w.key("config")
      .begin_object()
      .key("layers")
      .value(config.layers)
      .key("width")
      .value(config.width)
      .key("heads")
      .value(config.heads)
      .key("batch")
      .value(config.batch)
      .key("seq")
      .value(config.seq)
      .key("runs")
      .value(config.timing_runs)
      .key("threads")
      .value(at::get_num_threads())
      .end_object();
  w.key("variants").begin_object();
  for (const auto& v : r.variants) {
    const double memory_ratio = static_cast<double>(v.saved_bytes) / static_cast<double>(none->saved_bytes);
    const double time_ratio = *v.time_s / *none->time_s;
    w.key(v.name)
        .begin_object()
        .key("saved_bytes")
        .value(v.saved_bytes)
        .key("time_s")
        .value(*v.time_s)
        .key("memory_ratio")
        .value(memory_ratio)
        .key("time_ratio")
        .value(time_ratio)
        .key("max_grad_diff")
        .value(v.max_grad_diff)
        .end_object();
    std::fprintf(stderr, "%-10s memory_ratio %.3f  time_ratio %.3f\n", v.name.c_str(), memory_ratio, time_ratio);
  }
  w.end_object();
  w.key("activation_peak_none").value(r.activation_peak_none);
  w.key("planner_predicted_none").value(r.planner_predicted_none);
  w.key("plans").begin_array();
  const double fractions[] = {0.25, 0.5, 0.75};
  for (size_t i = 0; i < r.budgets.size(); ++i) {
    const auto& b = r.budgets[i];
    if (!b.feasible) {
      throw std::runtime_error("the planner found no plan for " + std::to_string(fractions[i]) +
                               " of the plain activation peak (smallest achievable: " + std::to_string(b.min_achievable_bytes) + " bytes)");
    }
    w.begin_object().key("fraction_of_none").value(fractions[i]);
    w.key("budget_bytes")
        .value(b.budget_bytes)
        .key("plan")
        .value(b.plan.describe())
        .key("predicted_bytes")
        .value(b.plan.predicted_bytes)
        .key("measured_bytes")
        .value(b.measured_bytes)
        .key("measured_over_predicted")
        .value(static_cast<double>(b.measured_bytes) / static_cast<double>(b.plan.predicted_bytes))
        .key("time_ratio")
        .value(*b.time_s / *none->time_s)
        .key("recompute_s")
        .value(b.plan.recompute_s)
        .key("max_grad_diff")
        .value(b.max_grad_diff)
        .end_object();
    std::fprintf(stderr, "budget %.0f%%: %s  predicted %s  measured %s (%.3f)  time_ratio %.3f\n", fractions[i] * 100,
                 b.plan.describe().c_str(), io::human_bytes(b.plan.predicted_bytes).c_str(), io::human_bytes(b.measured_bytes).c_str(),
                 static_cast<double>(b.measured_bytes) / static_cast<double>(b.plan.predicted_bytes), *b.time_s / *none->time_s);
  }
  w.end_array();
  if (!r.budgets.empty()) {
    w.key("sqrt_n")
        .begin_object()
        .key("plan")
        .value(r.budgets[0].sqrt_n.describe())
        .key("predicted_bytes")
        .value(r.budgets[0].sqrt_n.predicted_bytes)
        .key("recompute_s")
        .value(r.budgets[0].sqrt_n.recompute_s)
        .end_object();
  }
  w.key("full_kept_bound_bytes").value((config.layers + 1) * config.batch * config.seq * config.width * 4);
  w.end_object();
  write_output(json_out, json.str());
  return 0;
}

}  // namespace cli
}  // namespace frugal
