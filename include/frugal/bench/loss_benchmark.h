// frugal/bench/loss_benchmark.h — frugal's loss over a final Linear, plain and chunked.
//
// Measures, in one run, for the plain loss (loss::linear_cross_entropy: the logits made whole and
// kept) and the chunked one (loss::chunked_cross_entropy), the peak bytes above the parameters and
// inputs during forward+backward (allocation tracker) and the median forward+backward time; and
// how far either's gradients are from those of ATen's Linear + cross_entropy.
//
//   frugal::bench::ChunkedLossConfig cfg;          // 8192 tokens, hidden 512, vocabulary 32000
//   auto r = frugal::bench::run_chunked_loss_benchmark(cfg);
//   double ratio = double(r.peak_bytes_chunked) / r.peak_bytes_plain;
#pragma once

#include <c10/core/Device.h>

#include <cstdint>

namespace frugal {
namespace bench {

// The loss run_chunked_loss_benchmark measures: token count, hidden size, vocabulary, rows per chunk.
struct ChunkedLossConfig {
  int64_t tokens = 8192;
  int64_t hidden = 512;
  int64_t vocab = 32000;
  int64_t chunk = 1024;
  int timing_runs = 3;  // 0: no timing
  uint64_t seed = 0;
  c10::Device device = c10::Device(c10::kCPU);
};

// Peak bytes, median times, losses and gradient gap of the plain and the chunked loss.
struct ChunkedLossResult {
  int64_t peak_bytes_plain = 0;  // above what was live before the step
  int64_t peak_bytes_chunked = 0;
  double time_s_plain = 0, time_s_chunked = 0;
  // the largest gap of either loss's gradients (hidden states, weight) from Linear + cross_entropy's,
  // relative to the reference's largest entry
  double max_rel_grad_diff = 0;
  double loss_plain = 0, loss_chunked = 0;
};

ChunkedLossResult run_chunked_loss_benchmark(const ChunkedLossConfig& config);

}  // namespace bench
}  // namespace frugal
