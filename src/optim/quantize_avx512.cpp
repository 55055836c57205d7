// The AVX-512 path of the fused 8- and 4-bit Adam(W) step (quantize_kernel.h). It does the update's
// fp32 operations in the order the portable and AVX2 paths do (this file, like quantize.cpp, is
// compiled with -ffp-contract=off: no multiply-add is fused), and finds the same codes, so all
// three give identical bits. What differs is how the code maps are looked up, 16 or 64 values at
// a time, in registers, never through gathers (which on AMD Zen 4 are slower than scalar loads):
//
//   4-bit decode  the 16-value map is one register: a permute by the codes widened to 32 bits.
//   4-bit encode  a binary search over the 15 midpoints (+inf) in one register: four permutes and
//                 compares, for four vectors side by side so their latencies overlap.
//   8-bit decode  byte k of all 256 map values is 256 bytes, four registers: two 128-byte permutes
//                 (VBMI's vpermi2b) and a blend look up that byte for 64 codes at once; the four
//                 bytes are interleaved back into 64 floats.
//   8-bit encode  a value's magnitude falls into a cell: its binade and as many top mantissa bits as
//                 that binade needs for no cell to hold two midpoints (1 to 449 cells, made and
//                 checked here). A 512-byte table in registers gives the code of each cell's lowest
//                 value, the midpoint above it comes from byte tables as in the 8-bit decode, and
//                 one compare finishes: the count of midpoints below the value, as searchsorted
//                 gives it (the 17-bit table of the other paths does the same with scalar loads).
//
// 64 values are decoded and updated together (four 16-lane vectors), the block's new scales taken,
// and the block encoded 64 values at a time.
#include "quantize_kernel.h"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <memory>
#include <mutex>
#include <utility>
#include <vector>

#include "../precision/x86_kernels.h"

namespace frugal {
namespace optim {

struct Avx512CodeTables {
  int bits = 8;
  // 4-bit: the map and its midpoints (+inf last), one register each.
  alignas(64) float map16[16];
  alignas(64) float bounds16[16];
  // 8-bit: byte k of each map value and of each midpoint (+inf last).
  alignas(64) uint8_t map_bytes[4][256];
  alignas(64) uint8_t bound_bytes[4][256];
  // 8-bit encode: the cell of a magnitude with bits a (binade e = a >> 23) is
  // (a >> cell_shift[e % 32]) + cell_offset[e % 32], for e at least `below`; every smaller
  // magnitude is in cell 0. cell_code: the code of the lowest value of each cell, for values >= 0
  // in [0, 256) and, with `negatives` (midpoints below 0), for values < 0 in [256, 512) (then at
  // most 256 cells); without, cells 256 to 511 continue the first half (at most 512 cells), and
  // values must not be below 0 (clamping them to 0 keeps their code, 0).
  alignas(64) int32_t cell_shift[32];
  alignas(64) int32_t cell_offset[32];
  alignas(64) uint8_t cell_code[512];
  int32_t below = 0;
  bool negatives = true;
};

namespace {

// Splits each float of `values` (256) into four byte tables.
void byte_tables(const float* values, uint8_t (*out)[256]) {
  for (int i = 0; i < 256; ++i) {
    uint32_t bits;
    std::memcpy(&bits, values + i, 4);
    for (int k = 0; k < 4; ++k) out[k][i] = static_cast<uint8_t>(bits >> (8 * k));
  }
}

float float_of(uint32_t bits) {
  float x;
  std::memcpy(&x, &bits, 4);
  return x;
}

// The 8-bit encode's cells (Avx512CodeTables). False where the map does not fit: a midpoint below
// 2^-30 or too many cells.
bool make_cells(const float* boundaries, Avx512CodeTables& t) {
  const float* first = boundaries;
  const float* last = boundaries + 255;  // the midpoints, without the +inf after them
  auto count_below = [&](float x) { return static_cast<int>(std::lower_bound(first, last, x) - first); };
  const bool negatives = boundaries[0] < 0;
  // Per binade, the mantissa bits a cell needs: no two midpoints of one sign share a cell.
  int need[128] = {};
  int lowest = 127;
  for (int sign = 0; sign < 2; ++sign) {
    uint32_t previous = 0;
    for (int i = 0; i < 255; ++i) {
      const float b = sign ? -boundaries[254 - i] : boundaries[i];  // ascending magnitudes
      if (b <= 0) continue;
      uint32_t a;
      std::memcpy(&a, &b, 4);
      const int e = static_cast<int>(a >> 23);
      if (e >= 127) return false;
      lowest = std::min(lowest, e);
      if (previous >> 23 == a >> 23) {
        const int gap_bits = 31 - __builtin_clz(a - previous);  // cells 2^gap_bits wide keep them apart
        need[e] = std::max(need[e], 23 - gap_bits);
      }
      previous = a;
    }
  }
  if (lowest < 97) return false;  // the binades below..127 must be distinct modulo 32
  t.below = lowest - 1;
  t.negatives = negatives;
  for (int i = 0; i < 32; ++i) {
    t.cell_shift[i] = 32;  // binade `below`: a >> 32 is 0 (vpsrlvd), so cell 0
    t.cell_offset[i] = 0;
  }
  // first and last magnitude bits of every cell, in order
  std::vector<std::pair<uint32_t, uint32_t>> cells = {{0u, (static_cast<uint32_t>(lowest) << 23) - 1}};
  for (int e = lowest; e <= 127; ++e) {
    const int shift = e == 127 ? 23 : 23 - need[e];  // 127: only 1.0 is left after clamping
    t.cell_shift[e % 32] = shift;
    t.cell_offset[e % 32] = static_cast<int32_t>(cells.size()) - static_cast<int32_t>((static_cast<uint32_t>(e) << 23) >> shift);
    const uint32_t width = uint32_t{1} << shift;
    for (uint32_t a = static_cast<uint32_t>(e) << 23; a < (static_cast<uint32_t>(e) + 1) << 23; a += width) {
      cells.emplace_back(a, e == 127 ? a : a + width - 1);
      if (e == 127) break;
    }
  }
  if (cells.size() > (negatives ? 256u : 512u)) return false;
  std::memset(t.cell_code, 0, sizeof t.cell_code);
  for (size_t c = 0; c < cells.size(); ++c) {
    for (int sign = 0; sign < (negatives ? 2 : 1); ++sign) {
      const float lo = sign ? -float_of(cells[c].second) : float_of(cells[c].first);
      const float hi = sign ? -float_of(cells[c].first) : float_of(cells[c].second);
      const int code = count_below(lo);
      if (count_below(hi) - code > 1) return false;  // two midpoints in one cell
      t.cell_code[sign * 256 + c] = static_cast<uint8_t>(code);
    }
  }
  return true;
}

std::unique_ptr<Avx512CodeTables> make_tables(const float* map, const float* boundaries, int bits) {
  auto t = std::make_unique<Avx512CodeTables>();
  t->bits = bits;
  if (bits == 4) {
    std::memcpy(t->map16, map, sizeof t->map16);
    std::memcpy(t->bounds16, boundaries, sizeof t->bounds16);
    return t;
  }
  byte_tables(map, t->map_bytes);
  byte_tables(boundaries, t->bound_bytes);
  if (!make_cells(boundaries, *t)) return nullptr;
  return t;
}

}  // namespace

const Avx512CodeTables* avx512_code_tables(const float* map, const float* boundaries, int bits, bool is_signed) {
  // one per (bits, signedness): the maps are fixed (dynamic_code_map), so the first buffer's serve all
  static std::mutex mutex;
  static std::unique_ptr<Avx512CodeTables> made[2][2];
  static bool tried[2][2] = {};
  std::lock_guard<std::mutex> lock(mutex);
  const int i = bits == 8 ? 1 : 0, j = is_signed ? 1 : 0;
  if (!tried[i][j]) {
    made[i][j] = make_tables(map, boundaries, bits);
    tried[i][j] = true;
  }
  return made[i][j].get();
}

#if FRUGAL_X86_KERNELS

bool avx512_quant_supported() {
  static const bool has = __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") && __builtin_cpu_supports("avx512vbmi") &&
                          __builtin_cpu_supports("avx2");
  return has;
}

#define FRUGAL_AVX512 __attribute__((target("avx512f,avx512bw,avx512vbmi,avx2")))
// GCC 12's AVX-512 intrinsics start from _mm512_undefined_*(), which it then reports as maybe
// uninitialized wherever they are inlined (a false positive of GCC 12, gone in later releases).
#pragma GCC diagnostic push
#if !defined(__clang__)
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"
#endif

namespace {

// 64 bytes in "transposed" order: byte 16L + 4r + t is value 16r + 4L + t (r: which of four
// vectors, 4L + t: its lane). Byte unpacks of such bytes give four vectors of 32-bit lanes in the
// values' natural order. The same dword permute turns natural order into this one and back.
FRUGAL_AVX512 inline __m512i transpose_dwords(__m512i x) {
  return _mm512_permutexvar_epi32(_mm512_setr_epi32(0, 4, 8, 12, 1, 5, 9, 13, 2, 6, 10, 14, 3, 7, 11, 15), x);
}

// table[i] for 64 transposed-order byte indices i: four byte tables of 256 (one per byte of a
// float), two 128-byte permutes and a blend on bit 7 each, interleaved into 64 floats.
FRUGAL_AVX512 inline void lookup_floats(const uint8_t (*bytes)[256], __m512i index, __m512 out[4]) {
  const __mmask64 upper = _mm512_movepi8_mask(index);
  __m512i b[4];
  for (int k = 0; k < 4; ++k) {
    const __m512i* t = reinterpret_cast<const __m512i*>(bytes[k]);
    b[k] = _mm512_mask_blend_epi8(upper, _mm512_permutex2var_epi8(_mm512_load_si512(t), index, _mm512_load_si512(t + 1)),
                                  _mm512_permutex2var_epi8(_mm512_load_si512(t + 2), index, _mm512_load_si512(t + 3)));
  }
  const __m512i b01_lo = _mm512_unpacklo_epi8(b[0], b[1]), b01_hi = _mm512_unpackhi_epi8(b[0], b[1]);
  const __m512i b23_lo = _mm512_unpacklo_epi8(b[2], b[3]), b23_hi = _mm512_unpackhi_epi8(b[2], b[3]);
  out[0] = _mm512_castsi512_ps(_mm512_unpacklo_epi16(b01_lo, b23_lo));
  out[1] = _mm512_castsi512_ps(_mm512_unpackhi_epi16(b01_lo, b23_lo));
  out[2] = _mm512_castsi512_ps(_mm512_unpacklo_epi16(b01_hi, b23_hi));
  out[3] = _mm512_castsi512_ps(_mm512_unpackhi_epi16(b01_hi, b23_hi));
}

// The map values of 64 codes (one byte each).
FRUGAL_AVX512 inline void decode8(const Avx512CodeTables& t, const uint8_t* codes, __m512 out[4]) {
  lookup_floats(t.map_bytes, transpose_dwords(_mm512_loadu_si512(codes)), out);
}

// The map values of 64 4-bit codes (32 bytes, low nibble first).
FRUGAL_AVX512 inline void decode4(const Avx512CodeTables& t, const uint8_t* packed, __m512 out[4]) {
  const __m512 map = _mm512_load_ps(t.map16);
  const __m256i bytes = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(packed));
  // each byte's high nibble moved to its low bits; the permute reads only the low 4 bits of a lane
  const __m256i high = _mm256_srli_epi16(bytes, 4);
  const __m256i lo = _mm256_unpacklo_epi8(bytes, high), hi = _mm256_unpackhi_epi8(bytes, high);  // codes 0-15, 32-47 | 16-31, 48-63
  out[0] = _mm512_permutexvar_ps(_mm512_cvtepu8_epi32(_mm256_castsi256_si128(lo)), map);
  out[1] = _mm512_permutexvar_ps(_mm512_cvtepu8_epi32(_mm256_castsi256_si128(hi)), map);
  out[2] = _mm512_permutexvar_ps(_mm512_cvtepu8_epi32(_mm256_extracti128_si256(lo, 1)), map);
  out[3] = _mm512_permutexvar_ps(_mm512_cvtepu8_epi32(_mm256_extracti128_si256(hi, 1)), map);
}

// 64 values (already normalized and clamped; not below 0 for a map without negatives) to codes:
// the count of midpoints below each.
FRUGAL_AVX512 inline void encode8(const Avx512CodeTables& t, const __m512 x[4], uint8_t* codes) {
  const __m512i shift_lo = _mm512_load_si512(t.cell_shift), shift_hi = _mm512_load_si512(t.cell_shift + 16);
  const __m512i offset_lo = _mm512_load_si512(t.cell_offset), offset_hi = _mm512_load_si512(t.cell_offset + 16);
  __m512i cell[4], half[4];
  for (int r = 0; r < 4; ++r) {
    const __m512i bits = _mm512_castps_si512(x[r]);
    const __m512i a = _mm512_and_si512(bits, _mm512_set1_epi32(0x7FFFFFFF));  // the magnitude
    const __m512i e = _mm512_max_epu32(_mm512_srli_epi32(a, 23), _mm512_set1_epi32(t.below));
    cell[r] = _mm512_add_epi32(_mm512_srlv_epi32(a, _mm512_permutex2var_epi32(shift_lo, e, shift_hi)),
                               _mm512_permutex2var_epi32(offset_lo, e, offset_hi));
    // negative: the table's second half (a value below 0, or, without negatives, a cell above 255)
    half[r] = t.negatives ? bits : _mm512_sub_epi32(_mm512_set1_epi32(255), cell[r]);
  }
  // to bytes in transposed order: the packs interleave four vectors that way
  const __m512i low = _mm512_set1_epi16(0xFF);
  const __m512i index = _mm512_packus_epi16(_mm512_and_si512(_mm512_packus_epi32(cell[0], cell[1]), low),
                                            _mm512_and_si512(_mm512_packus_epi32(cell[2], cell[3]), low));
  const __mmask64 second =
      _mm512_movepi8_mask(_mm512_packs_epi16(_mm512_packs_epi32(half[0], half[1]), _mm512_packs_epi32(half[2], half[3])));
  const __mmask64 upper = _mm512_movepi8_mask(index);
  const __m512i* table = reinterpret_cast<const __m512i*>(t.cell_code);
  const __m512i first_half =
      _mm512_mask_blend_epi8(upper, _mm512_permutex2var_epi8(_mm512_load_si512(table), index, _mm512_load_si512(table + 1)),
                             _mm512_permutex2var_epi8(_mm512_load_si512(table + 2), index, _mm512_load_si512(table + 3)));
  const __m512i second_half =
      _mm512_mask_blend_epi8(upper, _mm512_permutex2var_epi8(_mm512_load_si512(table + 4), index, _mm512_load_si512(table + 5)),
                             _mm512_permutex2var_epi8(_mm512_load_si512(table + 6), index, _mm512_load_si512(table + 7)));
  const __m512i code = _mm512_mask_blend_epi8(second, first_half, second_half);  // transposed order
  // one more if the midpoint above the cell's lowest value (+inf after the last) is below x
  __m512 bound[4];
  lookup_floats(t.bound_bytes, code, bound);
  __mmask64 up = 0;
  for (int r = 0; r < 4; ++r) up |= static_cast<__mmask64>(_mm512_cmp_ps_mask(bound[r], x[r], _CMP_LT_OQ)) << (16 * r);
  const __m512i natural = transpose_dwords(code);
  _mm512_storeu_si512(codes, _mm512_mask_add_epi8(natural, up, natural, _mm512_set1_epi8(1)));
}

// 64 values to 4-bit codes (32 bytes, low nibble first): a binary search over the midpoints.
FRUGAL_AVX512 inline void encode4(const Avx512CodeTables& t, const __m512 x[4], uint8_t* packed) {
  const __m512 bounds = _mm512_load_ps(t.bounds16), middle = _mm512_set1_ps(t.bounds16[7]);
  __m512i c[4];
  for (int r = 0; r < 4; ++r) c[r] = _mm512_maskz_mov_epi32(_mm512_cmp_ps_mask(middle, x[r], _CMP_LT_OQ), _mm512_set1_epi32(8));
  for (int step = 4; step >= 1; step /= 2) {
    for (int r = 0; r < 4; ++r) {
      const __m512 bound = _mm512_permutexvar_ps(_mm512_add_epi32(c[r], _mm512_set1_epi32(step - 1)), bounds);
      c[r] = _mm512_mask_add_epi32(c[r], _mm512_cmp_ps_mask(bound, x[r], _CMP_LT_OQ), c[r], _mm512_set1_epi32(step));
    }
  }
  // 64 bytes in transposed order (codes 2k and 2k + 1 stay side by side), pairs of them into one
  // byte each, and those 32 bytes put back in order: byte 8r + 2L + u is word 8L + 2r + u
  const __m512i codes = _mm512_packus_epi16(_mm512_packus_epi32(c[0], c[1]), _mm512_packus_epi32(c[2], c[3]));
  const __m512i pairs = _mm512_maddubs_epi16(codes, _mm512_set1_epi16(0x1001));  // low + 16 * high
  const __m512i order = _mm512_set_epi16(31, 30, 23, 22, 15, 14, 7, 6, 29, 28, 21, 20, 13, 12, 5, 4, 27, 26, 19, 18, 11, 10, 3, 2, 25, 24,
                                         17, 16, 9, 8, 1, 0);
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(packed), _mm512_cvtepi16_epi8(_mm512_permutexvar_epi16(order, pairs)));
}

// 16 fp32 or bf16 values.
FRUGAL_AVX512 inline __m512 load16(const float* x) { return _mm512_loadu_ps(x); }
FRUGAL_AVX512 inline __m512 load16(const uint16_t* x) {
  const __m512i wide = _mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(x)));
  return _mm512_castsi512_ps(_mm512_slli_epi32(wide, 16));
}

FRUGAL_AVX512 inline __m512i mix32(__m512i h) {  // rounding_noise.h's mix32, 16 lanes
  h = _mm512_xor_si512(h, _mm512_srli_epi32(h, 16));
  h = _mm512_mullo_epi32(h, _mm512_set1_epi32(static_cast<int>(0x85ebca6bu)));
  h = _mm512_xor_si512(h, _mm512_srli_epi32(h, 13));
  h = _mm512_mullo_epi32(h, _mm512_set1_epi32(static_cast<int>(0xc2b2ae35u)));
  return _mm512_xor_si512(h, _mm512_srli_epi32(h, 16));
}

// fp32 to bf16 as quantize.cpp's narrow_bf16: (bits + noise) >> 16, to nearest even without
// stochastic rounding; infinities stay, a NaN stays a quiet NaN of its sign. index: of lane 0.
FRUGAL_AVX512 inline void store16(uint16_t* out, __m512 value, bool stochastic, uint64_t seed, int64_t index) {
  const __m512i bits = _mm512_castps_si512(value);
  __m512i noise;
  if (stochastic) {
    const uint32_t lo0 = static_cast<uint32_t>(index), hi0 = static_cast<uint32_t>(static_cast<uint64_t>(index) >> 32);
    const __m512i base = _mm512_set1_epi32(static_cast<int>(lo0));
    const __m512i lo = _mm512_add_epi32(base, _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15));
    const __m512i hi0v = _mm512_set1_epi32(static_cast<int>(hi0));
    const __m512i hi = _mm512_mask_add_epi32(hi0v, _mm512_cmplt_epu32_mask(lo, base), hi0v, _mm512_set1_epi32(1));  // carry
    const __m512i s0 = _mm512_set1_epi32(static_cast<int>(static_cast<uint32_t>(seed)));
    const __m512i s1 = _mm512_set1_epi32(static_cast<int>(static_cast<uint32_t>(seed >> 32)));
    noise = _mm512_and_si512(mix32(_mm512_xor_si512(_mm512_xor_si512(mix32(_mm512_xor_si512(lo, s0)), s1), hi)), _mm512_set1_epi32(0xFFFF));
  } else {
    noise = _mm512_add_epi32(_mm512_set1_epi32(0x7FFF), _mm512_and_si512(_mm512_srli_epi32(bits, 16), _mm512_set1_epi32(1)));
  }
  const __m512i exponent = _mm512_set1_epi32(0x7F800000);
  const __mmask16 special = _mm512_cmpeq_epi32_mask(_mm512_and_si512(bits, exponent), exponent);
  const __mmask16 nan = _mm512_test_epi32_mask(bits, _mm512_set1_epi32(0x007FFFFF));
  const __m512i kept = _mm512_or_si512(_mm512_srli_epi32(bits, 16), _mm512_maskz_mov_epi32(nan, _mm512_set1_epi32(0x40)));
  const __m512i rounded = _mm512_srli_epi32(_mm512_add_epi32(bits, noise), 16);
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(out), _mm512_cvtepi32_epi16(_mm512_mask_blend_epi32(special, rounded, kept)));
}
FRUGAL_AVX512 inline void store16(float* out, __m512 value, bool, uint64_t, int64_t) { _mm512_storeu_ps(out, value); }

// Blocks [first, last), all whole, pipelined: while block b is decoded and updated 64 values at a
// time, block b - 1 (whose scales are then known) is encoded 64 values at a time, so the divisions
// and square roots of one overlap the permutes of the other. p and g: block `first`'s first element.
template <int Bits, class P, class G>
FRUGAL_AVX512 void blocks_avx512(const BlockStep& s, int64_t first, int64_t last, P* p, const G* g) {
  const int64_t block = s.block;
  const Avx512CodeTables &mt = *s.m512, &vt = *s.v512;
  const __m512 b1 = _mm512_set1_ps(s.b1), b2 = _mm512_set1_ps(s.b2), one_b1 = _mm512_set1_ps(s.one_b1);
  const __m512 one_b2 = _mm512_set1_ps(s.one_b2), eps = _mm512_set1_ps(s.eps), wd = _mm512_set1_ps(s.wd);
  const __m512 decay = _mm512_set1_ps(s.decay), sqrt_bc2 = _mm512_set1_ps(s.sqrt_bc2), step = _mm512_set1_ps(s.step);
  const __m512i magnitude = _mm512_set1_epi32(0x7FFFFFFF);
  const __m512 one = _mm512_set1_ps(1.0f), zero = _mm512_setzero_ps();
  // m's lower clamp is -1; for an 8-bit map without negatives, 0: it gives every value up to 0 code 0
  const __m512 m_low = _mm512_set1_ps(Bits == 8 && !mt.negatives ? 0.0f : -1.0f), v_low = zero;
  alignas(64) float m[2][256], v[2][256];  // the new moments of blocks b (b % 2) and b - 1
  __m512 inv_m = zero, inv_v = zero;       // block b - 1's
  // encodes 64 values of block `eb` from m[eb % 2], v[eb % 2]
  auto encode = [&](int64_t eb, int64_t j) FRUGAL_AVX512 {
    const float *me = m[eb & 1] + j, *ve = v[eb & 1] + j;
    __m512 xm[4], xv[4];
    for (int r = 0; r < 4; ++r) {
      // max(x, bound) gives bound for a NaN x, as the other paths' clamps do
      xm[r] = _mm512_min_ps(_mm512_max_ps(_mm512_mul_ps(_mm512_load_ps(me + 16 * r), inv_m), m_low), one);
      xv[r] = _mm512_min_ps(_mm512_max_ps(_mm512_mul_ps(_mm512_load_ps(ve + 16 * r), inv_v), v_low), one);
    }
    const int64_t at = eb * block + j;
    if (Bits == 8) {
      encode8(mt, xm, s.mc + at);
      encode8(vt, xv, s.vc + at);
    } else {
      encode4(mt, xm, s.mc + at / 2);
      encode4(vt, xv, s.vc + at / 2);
    }
  };
  for (int64_t b = first; b < last; ++b) {
    const int64_t base = b * block;
    P* pb = p + (b - first) * block;
    const G* gb = g + (b - first) * block;
    float *mb = m[b & 1], *vb = v[b & 1];
    const __m512 am = _mm512_set1_ps(s.ma[b]), av = _mm512_set1_ps(s.va[b]);
    __m512 max_m = zero, max_v = zero;
    for (int64_t j = 0; j < block; j += 64) {
      __m512 md[4], vd[4];
      if (Bits == 8) {
        decode8(mt, s.mc + base + j, md);
        decode8(vt, s.vc + base + j, vd);
      } else {
        decode4(mt, s.mc + (base + j) / 2, md);
        decode4(vt, s.vc + (base + j) / 2, vd);
      }
      for (int r = 0; r < 4; ++r) {
        const int64_t i = j + 16 * r;
        __m512 gj = load16(gb + i), pj = load16(pb + i);
        if (s.decoupled) {
          pj = _mm512_mul_ps(pj, decay);
        } else if (s.wd != 0) {
          gj = _mm512_add_ps(gj, _mm512_mul_ps(wd, pj));
        }
        const __m512 mj = _mm512_add_ps(_mm512_mul_ps(_mm512_mul_ps(md[r], am), b1), _mm512_mul_ps(one_b1, gj));
        const __m512 vj = _mm512_add_ps(_mm512_mul_ps(_mm512_mul_ps(vd[r], av), b2), _mm512_mul_ps(_mm512_mul_ps(one_b2, gj), gj));
        const __m512 denom = _mm512_add_ps(_mm512_div_ps(_mm512_sqrt_ps(vj), sqrt_bc2), eps);
        store16(pb + i, _mm512_add_ps(pj, _mm512_mul_ps(step, _mm512_div_ps(mj, denom))), s.stochastic, s.seed, base + i);
        _mm512_store_ps(mb + i, mj);
        _mm512_store_ps(vb + i, vj);
        // max(x, acc) keeps acc when x is NaN, as the other paths' maxima do
        max_m = _mm512_max_ps(_mm512_castsi512_ps(_mm512_and_si512(_mm512_castps_si512(mj), magnitude)), max_m);
        max_v = _mm512_max_ps(_mm512_castsi512_ps(_mm512_and_si512(_mm512_castps_si512(vj), magnitude)), max_v);
      }
      if (b > first) encode(b - 1, j);
    }
    const float hm = _mm512_reduce_max_ps(max_m), hv = _mm512_reduce_max_ps(max_v);  // no NaN reaches them
    s.ma[b] = hm;
    s.va[b] = hv;
    inv_m = _mm512_set1_ps(1.0f / std::max(hm, 1e-30f));
    inv_v = _mm512_set1_ps(1.0f / std::max(hv, 1e-30f));
  }
  if (last > first) {
    for (int64_t j = 0; j < block; j += 64) encode(last - 1, j);
  }
}

template <int Bits>
void blocks_bits(const BlockStep& s, int64_t first, int64_t last) {
  const int64_t offset = first * s.block - s.begin;
  if (s.pb) {
    if (s.gb) {
      blocks_avx512<Bits>(s, first, last, s.pb + offset, s.gb + offset);
    } else {
      blocks_avx512<Bits>(s, first, last, s.pb + offset, s.g + offset);
    }
  } else if (s.gb) {
    blocks_avx512<Bits>(s, first, last, s.p + offset, s.gb + offset);
  } else {
    blocks_avx512<Bits>(s, first, last, s.p + offset, s.g + offset);
  }
}

}  // namespace

void adam_blocks_avx512(const BlockStep& step, int64_t first, int64_t last) {
  if (step.bits == 8) {
    blocks_bits<8>(step, first, last);
  } else {
    blocks_bits<4>(step, first, last);
  }
}

#pragma GCC diagnostic pop

#else  // not x86-64

bool avx512_quant_supported() { return false; }
void adam_blocks_avx512(const BlockStep&, int64_t, int64_t) {}

#endif

}  // namespace optim
}  // namespace frugal
