#include "frugal/bench/hardware.h"

#include <ATen/ATen.h>

#include <chrono>
#include <cstdio>
#include <fstream>

#include "frugal/precision/autocast.h"

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

double measure_compute_matmul_gflops(at::ScalarType compute, int64_t n, double min_seconds) {
  if (compute != at::kBFloat16) return measure_matmul_gflops(n, min_seconds);
  precision::ComputeThreadsGuard threads(c10::kCPU, compute);
  return measure_bf16_matmul_gflops(n, min_seconds);
}

std::string loaded_blas_library() {
  // The Fortran BLAS symbols LibTorch calls come from libblas.so.3 (Debian's alternatives: the
  // reference library, or a link to OpenBLAS or BLIS); a reference copy mapped anywhere wins.
  std::ifstream maps("/proc/self/maps");
  std::string line, optimised;
  while (std::getline(maps, line)) {
    const size_t slash = line.find('/');
    if (slash == std::string::npos) continue;
    const std::string path = line.substr(slash);
    const std::string name = path.substr(path.rfind('/') + 1);
    if (path.find("/blas/libblas.so") != std::string::npos) return path;
    if (optimised.empty() && (name.rfind("libblas.so", 0) == 0 || name.rfind("libopenblas", 0) == 0 || name.rfind("libblis", 0) == 0 ||
                              name.rfind("libmkl_rt", 0) == 0)) {
      optimised = path;
    }
  }
  return optimised;
}

std::string slow_blas_warning(const std::string& blas_library) {
  // Debian's alternatives put the reference library at .../blas/libblas.so.3 and the optimised
  // ones in their own folders (openblas-pthread/, blis-openmp/, atlas/...).
  if (blas_library.find("/blas/libblas.so") == std::string::npos) return "";
  return "warning: matrix products use the reference BLAS (" + blas_library +
         ", ~30x slower); install libopenblas0-pthread (apt-get install libopenblas0-pthread) for faster training";
}

}  // namespace bench
}  // namespace frugal
