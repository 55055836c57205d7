#include "frugal/bench/hardware.h"

#include <ATen/ATen.h>

#include <chrono>
#include <cstdio>

namespace frugal {
namespace bench {

namespace {

double matmul_gflops(int64_t n, double min_seconds, at::ScalarType dtype) {
  at::NoGradGuard no_grad;
  const at::Tensor a = at::randn({n, n}).to(dtype);
  const at::Tensor b = at::randn({n, n}).to(dtype);
  at::Tensor c = at::mm(a, b);  // warm-up
  using clock = std::chrono::steady_clock;
  const auto start = clock::now();
  int64_t reps = 0;
  double elapsed = 0;
  do {
    at::mm_out(c, a, b);
    ++reps;
    elapsed = std::chrono::duration<double>(clock::now() - start).count();
  } while (elapsed < min_seconds);
  return 2.0 * static_cast<double>(n * n * n) * static_cast<double>(reps) / elapsed / 1e9;
}

}  // namespace

double measure_matmul_gflops(int64_t n, double min_seconds) { return matmul_gflops(n, min_seconds, at::kFloat); }

double measure_bf16_matmul_gflops(int64_t n, double min_seconds) { return matmul_gflops(n, min_seconds, at::kBFloat16); }


std::string slow_blas_warning(double gflops) {
  if (gflops >= kSlowBlasGflops) return "";
  char buf[256];
  std::snprintf(buf, sizeof(buf),
                "warning: matrix products run at %.1f GFLOP/s (reference-BLAS speed); install "
                "libopenblas0-pthread (apt-get install libopenblas0-pthread) for ~30x faster training",
                gflops);
  return buf;
}

}  // namespace bench
}  // namespace frugal
