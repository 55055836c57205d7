// frugal/bench/hardware.h — how fast this machine multiplies matrices.
//
// LibTorch on Debian falls back to reference BLAS (~5 GFLOP/s) unless libopenblas0-pthread is
// installed (~150 GFLOP/s on 2 cores); the CLI uses this to warn at start-up.
//
//   double gflops = frugal::bench::measure_matmul_gflops(256, 0.05);
//   if (gflops < frugal::bench::kSlowBlasGflops) { ... }
#pragma once

#include <cstdint>
#include <string>

namespace frugal {
namespace bench {

constexpr double kSlowBlasGflops = 20.0;

// fp32 (n x n) @ (n x n) on CPU, repeated for at least min_seconds after one warm-up.
double measure_matmul_gflops(int64_t n = 256, double min_seconds = 0.05);

// One line to print when gflops is below kSlowBlasGflops, else empty.
std::string slow_blas_warning(double gflops);

// bf16 (n x n) @ (n x n) on CPU (oneDNN's bf16 kernels where LibTorch routes them), like the above.
double measure_bf16_matmul_gflops(int64_t n = 1024, double min_seconds = 0.5);


}  // namespace bench
}  // namespace frugal
