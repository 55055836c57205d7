// A build against a CPU-only LibTorch: there is no caching allocator to read (CMake compiles this
// instead of cuda_stats.cpp).
#include "frugal/memory/cuda_stats.h"

namespace frugal {
namespace memory {

CudaMemoryStats cuda_memory_stats(int) {
  CudaMemoryStats s;
  s.unavailable_reason = "this build of frugal has no CUDA (LibTorch without CUDA)";
  return s;
}

void reset_cuda_peak_stats(int) {}

}  // namespace memory
}  // namespace frugal
