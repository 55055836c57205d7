// src/optim/bf16_avx2.h — bf16 <-> fp32 eight lanes at a time in AVX2, for every fused CPU kernel
// that reads or writes bf16 parameters: the dense Adam(W)/SGD lanes (adam_kernel.cpp) and the
// quantized-state kernel (quantize.cpp). The same rounding as their portable loops (rounding to
// nearest even, or stochastically with rounding_noise.h's hash of the element's index), so every
// path writes the same bits. Internal; not installed; only where FRUGAL_X86_KERNELS.
//
//   const __m256 x = bf16_avx2::load(p);                 // 8 bf16 -> fp32
//   bf16_avx2::store_stochastic(p, x, seed, index);      // fp32 -> 8 bf16, index: p[0]'s in the parameter
#pragma once

#include <cstdint>

#include "../precision/x86_kernels.h"
#include "rounding_noise.h"

#if FRUGAL_X86_KERNELS
namespace frugal {
namespace optim {
namespace bf16_avx2 {

#define FRUGAL_BF16_AVX2 __attribute__((target("avx2"), always_inline)) inline

// bf16 is the top half of an fp32's bits: widening is a shift.
FRUGAL_BF16_AVX2 __m256 load(const uint16_t* x) {
  const __m256i wide = _mm256_cvtepu16_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(x)));
  return _mm256_castsi256_ps(_mm256_slli_epi32(wide, 16));
}

// (bits + noise) >> 16 on 8 lanes, packed into 8 bf16; infinities stay, a NaN stays a quiet NaN of
// its sign.
FRUGAL_BF16_AVX2 void store_bits(uint16_t* x, __m256i bits, __m256i noise) {
  const __m256i exponent = _mm256_set1_epi32(0x7F800000), mantissa = _mm256_set1_epi32(0x007FFFFF);
  const __m256i special = _mm256_cmpeq_epi32(_mm256_and_si256(bits, exponent), exponent);
  const __m256i nan =
      _mm256_andnot_si256(_mm256_cmpeq_epi32(_mm256_and_si256(bits, mantissa), _mm256_setzero_si256()), _mm256_set1_epi32(0x40));
  const __m256i kept = _mm256_or_si256(_mm256_srli_epi32(bits, 16), nan);
  const __m256i rounded = _mm256_srli_epi32(_mm256_add_epi32(bits, noise), 16);
  const __m256i out = _mm256_blendv_epi8(rounded, kept, special);
  _mm_storeu_si128(reinterpret_cast<__m128i*>(x), _mm_packus_epi32(_mm256_castsi256_si128(out), _mm256_extracti128_si256(out, 1)));
}

// To nearest, ties to even: noise 0x7FFF plus the lowest kept bit.
FRUGAL_BF16_AVX2 void store_nearest(uint16_t* x, __m256 v) {
  const __m256i bits = _mm256_castps_si256(v);
  const __m256i lowest_kept = _mm256_and_si256(_mm256_srli_epi32(bits, 16), _mm256_set1_epi32(1));
  store_bits(x, bits, _mm256_add_epi32(_mm256_set1_epi32(0x7FFF), lowest_kept));
}

// rounding_noise.h's mix32 on 8 lanes.
FRUGAL_BF16_AVX2 __m256i mix(__m256i h) {
  h = _mm256_xor_si256(h, _mm256_srli_epi32(h, 16));
  h = _mm256_mullo_epi32(h, _mm256_set1_epi32(static_cast<int>(0x85ebca6bu)));
  h = _mm256_xor_si256(h, _mm256_srli_epi32(h, 13));
  h = _mm256_mullo_epi32(h, _mm256_set1_epi32(static_cast<int>(0xc2b2ae35u)));
  return _mm256_xor_si256(h, _mm256_srli_epi32(h, 16));
}

// Stochastically: rounding_noise(seed, index + lane) added below the cut.
FRUGAL_BF16_AVX2 void store_stochastic(uint16_t* x, __m256 v, uint64_t seed, int64_t index) {
  // the lanes' indices, low and high 32 bits (a carry where the low half wraps)
  const uint32_t lo0 = static_cast<uint32_t>(index), hi0 = static_cast<uint32_t>(static_cast<uint64_t>(index) >> 32);
  const __m256i lo = _mm256_add_epi32(_mm256_set1_epi32(static_cast<int>(lo0)), _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7));
  const __m256i sign = _mm256_set1_epi32(static_cast<int>(0x80000000u));
  const __m256i wrapped = _mm256_cmpgt_epi32(_mm256_xor_si256(_mm256_set1_epi32(static_cast<int>(lo0)), sign), _mm256_xor_si256(lo, sign));
  const __m256i hi = _mm256_sub_epi32(_mm256_set1_epi32(static_cast<int>(hi0)), wrapped);
  const __m256i s0 = _mm256_set1_epi32(static_cast<int>(static_cast<uint32_t>(seed)));
  const __m256i s1 = _mm256_set1_epi32(static_cast<int>(static_cast<uint32_t>(seed >> 32)));
  const __m256i h = mix(_mm256_xor_si256(_mm256_xor_si256(mix(_mm256_xor_si256(lo, s0)), s1), hi));
  store_bits(x, _mm256_castps_si256(v), _mm256_and_si256(h, _mm256_set1_epi32(0xFFFF)));
}

#undef FRUGAL_BF16_AVX2

}  // namespace bf16_avx2
}  // namespace optim
}  // namespace frugal
#endif
