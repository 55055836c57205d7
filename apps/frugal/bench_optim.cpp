// frugal bench optim-in-backward — peak memory and time of a training step with the optimizer
// step fused into backward, against the standard step.
#include <ATen/Parallel.h>

#include <cstdio>
#include <sstream>

#include "args.h"
#include "commands.h"
#include "frugal/bench/optim_benchmark.h"
#include "frugal/checkpoint/policy.h"
#include "frugal/io/json.h"
#include "frugal/io/units.h"

namespace frugal {
namespace cli {

int bench_optim_in_backward(int argc, char** argv) {
  bench::OptimInBackwardConfig c;
  int64_t runs = c.timing_runs;
  Args args("bench optim-in-backward",
            "Trains two identical Transformer stacks with AdamW, one stepping after backward and one inside it, and\n"
            "reports the peak bytes of a steady step, the gradient bytes live at once, time per step, and the\n"
            "parameter difference at the end.");
  add_stack_flags(args, c);
  args.add_string("policy", &c.policy, "activation checkpointing: none, full, every_K, selective", "POLICY");
  args.add_int("runs", &runs, "timed steps per mode", 1, kMaxRuns);
  std::string json_out = "-";
  args.add_output("json-out", &json_out, "where to write the JSON ('-' for standard output)", "FILE");
  if (!args.parse(argc, argv, 3)) return 0;
  c.timing_runs = static_cast<int>(runs);
  check_stack_size(c);
  if (c.width % c.heads != 0) throw UsageError("--width must be divisible by --heads");
  try {
    checkpoint::CheckpointPolicy::parse(c.policy);
  } catch (const std::invalid_argument& e) {
    throw UsageError(std::string("--policy: ") + e.what());
  }
  warn_if_slow_blas();
  const auto r = bench::run_optim_in_backward_benchmark(c);
  const double time_ratio = r.time_s_in_backward / r.time_s_standard;
  std::ostringstream json;
  io::JsonWriter w(json);
  w.begin_object().key("benchmark").value("optim-in-backward");
  w.key("config")
      .begin_object()
      .key("layers")
      .value(c.layers)
      .key("width")
      .value(c.width)
      .key("heads")
      .value(c.heads)
      .key("batch")
      .value(c.batch)
      .key("seq")
      .value(c.seq)
      .key("policy")
      .value(c.policy)
      .key("optimizer")
      .value("adamw")
      .key("device")
      .value(c.device.str())
      .key("runs")
      .value(c.timing_runs)
      .key("threads")
      .value(at::get_num_threads())
      .end_object();
  w.key("param_bytes").value(r.param_bytes);
  w.key("adamw_state_bytes").value(r.state_bytes);
  w.key("peak_bytes_standard").value(r.peak_bytes_standard);
  w.key("peak_bytes_in_backward").value(r.peak_bytes_in_backward);
  w.key("memory_ratio").value(static_cast<double>(r.peak_bytes_in_backward) / static_cast<double>(r.peak_bytes_standard));
  w.key("grad_bytes").value(r.grad_bytes);
  w.key("largest_grad_bytes").value(r.largest_grad_bytes);
  w.key("activation_bytes").value(r.activation_bytes);
  w.key("bound_bytes").value(r.bound_bytes());
  w.key("within_bound").value(static_cast<double>(r.peak_bytes_in_backward) <= 1.01 * static_cast<double>(r.bound_bytes()));
  w.key("max_live_grad_bytes_standard").value(r.max_live_grad_bytes_standard);
  w.key("max_live_grad_bytes_in_backward").value(r.max_live_grad_bytes_in_backward);
  w.key("time_s_standard").value(r.time_s_standard);
  w.key("time_s_in_backward").value(r.time_s_in_backward);
  w.key("time_ratio").value(time_ratio);
  w.key("max_param_diff").value(r.max_param_diff);
  w.end_object();
  std::fprintf(stderr,
               "peak: standard %s, in-backward %s (bound %s); gradients live at most %s (largest node %s, all %s); "
               "time_ratio %.3f; max_param_diff %.2e\n",
               io::human_bytes(r.peak_bytes_standard).c_str(), io::human_bytes(r.peak_bytes_in_backward).c_str(),
               io::human_bytes(r.bound_bytes()).c_str(), io::human_bytes(r.max_live_grad_bytes_in_backward).c_str(),
               io::human_bytes(r.largest_grad_bytes).c_str(), io::human_bytes(r.grad_bytes).c_str(), time_ratio, r.max_param_diff);
  write_output(json_out, json.str());
  return 0;
}

}  // namespace cli
}  // namespace frugal
