// In libfrugal_cuda.so (memory/cuda_runtime.h): the caching allocator lives in LibTorch's CUDA half.
#include "frugal/memory/cuda_stats.h"

#include <c10/cuda/CUDACachingAllocator.h>
#include <c10/cuda/CUDAFunctions.h>

namespace {

bool device_exists(int device_index, std::string& reason) {
  const int count = static_cast<int>(c10::cuda::device_count());
  if (device_index >= 0 && device_index < count) return true;
  reason = count == 0 ? "no CUDA device is available" : "CUDA device " + std::to_string(device_index) + " does not exist";
  return false;
}

}  // namespace

extern "C" __attribute__((visibility("default"))) void frugal_cuda_memory_stats(int device_index, frugal::memory::CudaMemoryStats* s) {
  if (!device_exists(device_index, s->unavailable_reason)) return;
  const auto stats = c10::cuda::CUDACachingAllocator::getDeviceStats(static_cast<c10::DeviceIndex>(device_index));
  // StatType::AGGREGATE (every pool) is entry 0; the enum moved namespaces in 2.x (c10::CachingAllocator
  // now), so it is not named here.
  const size_t all = 0;
  s->available = true;
  s->allocated_bytes = stats.allocated_bytes[all].current;
  s->peak_allocated_bytes = stats.allocated_bytes[all].peak;
  s->reserved_bytes = stats.reserved_bytes[all].current;
  s->peak_reserved_bytes = stats.reserved_bytes[all].peak;
}

extern "C" __attribute__((visibility("default"))) void frugal_cuda_reset_peak_stats(int device_index) {
  std::string reason;
  if (device_exists(device_index, reason)) {
    c10::cuda::CUDACachingAllocator::resetPeakStats(static_cast<c10::DeviceIndex>(device_index));
  }
}
