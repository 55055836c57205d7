// frugal/bench/optim_benchmark.h — a training step with the optimizer after backward vs inside it.
//
// Trains two identical pre-LN Transformer stacks with AdamW on the same batches, one per mode, and
// measures with the allocation tracker the peak bytes of a steady training step, the gradient
// bytes live at once, and the time per step; at the end, how far apart the parameters are.
//
//   frugal::bench::OptimInBackwardConfig cfg;     // 12 layers, d 512, batch 1, seq 64
//   auto r = frugal::bench::run_optim_in_backward_benchmark(cfg);
//   bool ok = r.peak_bytes_in_backward <= r.bound_bytes();
#pragma once

#include <c10/core/Device.h>

#include <cstdint>
#include <string>

namespace frugal {
namespace bench {

// The stack, batch and step counts run_optim_in_backward_benchmark trains both modes with.
struct OptimInBackwardConfig {
  int64_t layers = 12;
  int64_t width = 512;
  int64_t heads = 8;
  int64_t batch = 1;
  int64_t seq = 64;
  std::string policy = "none";  // activation checkpointing of the blocks
  int memory_steps = 3;         // tracked steps; the first creates the optimizer state
  int timing_runs = 5;          // timed steps per mode after one warm-up (0: no timing)
  uint64_t seed = 0;
  c10::Device device = c10::Device(c10::kCPU);
};

// Bytes, times and final parameter gap of the two modes (AdamW after backward vs inside it).
struct OptimInBackwardResult {
  int64_t param_bytes = 0;
  int64_t state_bytes = 0;
  int64_t grad_bytes = 0;           // all parameter gradients
  int64_t largest_grad_bytes = 0;   // the most one backward node hands over (a module's, or a region's)
  int64_t activation_bytes = 0;     // kept between forward and backward
  int64_t peak_bytes_standard = 0;  // peak of a steady step (after the first)
  int64_t peak_bytes_in_backward = 0;
  int64_t max_live_grad_bytes_standard = 0;
  int64_t max_live_grad_bytes_in_backward = 0;
  double time_s_standard = 0, time_s_in_backward = 0;  // median per step
  double max_param_diff = 0;

  // peak_bytes_standard - grad_bytes + activation_bytes + largest_grad_bytes
  int64_t bound_bytes() const { return peak_bytes_standard - grad_bytes + activation_bytes + largest_grad_bytes; }
};

OptimInBackwardResult run_optim_in_backward_benchmark(const OptimInBackwardConfig& config);

}  // namespace bench
}  // namespace frugal
