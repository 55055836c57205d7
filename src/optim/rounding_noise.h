// src/optim/rounding_noise.h — the noise of stochastic rounding to bf16, one definition for every
// kernel that narrows a value (the fused AdamW kernels, the quantized-state kernel and the CUDA
// kernel), so a bf16 parameter rounds the same way whichever of them updates it. The AVX-512 path
// of quantize_avx512.cpp computes the same hash sixteen lanes at a time. Internal; not installed.
#pragma once

#include <cstdint>

#if defined(__CUDACC__)
#define FRUGAL_HOST_DEVICE __host__ __device__ __forceinline__
#else
#define FRUGAL_HOST_DEVICE inline
#endif

namespace frugal {
namespace optim {

// murmur3's 32-bit finaliser: every input bit reaches every output bit.
FRUGAL_HOST_DEVICE uint32_t mix32(uint32_t h) {
  h ^= h >> 16;
  h *= 0x85ebca6bu;
  h ^= h >> 13;
  h *= 0xc2b2ae35u;
  h ^= h >> 16;
  return h;
}

// The 16 bits added below the bf16 cut of element `index` (of the whole parameter) under the
// step's seed (s0 its low half, s1 its high half): uniform, and the same for any tiling of the work.
FRUGAL_HOST_DEVICE uint32_t rounding_noise(uint32_t s0, uint32_t s1, uint64_t index) {
  return mix32(mix32(static_cast<uint32_t>(index) ^ s0) ^ s1 ^ static_cast<uint32_t>(index >> 32)) & 0xFFFFu;
}

}  // namespace optim
}  // namespace frugal
