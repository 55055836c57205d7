#include "frugal/optim/quantize.h"

#include "adam_scalars.h"
#include "bf16_avx2.h"
#include "quantize_kernel.h"
#include "rounding_noise.h"

#include "frugal/memory/tracker.h"

#include <cmath>
#include <ATen/Parallel.h>

#include "../precision/x86_kernels.h"

#include <algorithm>
#include <atomic>
#include <cstdlib>
#include <cstring>
#include <limits>
#include <map>
#include <mutex>
#include <string>
#include <tuple>
#include <vector>

namespace frugal {
namespace optim {

at::Tensor dynamic_code_map(bool is_signed, int bits) {
  TORCH_CHECK(bits == 8 || bits == 4, "dynamic_code_map: bits must be 8 or 4, got ", bits);
  // Positive magnitudes: decades 10^-k .. 10^-(k-1), each split linearly, twice as finely in each
  // larger decade (values are relative to their block's absmax), ending at exactly 1.
  //   signed (first moments): the magnitudes, the negatives of all but the smallest, and 0
  //   unsigned (second moments): only the magnitudes, no 0, so that a small second moment never
  //   rounds to zero (which would blow up its update).
  const int levels = 1 << bits;
  const int decades = bits == 8 ? 7 : 3;
  const int positives = is_signed ? levels / 2 : levels;
  std::vector<int> per(static_cast<size_t>(decades));
  int weight = 0;
  for (int i = 0; i < decades; ++i) weight += 1 << i;
  int used = 0;
  for (int i = 0; i < decades; ++i) {
    per[static_cast<size_t>(i)] = std::max(1, (positives - 1) * (1 << i) / weight);
    used += per[static_cast<size_t>(i)];
  }
  per.back() += positives - 1 - used;  // the largest decade takes the rounding rest
  std::vector<double> mags;
  for (int i = 0; i < decades; ++i) {
    const double lo = std::pow(10.0, -(decades - i)), hi = std::pow(10.0, -(decades - i - 1));
    const int n = per[static_cast<size_t>(i)];
    for (int j = 0; j < n; ++j) mags.push_back(lo + (hi - lo) * (j + 0.5) / n);
  }
  mags.push_back(1.0);  // positives entries in all
  std::vector<float> values;
  for (double m : mags) values.push_back(static_cast<float>(m));
  if (is_signed) {
    // the negatives of all but the smallest magnitude, and zero: positives + (positives - 1) + 1
    for (size_t i = 1; i < mags.size(); ++i) values.push_back(static_cast<float>(-mags[i]));
    values.push_back(0.0f);
  }
  TORCH_CHECK(static_cast<int>(values.size()) == levels, "dynamic_code_map: built ", values.size(), " entries, expected ", levels);
  at::Tensor map = at::tensor(values, at::kFloat);
  return std::get<0>(map.sort());
}

int64_t code_table_bytes(int bits) {
  const int64_t levels = int64_t{1} << bits;
  // map, boundaries, lut, lut_boundaries; 8-bit maps also the AVX2 encode table (int32 a cell)
  return levels * 4 + (levels - 1) * 4 + (int64_t{1} << 17) + levels * 4 + (bits == 8 ? (int64_t{1} << 17) * 4 : 0);
}

namespace {

// The maps and their midpoints, made once per (signedness, bits, device) and shared by all buffers
// (code_table_bytes counts them).
using SharedMap = CodeTables;

// Shared while some buffer (or an optimizer's retain_code_tables) holds them; freed with the last,
// so every run counts its own tables.
std::shared_ptr<const SharedMap> shared_map(bool is_signed, int bits, at::Device device) {
  static std::mutex mutex;
  static std::map<std::tuple<bool, int, std::string>, std::weak_ptr<const SharedMap>> cache;
  std::lock_guard<std::mutex> lock(mutex);
  auto& slot = cache[std::make_tuple(is_signed, bits, device.str())];
  if (auto alive = slot.lock()) return alive;
  auto made = std::make_shared<SharedMap>();
  SharedMap& entry = *made;
  {
    const at::Tensor map = dynamic_code_map(is_signed, bits);
    const at::Tensor boundaries = ((map.narrow(0, 1, map.size(0) - 1) + map.narrow(0, 0, map.size(0) - 1)) / 2).contiguous();
    // The code of the lowest value of every cell of fp32 values sharing their top 17 bits (sign,
    // exponent, 8 mantissa bits: 0.4% wide relative to the value). Each cell holds at most one
    // midpoint (checked here), so one comparison with the next midpoint finishes the search.
    const at::Tensor prefix = at::arange(1 << 17, at::kInt);
    const at::Tensor low_bits = prefix * (1 << 15), high_bits = low_bits + ((1 << 15) - 1);  // bits of either end
    const at::Tensor negative = prefix >= (1 << 16);
    auto codes_of = [&](const at::Tensor& bits) {
      return at::searchsorted(boundaries, bits.view(at::kFloat).nan_to_num(0.0).clamp(-1.0, 1.0));
    };
    const at::Tensor at_low = codes_of(at::where(negative, high_bits, low_bits));   // the cell's lowest value
    const at::Tensor at_high = codes_of(at::where(negative, low_bits, high_bits));  // and highest
    TORCH_CHECK((at_high - at_low).max().item<int64_t>() <= 1, "code map: a 17-bit cell holds two midpoints");
    const at::Tensor lut = at_low.to(at::kByte);
    // The midpoints and +inf after them: the comparison needs no bounds check for the last code.
    const at::Tensor lut_boundaries = at::cat({boundaries, at::full({1}, std::numeric_limits<float>::infinity())});
    at::Tensor encode;
    if (bits == 8) {
      // The same search in one look-up (encode_block8_avx2): per cell, its lowest value's code in
      // the low byte and, above it, the threshold t on the value's low 15 bits past which the
      // code is one more. Within a cell every value shares sign and top bits, so comparing with
      // the midpoint is comparing those 15 bits: as they are for a positive value, flipped for a
      // negative (whose bits grow as it falls). A cell without its midpoint (or with the +inf
      // after the last code) gets 0x7fff, which no 15 bits exceed.
      const at::Tensor code = at_low.to(at::kInt);
      const at::Tensor midpoint = lut_boundaries.index_select(0, at_low);
      const at::Tensor midpoint_bits = midpoint.view(at::kInt);
      const at::Tensor in_cell = midpoint.isfinite() & (at::bitwise_and(at::bitwise_right_shift(midpoint_bits, 15), 0x1ffff) == prefix);
      const at::Tensor threshold = at::bitwise_xor(at::bitwise_and(midpoint_bits, 0x7fff), negative.to(at::kInt) * 0x7fff);
      encode = at::bitwise_or(code, at::bitwise_left_shift(at::where(in_cell, threshold, at::full_like(threshold, 0x7fff)), 8));
      encode = encode.to(device);
    }
    entry = {map.to(device), boundaries.to(device), lut.to(device), lut_boundaries.to(device), encode};
    // Constant tables shared by every buffer of the process: not any one optimizer's state.
    for (const at::Tensor* t : {&entry.map, &entry.boundaries, &entry.lut, &entry.lut_boundaries, &entry.encode}) {
      if (t->defined()) memory::tag(*t, memory::Category::other);
    }
  }
  slot = made;
  return made;
}

}  // namespace

std::shared_ptr<const void> retain_code_tables(bool is_signed, int bits, at::Device device) {
  TORCH_CHECK(bits == 8 || bits == 4, "retain_code_tables: bits must be 8 or 4");
  return shared_map(is_signed, bits, device);
}

std::shared_ptr<const CodeTables> code_tables(bool is_signed, int bits, at::Device device) {
  TORCH_CHECK(bits == 8 || bits == 4, "code_tables: bits must be 8 or 4");
  return shared_map(is_signed, bits, device);
}

QuantizedBuffer::QuantizedBuffer(int64_t numel, int bits, int64_t block, bool is_signed, at::Device device)
    : QuantizedBuffer(numel, bits, block, is_signed, device, [device](int64_t bytes, uint8_t zero) {
        return at::full({bytes}, zero, at::TensorOptions().dtype(at::kByte).device(device));
      }) {}

QuantizedBuffer::QuantizedBuffer(int64_t numel, int bits, int64_t block, bool is_signed, at::Device device,
                                 const std::function<at::Tensor(int64_t bytes, uint8_t zero)>& make_codes)
    : numel_(numel), block_(block), bits_(bits), signed_(is_signed) {
  TORCH_CHECK(bits == 8 || bits == 4, "QuantizedBuffer: bits must be 8 or 4");
  TORCH_CHECK(block > 0 && block % 2 == 0, "QuantizedBuffer: block must be a positive even number");
  const auto shared = shared_map(is_signed, bits, device);
  tables_ = shared;
  map_ = shared->map;
  boundaries_ = shared->boundaries;
  lut_ = shared->lut;
  lut_boundaries_ = shared->lut_boundaries;
  encode_table_ = shared->encode;
  const int64_t blocks = (numel + block - 1) / block;
  const int64_t zero_code = at::searchsorted(boundaries_, at::zeros({1}, map_.options())).item<int64_t>();
  const int64_t padded = blocks * block;
  // 4-bit codes two to a byte (low nibble first): the packed zero is made directly, with no
  // one-byte-per-value buffer on the way (that was a transient as large as the parameter).
  const int64_t bytes = bits == 8 ? padded : padded / 2;
  codes_ = make_codes(bytes, static_cast<uint8_t>(bits == 8 ? zero_code : zero_code | (zero_code << 4)));
  TORCH_CHECK(codes_.scalar_type() == at::kByte && codes_.numel() == bytes, "QuantizedBuffer: codes storage of the wrong size");
  absmax_ = at::zeros({blocks}, at::TensorOptions().dtype(at::kFloat).device(device));
}

int64_t QuantizedBuffer::bytes() const { return codes_.numel() * static_cast<int64_t>(codes_.element_size()) + absmax_.numel() * 4; }

at::Tensor QuantizedBuffer::load(int64_t begin, int64_t end) const {
  TORCH_CHECK(begin % block_ == 0 && begin <= end && end <= numel_, "QuantizedBuffer::load: bad range");
  const int64_t b0 = begin / block_, b1 = (end + block_ - 1) / block_, n = (b1 - b0) * block_;
  at::Tensor codes;  // (n) int64 indices into the map
  if (bits_ == 8) {
    codes = codes_.narrow(0, b0 * block_, n).to(at::kLong);
  } else {
    const at::Tensor packed = codes_.narrow(0, b0 * block_ / 2, n / 2);
    codes = at::stack({at::bitwise_and(packed, 15), at::bitwise_right_shift(packed, 4)}, 1).reshape({n}).to(at::kLong);
  }
  const at::Tensor values = map_.index_select(0, codes).view({b1 - b0, block_}) * absmax_.narrow(0, b0, b1 - b0).unsqueeze(1);
  return values.view({n}).narrow(0, 0, end - begin);
}

void QuantizedBuffer::store(int64_t begin, int64_t end, const at::Tensor& values) {
  TORCH_CHECK(begin % block_ == 0 && begin <= end && end <= numel_, "QuantizedBuffer::store: bad range");
  TORCH_CHECK(values.numel() == end - begin, "QuantizedBuffer::store: expected ", end - begin, " values");
  const int64_t b0 = begin / block_, b1 = (end + block_ - 1) / block_, n = (b1 - b0) * block_;
  at::Tensor v = values.to(map_.device(), at::kFloat).reshape({-1});
  if (n != v.numel()) v = at::cat({v, at::zeros({n - v.numel()}, v.options())});  // the short last block
  const at::Tensor blocks = v.view({b1 - b0, block_});                            // (blocks, block)
  const at::Tensor absmax = std::get<0>(blocks.abs().max(1));                     // (blocks)
  const at::Tensor scale = absmax.clamp_min(1e-30).unsqueeze(1);
  const at::Tensor normalized = (blocks / scale).clamp(signed_ ? -1.0 : 0.0, 1.0).reshape({n});
  const at::Tensor codes = at::searchsorted(boundaries_, normalized).to(at::kByte);  // nearest entry
  absmax_.narrow(0, b0, b1 - b0).copy_(absmax);
  if (bits_ == 8) {
    codes_.narrow(0, b0 * block_, n).copy_(codes);
  } else {
    const at::Tensor pairs = codes.view({-1, 2});
    codes_.narrow(0, b0 * block_ / 2, n / 2).copy_(pairs.select(1, 0) | at::bitwise_left_shift(pairs.select(1, 1), 4));
  }
}

void QuantizedBuffer::assign(const at::Tensor& codes, const at::Tensor& absmax) {
  TORCH_CHECK(codes.scalar_type() == at::kByte && codes.numel() == codes_.numel(), "quantized state: codes of ", codes.numel(),
              " bytes, expected ", codes_.numel());
  TORCH_CHECK(absmax.numel() == absmax_.numel(), "quantized state: ", absmax.numel(), " scales, expected ", absmax_.numel());
  codes_.copy_(codes.reshape({-1}));
  absmax_.copy_(absmax.reshape({-1}).to(at::kFloat));
}

}  // namespace optim
}  // namespace frugal

namespace frugal {
namespace optim {
namespace {

// The code of the map entry nearest x (already normalized to [-1, 1]), as searchsorted over the
// midpoints gives it: the table's code for the lowest value of x's cell, plus one if x is above the
// one midpoint the cell may hold.
inline uint8_t nearest_code(float x, const uint8_t* lut, const float* boundaries) {
  uint32_t bits;
  std::memcpy(&bits, &x, 4);
  const int code = lut[bits >> 15];
  return static_cast<uint8_t>(code + (boundaries[code] < x));  // boundaries[last code] is +inf
}

// The fused step has three paths, all doing the same fp32 operations in the same order (this file
// and quantize_avx512.cpp are compiled with -ffp-contract=off, so no multiply-add is fused behind
// our back) and finding the same codes, so they give identical bits:
//   portable  per block, decode (map[code], scalar loads), update (a loop the compiler vectorises
//             for the build's target), encode (nearest_code: the 17-bit table, scalar loads).
//   AVX2      the same, with the update and the 4-bit unpacking and packing in AVX2. 4-bit codes
//             are decoded by permutes (the 16-entry map in two registers) and encoded by counting
//             the 15 midpoints below each value. The 8-bit look-ups are scalar loads eight at a
//             time into vectors (decode_block8_avx2; encode_block8_avx2, one look-up a value in
//             a table that folds the midpoint into the 17-bit table's entry): on AMD Zen 4 (EPYC)
//             a 16-lane gather is slower than 16 scalar loads (8-bit decode 0.34 against 0.29 ns
//             a value, the 17-bit table's encode 1.1 against 0.7 ns), and on Zen 3 8-lane ones too.
//   AVX-512   quantize_avx512.cpp: the code maps in registers, looked up by permutes, 64 values at
//             a time, decode, update and encode fused and pipelined across blocks.

// Codes (one byte each; 4-bit codes unpacked first) to values of the map, before scaling.
__attribute__((noinline)) void decode_block(const uint8_t* codes, const float* map, float* out, int64_t count) {
  for (int64_t j = 0; j < count; ++j) out[j] = map[codes[j]];
}

// Normalized values to codes, one byte each.
__attribute__((noinline)) void encode_block(const float* x, const uint8_t* lut, const float* boundaries, uint8_t* codes, int64_t count) {
  for (int64_t j = 0; j < count; ++j) codes[j] = nearest_code(x[j], lut, boundaries);
}

void unpack_nibbles_portable(const uint8_t* packed, uint8_t* out, int64_t count) {
  for (int64_t j = 0; j < count; j += 2) {
    out[j] = packed[j / 2] & 15;
    out[j + 1] = packed[j / 2] >> 4;
  }
}

void pack_nibbles_portable(const uint8_t* codes, uint8_t* packed, int64_t count) {
  for (int64_t j = 0; j < count; j += 2) packed[j / 2] = static_cast<uint8_t>(codes[j] | (codes[j + 1] << 4));
}

// The arithmetic of one block: m and v hold the decoded map values on entry and the normalized new
// moments on return; the block's scales are updated. Written so the compiler can vectorise it for
// any target (SSE2, NEON): constants in locals, no reduction inside the update loop, and the
// maxima kept in 8 lanes as the AVX2 version keeps them.
void update_block_portable(const BlockStep& s, int64_t b, float* __restrict m, float* __restrict v, int64_t count) {
  const float am = s.ma[b], av = s.va[b], b1 = s.b1, b2 = s.b2, one_b1 = s.one_b1, one_b2 = s.one_b2;
  const float eps = s.eps, sqrt_bc2 = s.sqrt_bc2, step = s.step;
  const float decay = s.decay, wd = s.wd;
  float* __restrict p = s.p + (b * s.block - s.begin);
  const float* __restrict g = s.g + (b * s.block - s.begin);
  for (int64_t j = 0; j < count; ++j) {
    // AdamW multiplies the parameter by its decay; Adam adds wd * p to the gradient
    const float pj = s.decoupled ? p[j] * decay : p[j];
    const float gj = s.decoupled || wd == 0 ? g[j] : g[j] + wd * p[j];
    const float mj = m[j] * am * b1 + one_b1 * gj;
    const float vj = v[j] * av * b2 + one_b2 * gj * gj;
    const float denom = std::sqrt(vj) / sqrt_bc2 + eps;
    p[j] = pj + step * (mj / denom);
    m[j] = mj;
    v[j] = vj;
  }
  for (int64_t j = count; j < s.block; ++j) m[j] = v[j] = 0.0f;  // the short last block's padding
  // x > acc ? x : acc keeps acc for a NaN x, as the AVX2 max does; the maximum of the same values
  // does not depend on the order, so both versions agree.
  float lanes_m[8] = {0, 0, 0, 0, 0, 0, 0, 0}, lanes_v[8] = {0, 0, 0, 0, 0, 0, 0, 0};
  auto take = [&](int64_t j, int k) {
    const float xm = std::fabs(m[j]), xv = std::fabs(v[j]);
    lanes_m[k] = xm > lanes_m[k] ? xm : lanes_m[k];
    lanes_v[k] = xv > lanes_v[k] ? xv : lanes_v[k];
  };
  const int64_t whole = s.block / 8 * 8;  // blocks are even, not always a multiple of 8
  for (int64_t j = 0; j < whole; j += 8) {
    for (int k = 0; k < 8; ++k) take(j + k, k);
  }
  for (int64_t j = whole; j < s.block; ++j) take(j, static_cast<int>(j & 7));
  float max_m = 0, max_v = 0;
  for (int k = 0; k < 8; ++k) {
    max_m = lanes_m[k] > max_m ? lanes_m[k] : max_m;
    max_v = lanes_v[k] > max_v ? lanes_v[k] : max_v;
  }
  s.ma[b] = max_m;
  s.va[b] = max_v;
  const float inv_m = 1.0f / std::max(max_m, 1e-30f), inv_v = 1.0f / std::max(max_v, 1e-30f);
  for (int64_t j = 0; j < s.block; ++j) {  // a NaN (from a NaN gradient) becomes the lower bound
    const float xm = m[j] * inv_m, xv = v[j] * inv_v;
    const float cm = xm > -1.0f ? xm : -1.0f, cv = xv > 0.0f ? xv : 0.0f;
    m[j] = cm < 1.0f ? cm : 1.0f;
    v[j] = cv < 1.0f ? cv : 1.0f;
  }
}

#if FRUGAL_X86_KERNELS
#define FRUGAL_AVX2 __attribute__((target("avx2")))

FRUGAL_AVX2 inline float horizontal_max(__m256 v) {
  __m128 m = _mm_max_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  m = _mm_max_ps(m, _mm_movehl_ps(m, m));
  m = _mm_max_ss(m, _mm_shuffle_ps(m, m, 1));
  return _mm_cvtss_f32(m);
}

// update_block_portable for a full block, 8 elements at a time.
FRUGAL_AVX2 void update_block_avx2(const BlockStep& s, int64_t b, float* m, float* v) {
  const __m256 am = _mm256_set1_ps(s.ma[b]), av = _mm256_set1_ps(s.va[b]);
  const __m256 b1 = _mm256_set1_ps(s.b1), b2 = _mm256_set1_ps(s.b2), one_b1 = _mm256_set1_ps(s.one_b1);
  const __m256 one_b2 = _mm256_set1_ps(s.one_b2), eps = _mm256_set1_ps(s.eps), wd = _mm256_set1_ps(s.wd);
  const __m256 decay = _mm256_set1_ps(s.decay), sqrt_bc2 = _mm256_set1_ps(s.sqrt_bc2), step = _mm256_set1_ps(s.step);
  const __m256 sign = _mm256_set1_ps(-0.0f);
  __m256 max_m = _mm256_setzero_ps(), max_v = _mm256_setzero_ps();
  float* p = s.p + (b * s.block - s.begin);
  const float* g = s.g + (b * s.block - s.begin);
  for (int64_t j = 0; j < s.block; j += 8) {
    __m256 gj = _mm256_loadu_ps(g + j), pj = _mm256_loadu_ps(p + j);
    if (s.decoupled) {
      pj = _mm256_mul_ps(pj, decay);
    } else if (s.wd != 0) {
      gj = _mm256_add_ps(gj, _mm256_mul_ps(wd, pj));
    }
    const __m256 mj = _mm256_add_ps(_mm256_mul_ps(_mm256_mul_ps(_mm256_load_ps(m + j), am), b1), _mm256_mul_ps(one_b1, gj));
    const __m256 vj =
        _mm256_add_ps(_mm256_mul_ps(_mm256_mul_ps(_mm256_load_ps(v + j), av), b2), _mm256_mul_ps(_mm256_mul_ps(one_b2, gj), gj));
    const __m256 denom = _mm256_add_ps(_mm256_div_ps(_mm256_sqrt_ps(vj), sqrt_bc2), eps);
    _mm256_storeu_ps(p + j, _mm256_add_ps(pj, _mm256_mul_ps(step, _mm256_div_ps(mj, denom))));
    _mm256_store_ps(m + j, mj);
    _mm256_store_ps(v + j, vj);
    // max(x, acc) keeps acc when x is NaN, as std::max(acc, x) does in the portable loop
    max_m = _mm256_max_ps(_mm256_andnot_ps(sign, mj), max_m);
    max_v = _mm256_max_ps(_mm256_andnot_ps(sign, vj), max_v);
  }
  const float hm = horizontal_max(max_m), hv = horizontal_max(max_v);
  s.ma[b] = hm;
  s.va[b] = hv;
  const __m256 inv_m = _mm256_set1_ps(1.0f / std::max(hm, 1e-30f)), inv_v = _mm256_set1_ps(1.0f / std::max(hv, 1e-30f));
  const __m256 one = _mm256_set1_ps(1.0f), minus_one = _mm256_set1_ps(-1.0f), zero = _mm256_setzero_ps();
  for (int64_t j = 0; j < s.block; j += 8) {
    // max(x, bound) gives bound for a NaN x, as std::max(bound, x) does
    _mm256_store_ps(m + j, _mm256_min_ps(_mm256_max_ps(_mm256_mul_ps(_mm256_load_ps(m + j), inv_m), minus_one), one));
    _mm256_store_ps(v + j, _mm256_min_ps(_mm256_max_ps(_mm256_mul_ps(_mm256_load_ps(v + j), inv_v), zero), one));
  }
}

// 4-bit codes (one a byte) to their map values: the 16-entry map in two registers, looked up
// eight at a time by permutes (each uses its index's low 3 bits; bit 3 picks the register).
FRUGAL_AVX2 void decode_block4_avx2(const uint8_t* codes, const float* map, float* out, int64_t count) {
  const __m256 low_half = _mm256_loadu_ps(map), high_half = _mm256_loadu_ps(map + 8);
  const __m256i seven = _mm256_set1_epi32(7);
  for (int64_t j = 0; j < count; j += 8) {
    const __m256i index = _mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(codes + j)));
    const __m256 high = _mm256_castsi256_ps(_mm256_cmpgt_epi32(index, seven));
    _mm256_store_ps(out + j, _mm256_blendv_ps(_mm256_permutevar8x32_ps(low_half, index), _mm256_permutevar8x32_ps(high_half, index), high));
  }
}

// Normalized values to 4-bit codes (one a byte): how many of the map's 15 midpoints lie below x,
// which is searchsorted's code and nearest_code's (a midpoint itself goes to the lower code).
FRUGAL_AVX2 void encode_block4_avx2(const float* x, const float* boundaries, uint8_t* codes, int64_t count) {
  __m256 midpoint[15];
  for (int k = 0; k < 15; ++k) midpoint[k] = _mm256_set1_ps(boundaries[k]);
  for (int64_t j = 0; j < count; j += 8) {
    const __m256 xj = _mm256_load_ps(x + j);
    __m256i below = _mm256_setzero_si256();
    for (int k = 0; k < 15; ++k) {  // a true comparison is all ones: -1
      below = _mm256_sub_epi32(below, _mm256_castps_si256(_mm256_cmp_ps(midpoint[k], xj, _CMP_LT_OQ)));
    }
    const __m128i words = _mm_packus_epi32(_mm256_castsi256_si128(below), _mm256_extracti128_si256(below, 1));
    _mm_storel_epi64(reinterpret_cast<__m128i*>(codes + j), _mm_packus_epi16(words, words));
  }
}

// 8-bit codes to their map values, eight at a time: the eight codes in one 64-bit load, their
// values gathered into one register by scalar loads, one store. (On AMD Zen 3 the compiler's form
// of decode_block, a code load, a value load and a store per value, took 0.6-0.75 ns a value; this
// 0.27; an 8-lane gather 0.45-0.6.)
FRUGAL_AVX2 void decode_block8_avx2(const uint8_t* codes, const float* map, float* out, int64_t count) {
  for (int64_t j = 0; j < count; j += 8) {
    uint64_t c;
    std::memcpy(&c, codes + j, 8);
    _mm256_store_ps(out + j, _mm256_setr_ps(map[c & 255], map[(c >> 8) & 255], map[(c >> 16) & 255], map[(c >> 24) & 255],
                                            map[(c >> 32) & 255], map[(c >> 40) & 255], map[(c >> 48) & 255], map[c >> 56]));
  }
}

// Normalized values to 8-bit codes, eight at a time, with one look-up each: the encode table's
// entry for the value's cell (scalar loads into a vector), then the comparison of the value's low
// 15 bits (flipped where negative) with the entry's threshold, and the packing to bytes, in
// vectors. nearest_code's codes for every fp32 bit pattern (QuantKernel.EncodeTableGivesTheCodesOf
// EveryFloat). Zen 3: 0.50 ns a value; nearest_code's two look-ups as scalar loads 0.64; one 8-lane
// gather 0.75.
FRUGAL_AVX2 void encode_block8_avx2(const float* x, const int32_t* table, uint8_t* codes, int64_t count) {
  const __m256i low15 = _mm256_set1_epi32(0x7fff), low8 = _mm256_set1_epi32(255);
  alignas(32) uint32_t cell[8];
  for (int64_t j = 0; j < count; j += 8) {
    const __m256i xj = _mm256_castps_si256(_mm256_loadu_ps(x + j));
    _mm256_store_si256(reinterpret_cast<__m256i*>(cell), _mm256_srli_epi32(xj, 15));
    const __m256i entry = _mm256_setr_epi32(table[cell[0]], table[cell[1]], table[cell[2]], table[cell[3]], table[cell[4]], table[cell[5]],
                                            table[cell[6]], table[cell[7]]);
    const __m256i low = _mm256_xor_si256(_mm256_and_si256(xj, low15), _mm256_and_si256(_mm256_srai_epi32(xj, 31), low15));
    // a true comparison is all ones: -1
    const __m256i code = _mm256_sub_epi32(_mm256_and_si256(entry, low8), _mm256_cmpgt_epi32(low, _mm256_srli_epi32(entry, 8)));
    const __m128i words = _mm_packus_epi32(_mm256_castsi256_si128(code), _mm256_extracti128_si256(code, 1));
    _mm_storel_epi64(reinterpret_cast<__m128i*>(codes + j), _mm_packus_epi16(words, words));
  }
}

FRUGAL_AVX2 void unpack_nibbles_avx2(const uint8_t* packed, uint8_t* out, int64_t count) {
  const __m128i low = _mm_set1_epi8(15);
  for (int64_t j = 0; j < count; j += 32) {
    const __m128i bytes = _mm_loadu_si128(reinterpret_cast<const __m128i*>(packed + j / 2));
    const __m128i lo = _mm_and_si128(bytes, low), hi = _mm_and_si128(_mm_srli_epi16(bytes, 4), low);
    _mm_storeu_si128(reinterpret_cast<__m128i*>(out + j), _mm_unpacklo_epi8(lo, hi));
    _mm_storeu_si128(reinterpret_cast<__m128i*>(out + j + 16), _mm_unpackhi_epi8(lo, hi));
  }
}

FRUGAL_AVX2 void pack_nibbles_avx2(const uint8_t* codes, uint8_t* packed, int64_t count) {
  const __m128i low = _mm_set1_epi16(0x000F), high = _mm_set1_epi16(0x00F0);
  for (int64_t j = 0; j < count; j += 32) {
    __m128i words[2];
    for (int h = 0; h < 2; ++h) {  // 16-bit lanes: code 2k in the low byte, 2k + 1 in the high one
      const __m128i pairs = _mm_loadu_si128(reinterpret_cast<const __m128i*>(codes + j + 16 * h));
      words[h] = _mm_or_si128(_mm_and_si128(pairs, low), _mm_and_si128(_mm_srli_epi16(pairs, 4), high));
    }
    _mm_storeu_si128(reinterpret_cast<__m128i*>(packed + j / 2), _mm_packus_epi16(words[0], words[1]));
  }
}

#endif

// bf16 <-> fp32 for the fused step. bf16 is the top half of fp32's bits, so widening is a shift.
void widen_bf16(const uint16_t* in, float* out, int64_t count, int64_t block) {
  for (int64_t j = 0; j < count; ++j) {
    const uint32_t bits = static_cast<uint32_t>(in[j]) << 16;
    std::memcpy(out + j, &bits, 4);
  }
  for (int64_t j = count; j < block; ++j) out[j] = 0.0f;
}

// fp32 to bf16: to nearest even, or stochastically (add 16 bits of noise, keep the top half).
// Infinities stay; a NaN stays a (quiet) NaN of the same sign.
inline __attribute__((always_inline)) void narrow_bf16_body(const float* in, uint16_t* out, int64_t count, bool stochastic, uint64_t seed,
                                                            int64_t first) {
  const uint32_t s0 = static_cast<uint32_t>(seed), s1 = static_cast<uint32_t>(seed >> 32);
  for (int64_t j = 0; j < count; ++j) {
    uint32_t bits;
    std::memcpy(&bits, in + j, 4);
    const uint64_t index = static_cast<uint64_t>(first + j);
    const uint32_t noise = stochastic ? rounding_noise(s0, s1, index) : 0x7FFFu + ((bits >> 16) & 1u);
    const bool special = (bits & 0x7F800000u) == 0x7F800000u;
    const uint32_t quiet = (bits & 0x007FFFFFu) != 0 ? 0x40u : 0u;
    out[j] = static_cast<uint16_t>(special ? (bits >> 16) | quiet : (bits + noise) >> 16);
  }
}

void narrow_bf16_portable(const float* in, uint16_t* out, int64_t count, bool stochastic, uint64_t seed, int64_t first) {
  narrow_bf16_body(in, out, count, stochastic, seed, first);
}
#if FRUGAL_X86_KERNELS
// The same eight lanes at a time (bf16_avx2.h: the dense kernels' stores), the rest as above.
__attribute__((target("avx2"))) void narrow_bf16_avx2(const float* in, uint16_t* out, int64_t count, bool stochastic, uint64_t seed,
                                                      int64_t first) {
  int64_t j = 0;
  if (stochastic) {
    for (; j + 8 <= count; j += 8) bf16_avx2::store_stochastic(out + j, _mm256_loadu_ps(in + j), seed, first + j);
  } else {
    for (; j + 8 <= count; j += 8) bf16_avx2::store_nearest(out + j, _mm256_loadu_ps(in + j));
  }
  narrow_bf16_body(in + j, out + j, count - j, stochastic, seed, first + j);
}

// widen_bf16 for a whole block (a multiple of 8 values).
__attribute__((target("avx2"))) void widen_bf16_avx2(const uint16_t* in, float* out, int64_t block) {
  for (int64_t j = 0; j < block; j += 8) _mm256_store_ps(out + j, bf16_avx2::load(in + j));
}
#endif

// What this processor can run. The environment variable FRUGAL_CPU_KERNELS=portable forces the
// portable path and =avx2 stops at AVX2 (to measure or test them on a machine that has more), as
// ATEN_CPU_CAPABILITY does for ATen's kernels.
bool cpu_supports(QuantKernel k) {
#if FRUGAL_X86_KERNELS
  static const bool avx2 = __builtin_cpu_supports("avx2");
  return k == QuantKernel::portable || (k == QuantKernel::avx2 && avx2) || (k == QuantKernel::avx512 && avx2 && avx512_quant_supported());
#else
  return k == QuantKernel::portable;
#endif
}

QuantKernel resolve(QuantKernel k) { return resolve_cpu_kernel(k, cpu_supports, quant_kernel_chosen(), "quantized-state kernel"); }

// One block: decode, update, encode. `vector`: a full block of the AVX2 path.
template <int Bits>
void adam_block(const BlockStep& step, int64_t b, bool vector) {
  const int64_t block = step.block, base = b * block, count = std::min(block, step.numel - base);
  // A bf16 parameter or gradient is widened into these, and the block is stepped on them.
  alignas(32) float pw[256], gw[256];
  BlockStep widened;
  const bool bf16 = step.pb || step.gb;
  if (bf16) {
    widened = step;
    widened.begin = base;
    widened.p = step.pb ? pw : step.p + (base - step.begin);
    widened.g = step.gb ? gw : step.g + (base - step.begin);
#if FRUGAL_X86_KERNELS
    if (vector) {
      if (step.pb) widen_bf16_avx2(step.pb + (base - step.begin), pw, block);
      if (step.gb) widen_bf16_avx2(step.gb + (base - step.begin), gw, block);
    } else
#endif
    {
      if (step.pb) widen_bf16(step.pb + (base - step.begin), pw, count, block);
      if (step.gb) widen_bf16(step.gb + (base - step.begin), gw, count, block);
    }
  }
  const BlockStep& s = bf16 ? widened : step;
  alignas(32) float m[256], v[256];
  alignas(32) uint8_t mcodes[256] = {}, vcodes[256] = {};  // 4-bit codes, one per byte
  const uint8_t *mc = s.mc + base, *vc = s.vc + base;
  if (Bits == 4) {
#if FRUGAL_X86_KERNELS
    if (vector) {
      unpack_nibbles_avx2(s.mc + base / 2, mcodes, block);
      unpack_nibbles_avx2(s.vc + base / 2, vcodes, block);
    } else
#endif
    {
      unpack_nibbles_portable(s.mc + base / 2, mcodes, block);
      unpack_nibbles_portable(s.vc + base / 2, vcodes, block);
    }
    mc = mcodes;
    vc = vcodes;
  }
#if FRUGAL_X86_KERNELS
  if (Bits == 4 && vector) {
    decode_block4_avx2(mc, s.mmap, m, count);
    decode_block4_avx2(vc, s.vmap, v, count);
  } else if (Bits == 8 && vector) {
    decode_block8_avx2(mc, s.mmap, m, count);
    decode_block8_avx2(vc, s.vmap, v, count);
  } else
#endif
  {
    decode_block(mc, s.mmap, m, count);
    decode_block(vc, s.vmap, v, count);
  }
#if FRUGAL_X86_KERNELS
  if (vector) {
    update_block_avx2(s, b, m, v);
  } else
#endif
  {
    update_block_portable(s, b, m, v, count);
  }
  if (step.pb) {
#if FRUGAL_X86_KERNELS
    if (vector) {
      narrow_bf16_avx2(pw, step.pb + (base - step.begin), count, step.stochastic, step.seed, base);
    } else
#endif
    {
      narrow_bf16_portable(pw, step.pb + (base - step.begin), count, step.stochastic, step.seed, base);
    }
  }
  if (Bits == 4) {
#if FRUGAL_X86_KERNELS
    if (vector) {
      encode_block4_avx2(m, s.mb, mcodes, block);
      encode_block4_avx2(v, s.vb, vcodes, block);
      pack_nibbles_avx2(mcodes, s.mc + base / 2, block);
      pack_nibbles_avx2(vcodes, s.vc + base / 2, block);
      return;
    }
#endif
    encode_block(m, s.mlut, s.mb, mcodes, block);
    encode_block(v, s.vlut, s.vb, vcodes, block);
    pack_nibbles_portable(mcodes, s.mc + base / 2, block);
    pack_nibbles_portable(vcodes, s.vc + base / 2, block);
    return;
  }
#if FRUGAL_X86_KERNELS
  if (vector) {
    encode_block8_avx2(m, s.menc, s.mc + base, block);
    encode_block8_avx2(v, s.venc, s.vc + base, block);
    return;
  }
#endif
  encode_block(m, s.mlut, s.mb, s.mc + base, block);
  encode_block(v, s.vlut, s.vb, s.vc + base, block);
}

template <int Bits>
void adam_blocks(const BlockStep& s, int64_t first, int64_t last, QuantKernel k, bool shared_counter) {
  // Whole blocks are [first, whole); a short last block takes the portable path.
  const int64_t whole = std::min(last, s.numel / s.block);
  const bool avx512 = k == QuantKernel::avx512 && s.block % 64 == 0 && s.m512 && s.v512;
  const bool avx2 = (k == QuantKernel::avx2 || (k == QuantKernel::avx512 && !avx512)) && s.block % 32 == 0;
  auto run = [&](int64_t b0, int64_t b1) {
    int64_t b = b0;
    if (avx512 && b < std::min(b1, whole)) {
      adam_blocks_avx512(s, b, std::min(b1, whole));
      b = std::min(b1, whole);
    }
    for (; b < b1; ++b) adam_block<Bits>(s, b, avx2 && b < whole);
  };
  if (!shared_counter) {
    at::parallel_for(first, last, 64, run);
    return;
  }
  // Through the state window, the threads take kTask blocks at a time from a shared counter rather
  // than equal shares fixed up front: a thread that the window's reader or writer preempts then
  // does less, instead of the others waiting for it at the end. Blocks are independent: same bits.
  // (State in memory keeps the fixed shares: there, at 7B, the counter's interleaved tasks were
  // not faster.)
  constexpr int64_t kTask = 64;
  const int64_t threads = std::min<int64_t>(at::get_num_threads(), (last - first + kTask - 1) / kTask);
  if (threads <= 1 || at::in_parallel_region()) {
    run(first, last);
    return;
  }
  std::atomic<int64_t> next{first};
  at::parallel_for(0, threads, 1, [&](int64_t, int64_t) {
    for (int64_t b0 = next.fetch_add(kTask); b0 < last; b0 = next.fetch_add(kTask)) run(b0, std::min(last, b0 + kTask));
  });
}

// The fused step over [begin, end) with s's parameter and gradient pointers already set.
void adam_step_fused(const AdamStep& h, BlockStep& s, QuantizedBuffer& m, QuantizedBuffer& v, int64_t begin, int64_t end,
                     QuantKernel kernel, uint8_t* m_codes = nullptr, uint8_t* v_codes = nullptr) {
  TORCH_CHECK(m.bits() == v.bits() && m.block() == v.block() && begin % m.block() == 0, "adam_step_quantized_cpu: mismatched state");
  TORCH_CHECK(m.codes().device().is_cpu(), "adam_step_quantized_cpu: the state must be on the CPU");
  TORCH_CHECK(m.block() <= 256, "adam_step_quantized_cpu: blocks of at most 256 values");
  TORCH_CHECK(end <= m.numel() && (end == m.numel() || end % m.block() == 0),
              "adam_step_quantized_cpu: the range must end on a block or at the end");
  set_adam_scalars(h, s);
  s.begin = begin;
  s.numel = end;
  s.block = m.block();
  s.mc = m.codes().data_ptr<uint8_t>();
  s.vc = v.codes().data_ptr<uint8_t>();
  if (m_codes && v_codes) {
    // The kernels index codes from value 0: the base sits begin's code bytes before the chunk's
    // buffer (as an address only; nothing outside [begin, end) is touched).
    const uintptr_t before = static_cast<uintptr_t>(m.bits() == 8 ? begin : begin / 2);
    s.mc = reinterpret_cast<uint8_t*>(reinterpret_cast<uintptr_t>(m_codes) - before);
    s.vc = reinterpret_cast<uint8_t*>(reinterpret_cast<uintptr_t>(v_codes) - before);
  }
  s.ma = m.absmax().data_ptr<float>();
  s.va = v.absmax().data_ptr<float>();
  s.mmap = m.map_data();
  s.vmap = v.map_data();
  s.mb = m.lut_boundary_data();
  s.vb = v.lut_boundary_data();
  s.mlut = m.lut();
  s.vlut = v.lut();
  s.menc = m.encode_table();
  s.venc = v.encode_table();
  s.bits = m.bits();
  const QuantKernel k = resolve(kernel);
  if (k == QuantKernel::avx512) {
    s.m512 = avx512_code_tables(s.mmap, s.mb, m.bits(), m.is_signed());
    s.v512 = avx512_code_tables(s.vmap, s.vb, v.bits(), v.is_signed());
  }
  const int64_t first = begin / s.block, last = (end + s.block - 1) / s.block;
  const bool windowed = m_codes && v_codes;  // the state window's I/O threads share the cores
  if (m.bits() == 8) {
    adam_blocks<8>(s, first, last, k, windowed);
  } else {
    adam_blocks<4>(s, first, last, k, windowed);
  }
}

}  // namespace

void encode_codes8(QuantKernel path, const QuantizedBuffer& map, const float* x, uint8_t* codes, int64_t count) {
  TORCH_CHECK(map.bits() == 8 && count % 8 == 0, "encode_codes8: an 8-bit map and a multiple of 8 values");
  const QuantKernel k = resolve(path);
  TORCH_CHECK(k != QuantKernel::avx512, "encode_codes8: the AVX-512 path encodes from registers, not these tables");
#if FRUGAL_X86_KERNELS
  if (k == QuantKernel::avx2) {
    encode_block8_avx2(x, map.encode_table(), codes, count);
    return;
  }
#endif
  encode_block(x, map.lut(), map.lut_boundary_data(), codes, count);
}

bool quant_kernel_supported(QuantKernel k) { return k == QuantKernel::automatic || cpu_supports(k); }

QuantKernel quant_kernel_chosen() {
  static const QuantKernel chosen = choose_cpu_kernel(cpu_supports);
  return chosen;
}

bool quant_kernel_vectorized() { return quant_kernel_chosen() != QuantKernel::portable; }

void adam_step_quantized_cpu(const AdamStep& h, float* p, const float* g, QuantizedBuffer& m, QuantizedBuffer& v, int64_t begin,
                             int64_t end, QuantKernel kernel) {
  BlockStep s;
  s.p = p;
  s.g = g;
  adam_step_fused(h, s, m, v, begin, end, kernel);
}

void adam_step_quantized_cpu(const AdamStep& h, const at::Tensor& p, const at::Tensor& g, QuantizedBuffer& m, QuantizedBuffer& v,
                             int64_t begin, int64_t end, const Bf16Rounding& rounding, QuantKernel kernel, uint8_t* m_codes,
                             uint8_t* v_codes) {
  auto check = [&](const at::Tensor& t, const char* what) {
    TORCH_CHECK(t.device().is_cpu() && t.is_contiguous() && t.numel() == end - begin &&
                    (t.scalar_type() == at::kFloat || t.scalar_type() == at::kBFloat16),
                "adam_step_quantized_cpu: the ", what, " must be a contiguous fp32 or bf16 CPU tensor of ", end - begin, " elements");
  };
  check(p, "parameter");
  check(g, "gradient");
  BlockStep s;
  const bool p16 = p.scalar_type() == at::kBFloat16, g16 = g.scalar_type() == at::kBFloat16;
  s.p = p16 ? nullptr : p.data_ptr<float>();
  s.pb = p16 ? reinterpret_cast<uint16_t*>(p.data_ptr<at::BFloat16>()) : nullptr;
  s.g = g16 ? nullptr : g.data_ptr<float>();
  s.gb = g16 ? reinterpret_cast<const uint16_t*>(g.data_ptr<at::BFloat16>()) : nullptr;
  s.stochastic = rounding.stochastic;
  s.seed = rounding.seed;
  adam_step_fused(h, s, m, v, begin, end, kernel, m_codes, v_codes);
}

}  // namespace optim
}  // namespace frugal
