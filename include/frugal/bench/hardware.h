// frugal/bench/hardware.h — how fast this machine multiplies matrices.
//
// LibTorch on Debian falls back to reference BLAS (~5 GFLOP/s) unless libopenblas0-pthread is
// installed (~150 GFLOP/s on 2 cores); the CLI warns at start-up when the reference library is the
// one loaded (found from the process's mappings, not from a timing, which a busy machine skews).
//
//   double gflops = frugal::bench::measure_matmul_gflops(256, 0.05);
//   std::string w = frugal::bench::slow_blas_warning(frugal::bench::loaded_blas_library());
#pragma once

#include <c10/core/ScalarType.h>

#include <cstdint>
#include <string>

namespace frugal {
namespace bench {

// fp32 (n x n) @ (n x n) on CPU, repeated for at least min_seconds after one warm-up.
double measure_matmul_gflops(int64_t n = 256, double min_seconds = 0.05);

// The path of the BLAS library mapped into this process ("" when none is: LibTorch linked its own).
std::string loaded_blas_library();
// One line to print when that library is the reference BLAS (Debian's blas/libblas.so.3), else empty.
std::string slow_blas_warning(const std::string& blas_library);

// bf16 (n x n) @ (n x n) on CPU (oneDNN's bf16 kernels where LibTorch routes them), like the above.
double measure_bf16_matmul_gflops(int64_t n = 1024, double min_seconds = 0.5);
// The matmul speed a training run computing in `compute` gets: bf16 (with the thread pools such a
// run uses, precision::ComputeThreadsGuard) or fp32.
double measure_compute_matmul_gflops(at::ScalarType compute, int64_t n = 1024, double min_seconds = 0.5);

}  // namespace bench
}  // namespace frugal
