// frugal/memory/cuda_stats.h — what the CUDA caching allocator holds, as it counts it itself.
//
// The tracker counts the bytes tensors ask for; the caching allocator rounds each request up and
// keeps freed blocks reserved for reuse, so a GPU's memory in use is its reserved bytes. This
// reads both counters (current and peak, since the process started or the last reset), the
// figures torch.cuda.max_memory_allocated() and max_memory_reserved() report.
//
//   frugal::memory::CudaMemoryStats s = frugal::memory::cuda_memory_stats(0);
//   if (s.available) std::cout << s.peak_allocated_bytes << " " << s.peak_reserved_bytes << "\n";
//   frugal::memory::reset_cuda_peak_stats(0);
#pragma once

#include <cstdint>
#include <string>

namespace frugal {
namespace memory {

// One device's caching-allocator counters, in bytes, or why they are unavailable.
struct CudaMemoryStats {
  bool available = false;  // false in a build without CUDA or when the device does not exist
  std::string unavailable_reason;
  int64_t allocated_bytes = 0, peak_allocated_bytes = 0;  // bytes in live blocks (rounded requests)
  int64_t reserved_bytes = 0, peak_reserved_bytes = 0;    // bytes the allocator holds from cudaMalloc
};

// The caching allocator's counters for one device (all pools together).
CudaMemoryStats cuda_memory_stats(int device_index);
// Sets the peaks to the current values (no-op where unavailable).
void reset_cuda_peak_stats(int device_index);

}  // namespace memory
}  // namespace frugal
