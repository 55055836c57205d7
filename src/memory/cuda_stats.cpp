// Compiled in CUDA builds only (CMake); src/memory/cuda_stats_stub.cpp otherwise.
#include "frugal/memory/cuda_stats.h"

#include <c10/cuda/CUDACachingAllocator.h>
#include <c10/cuda/CUDAFunctions.h>

namespace frugal {
namespace memory {

namespace {
namespace alloc = c10::cuda::CUDACachingAllocator;

bool device_exists(int device_index, std::string& reason) {
  const int count = static_cast<int>(c10::cuda::device_count());
  if (device_index >= 0 && device_index < count) return true;
  reason = count == 0 ? "no CUDA device is available" : "CUDA device " + std::to_string(device_index) + " does not exist";
  return false;
}
}  // namespace

CudaMemoryStats cuda_memory_stats(int device_index) {
  CudaMemoryStats s;
  if (!device_exists(device_index, s.unavailable_reason)) return s;
  const auto stats = alloc::getDeviceStats(static_cast<c10::DeviceIndex>(device_index));
  // StatType::AGGREGATE (every pool) is entry 0; the enum moved namespaces in 2.x (c10::CachingAllocator
  // now), so it is not named here.
  const size_t all = 0;
  s.available = true;
  s.allocated_bytes = stats.allocated_bytes[all].current;
  s.peak_allocated_bytes = stats.allocated_bytes[all].peak;
  s.reserved_bytes = stats.reserved_bytes[all].current;
  s.peak_reserved_bytes = stats.reserved_bytes[all].peak;
  return s;
}

void reset_cuda_peak_stats(int device_index) {
  std::string reason;
  if (device_exists(device_index, reason)) alloc::resetPeakStats(static_cast<c10::DeviceIndex>(device_index));
}

}  // namespace memory
}  // namespace frugal
