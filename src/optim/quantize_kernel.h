// src/optim/quantize_kernel.h — what the fused 8- and 4-bit Adam(W) step's CPU paths share:
// quantize.cpp runs the portable and AVX2 paths and picks a path per block; quantize_avx512.cpp
// holds the AVX-512 one, which looks its code maps up in registers (Avx512CodeTables). Internal;
// not installed.
//
//   const Avx512CodeTables* t = avx512_code_tables(map, boundaries, bits, is_signed);  // once per map
//   if (avx512_quant_supported() && t) adam_blocks_avx512(step, first, last);          // whole blocks
#pragma once

#include <cstdint>

#include "frugal/optim/quantize.h"

namespace frugal {
namespace optim {

struct Avx512CodeTables;  // quantize_avx512.cpp

// Everything one block of the fused step needs: the step's constants in fp32 and the buffers.
struct BlockStep {
  float b1, b2, one_b1, one_b2, eps, wd, decay, sqrt_bc2, step;
  bool decoupled;
  float* p;                      // the parameter's elements [begin, end), when fp32 (else null)
  const float* g;                // its gradient, the same range, when fp32 (else null)
  uint16_t* pb = nullptr;        // the parameter's elements as bf16 bits, when bf16
  const uint16_t* gb = nullptr;  // the gradient's, when bf16
  bool stochastic = false;       // bf16 parameter: stochastic rounding with `seed`
  uint64_t seed = 0;
  int64_t begin, numel, block;
  int bits;
  uint8_t *mc, *vc;  // codes
  float *ma, *va;    // block scales
  const float *mmap, *vmap, *mb, *vb;
  const uint8_t *mlut, *vlut;
  const int32_t *menc = nullptr, *venc = nullptr;           // 8-bit: QuantizedBuffer::encode_table()
  const Avx512CodeTables *m512 = nullptr, *v512 = nullptr;  // for the AVX-512 path
};

// For the tests: the 8-bit codes of `count` values (a multiple of 8), already divided by their
// block's absmax, as one path's encode finds them with `map`'s tables (portable: nearest_code's two
// look-ups; avx2: the encode table's one). The path must be this processor's and not avx512.
void encode_codes8(QuantKernel path, const QuantizedBuffer& map, const float* x, uint8_t* codes, int64_t count);

// Whether this processor runs the AVX-512 path: AVX-512 F, BW and VBMI (byte permutes), as Intel
// since Ice Lake and AMD since Zen 4 have them.
bool avx512_quant_supported();

// The register tables of one code map (levels = 2^bits values, ascending; boundaries: the levels - 1
// midpoints then +inf, as QuantizedBuffer keeps them), made once per map and kept for the process
// (a few KiB). Null where the map does not fit the AVX-512 encoding (then the AVX2 path runs).
const Avx512CodeTables* avx512_code_tables(const float* map, const float* boundaries, int bits, bool is_signed);

// Whole blocks [first, last) (step.block values each, a multiple of 64, at most 256) of the fused
// step: decode, update, encode, with the same fp32 operations in the same order as the portable and
// AVX2 paths. step.m512 and step.v512 must be set. Only where avx512_quant_supported().
void adam_blocks_avx512(const BlockStep& step, int64_t first, int64_t last);

}  // namespace optim
}  // namespace frugal
