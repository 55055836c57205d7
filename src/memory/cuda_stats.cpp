// The caching allocator's counters from frugal's CUDA module (cuda_stats_module.cpp), when it is loaded.
#include "frugal/memory/cuda_stats.h"

#include "frugal/memory/cuda_runtime.h"

namespace frugal {
namespace memory {

CudaMemoryStats cuda_memory_stats(int device_index) {
  using Entry = void (*)(int, CudaMemoryStats*);
  static const auto entry = reinterpret_cast<Entry>(cuda_module_symbol("frugal_cuda_memory_stats"));
  CudaMemoryStats s;
  if (entry) {
    entry(device_index, &s);
  } else {
    s.unavailable_reason = load_cuda().reason;
  }
  return s;
}

void reset_cuda_peak_stats(int device_index) {
  using Entry = void (*)(int);
  static const auto entry = reinterpret_cast<Entry>(cuda_module_symbol("frugal_cuda_reset_peak_stats"));
  if (entry) entry(device_index);
}

}  // namespace memory
}  // namespace frugal
