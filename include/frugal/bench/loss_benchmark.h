// frugal/bench/loss_benchmark.h — the chunked cross-entropy against Linear + cross_entropy.
//
// Measures, in one run, the peak bytes above the parameters and inputs during forward+backward
// (allocation tracker), the median forward+backward time, and the largest relative gradient
// difference of the two.
//
//   frugal::bench::ChunkedLossConfig cfg;          // 8192 tokens, hidden 512, vocabulary 32000
//   auto r = frugal::bench::run_chunked_loss_benchmark(cfg);
//   double ratio = double(r.peak_bytes_chunked) / r.peak_bytes_plain;
#pragma once

#include <c10/core/Device.h>

#include <cstdint>

namespace frugal {
namespace bench {

struct ChunkedLossConfig {
  int64_t tokens = 8192;
  int64_t hidden = 512;
  int64_t vocab = 32000;
  int64_t chunk = 1024;
  int timing_runs = 3;   // 0: no timing
  uint64_t seed = 0;
  c10::Device device = c10::Device(c10::kCPU);
};

struct ChunkedLossResult {
  int64_t peak_bytes_plain = 0;    // above what was live before the step
  int64_t peak_bytes_chunked = 0;
  double time_s_plain = 0, time_s_chunked = 0;
  double max_rel_grad_diff = 0;    // over the hidden states and the weight, relative to the largest entry
  double loss_plain = 0, loss_chunked = 0;
};

ChunkedLossResult run_chunked_loss_benchmark(const ChunkedLossConfig& config);

}  // namespace bench
}  // namespace frugal
