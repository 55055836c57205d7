#include "frugal/loss/cross_entropy_rows.h"

#include <ATen/Parallel.h>
#include <c10/util/Exception.h>

#include "../precision/exp_nonpositive.h"
#include "../precision/x86_kernels.h"

#include <algorithm>
#include <cmath>
#include <cstdlib>
#include <cstring>
#include <limits>
#include <string>
#include <vector>

namespace frugal {
namespace loss {
namespace {

using namespace precision::exp_constants;
using precision::exp_nonpositive;

// Portable rows: eight independent lanes (no reduction order the compiler must keep across
// iterations), which it can vectorise for any target.
float row_max_portable(const float* x, int64_t V) {
  float lanes[8];
  for (float& l : lanes) l = -std::numeric_limits<float>::infinity();
  const int64_t whole = V / 8 * 8;
  for (int64_t j = 0; j < whole; j += 8) {
    for (int k = 0; k < 8; ++k) lanes[k] = x[j + k] > lanes[k] ? x[j + k] : lanes[k];
  }
  for (int64_t j = whole; j < V; ++j) lanes[j - whole] = x[j] > lanes[j - whole] ? x[j] : lanes[j - whole];
  float m = lanes[0];
  for (int k = 1; k < 8; ++k) m = lanes[k] > m ? lanes[k] : m;
  return m;
}

float row_sum_exp_portable(const float* x, int64_t V, float shift) {
  float lanes[8] = {0, 0, 0, 0, 0, 0, 0, 0};
  const int64_t whole = V / 8 * 8;
  for (int64_t j = 0; j < whole; j += 8) {
    for (int k = 0; k < 8; ++k) lanes[k] += exp_nonpositive(x[j + k] - shift);
  }
  for (int64_t j = whole; j < V; ++j) lanes[j - whole] += exp_nonpositive(x[j] - shift);
  float s = 0;
  for (int k = 0; k < 8; ++k) s += lanes[k];
  return s;
}

void row_exp_scale_portable(const float* x, float* y, int64_t V, float shift, float scale) {
  for (int64_t j = 0; j < V; ++j) y[j] = exp_nonpositive(x[j] - shift) * scale;
}

#if FRUGAL_X86_KERNELS
#define FRUGAL_AVX2 __attribute__((target("avx2,fma")))
#define FRUGAL_AVX512 __attribute__((target("avx512f")))

// exp_nonpositive, 8 lanes: the same reduction and polynomial, with fused multiply-adds.
FRUGAL_AVX2 inline __m256 exp_nonpositive_avx2(__m256 x) {
  const __m256 n = _mm256_round_ps(_mm256_mul_ps(x, _mm256_set1_ps(kLog2e)), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m256 r = _mm256_fnmadd_ps(n, _mm256_set1_ps(kLn2Hi), x);
  r = _mm256_fnmadd_ps(n, _mm256_set1_ps(kLn2Lo), r);
  __m256 p = _mm256_set1_ps(kC7);
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(kC6));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(kC5));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(kC4));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(kC3));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(kC2));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.0f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.0f));
  // n is an integer in [-126, 0] where the result is kept, so its conversion is exact
  const __m256i bits = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
  const __m256 y = _mm256_mul_ps(p, _mm256_castsi256_ps(bits));
  const __m256 tiny = _mm256_cmp_ps(x, _mm256_set1_ps(kExpMin), _CMP_LT_OQ);  // false for NaN
  return _mm256_andnot_ps(tiny, y);
}

FRUGAL_AVX2 inline float sum8(__m256 v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  s = _mm_add_ss(s, _mm_shuffle_ps(s, s, 1));
  return _mm_cvtss_f32(s);
}

FRUGAL_AVX2 inline float max8(__m256 v) {
  __m128 m = _mm_max_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  m = _mm_max_ps(m, _mm_movehl_ps(m, m));
  m = _mm_max_ss(m, _mm_shuffle_ps(m, m, 1));
  return _mm_cvtss_f32(m);
}

FRUGAL_AVX2 float row_max_avx2(const float* x, int64_t V) {
  __m256 a = _mm256_set1_ps(-std::numeric_limits<float>::infinity()), b = a;
  int64_t j = 0;
  for (; j + 16 <= V; j += 16) {
    a = _mm256_max_ps(_mm256_loadu_ps(x + j), a);  // max(x, acc) keeps acc when x is NaN
    b = _mm256_max_ps(_mm256_loadu_ps(x + j + 8), b);
  }
  if (j + 8 <= V) {
    a = _mm256_max_ps(_mm256_loadu_ps(x + j), a);
    j += 8;
  }
  float m = max8(_mm256_max_ps(a, b));
  for (; j < V; ++j) m = x[j] > m ? x[j] : m;
  return m;
}

FRUGAL_AVX2 float row_sum_exp_avx2(const float* x, int64_t V, float shift) {
  const __m256 s = _mm256_set1_ps(shift);
  __m256 a = _mm256_setzero_ps(), b = _mm256_setzero_ps();
  int64_t j = 0;
  for (; j + 16 <= V; j += 16) {
    a = _mm256_add_ps(a, exp_nonpositive_avx2(_mm256_sub_ps(_mm256_loadu_ps(x + j), s)));
    b = _mm256_add_ps(b, exp_nonpositive_avx2(_mm256_sub_ps(_mm256_loadu_ps(x + j + 8), s)));
  }
  if (j + 8 <= V) {
    a = _mm256_add_ps(a, exp_nonpositive_avx2(_mm256_sub_ps(_mm256_loadu_ps(x + j), s)));
    j += 8;
  }
  float sum = sum8(_mm256_add_ps(a, b));
  for (; j < V; ++j) sum += exp_nonpositive(x[j] - shift);
  return sum;
}

FRUGAL_AVX2 void row_exp_scale_avx2(const float* x, float* y, int64_t V, float shift, float scale) {
  const __m256 s = _mm256_set1_ps(shift), c = _mm256_set1_ps(scale);
  int64_t j = 0;
  for (; j + 8 <= V; j += 8) {
    _mm256_storeu_ps(y + j, _mm256_mul_ps(exp_nonpositive_avx2(_mm256_sub_ps(_mm256_loadu_ps(x + j), s)), c));
  }
  for (; j < V; ++j) y[j] = exp_nonpositive(x[j] - shift) * scale;
}

// GCC 12 warns, under -Wall, that the undefined pass-through operand of several unmasked AVX-512
// intrinsics may be used uninitialized: their zero-masking forms with every lane set are used
// instead, and the horizontal reductions go through memory.
constexpr __mmask16 kAllLanes = 0xFFFF;

FRUGAL_AVX512 inline __m512 max16(__m512 a, __m512 b) { return _mm512_maskz_max_ps(kAllLanes, a, b); }

FRUGAL_AVX512 inline float reduce_max16(__m512 v) {
  alignas(64) float lanes[16];
  _mm512_store_ps(lanes, v);
  float m = lanes[0];
  for (int k = 1; k < 16; ++k) m = lanes[k] > m ? lanes[k] : m;
  return m;
}

FRUGAL_AVX512 inline float reduce_add16(__m512 v) {
  alignas(64) float lanes[16];
  _mm512_store_ps(lanes, v);
  float s = 0;
  for (int k = 0; k < 16; ++k) s += lanes[k];
  return s;
}

// exp_nonpositive, 16 lanes.
FRUGAL_AVX512 inline __m512 exp_nonpositive_avx512(__m512 x) {
  const __mmask16 all = kAllLanes;
  const __m512 n = _mm512_maskz_roundscale_ps(all, _mm512_mul_ps(x, _mm512_set1_ps(kLog2e)), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(kLn2Hi), x);
  r = _mm512_fnmadd_ps(n, _mm512_set1_ps(kLn2Lo), r);
  __m512 p = _mm512_set1_ps(kC7);
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(kC6));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(kC5));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(kC4));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(kC3));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(kC2));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f));
  const __m512i bits = _mm512_maskz_slli_epi32(all, _mm512_add_epi32(_mm512_maskz_cvtps_epi32(all, n), _mm512_set1_epi32(127)), 23);
  const __mmask16 kept = _mm512_cmp_ps_mask(x, _mm512_set1_ps(kExpMin), _CMP_NLT_UQ);  // true for NaN
  return _mm512_maskz_mul_ps(kept, p, _mm512_castsi512_ps(bits));
}

FRUGAL_AVX512 inline __mmask16 tail_mask(int64_t count) {  // the first count (< 16) lanes
  return static_cast<__mmask16>((1u << count) - 1u);
}

FRUGAL_AVX512 float row_max_avx512(const float* x, int64_t V) {
  const __m512 lowest = _mm512_set1_ps(-std::numeric_limits<float>::infinity());
  __m512 a = lowest, b = lowest;
  int64_t j = 0;
  for (; j + 32 <= V; j += 32) {
    a = max16(_mm512_loadu_ps(x + j), a);  // max(x, acc) keeps acc when x is NaN
    b = max16(_mm512_loadu_ps(x + j + 16), b);
  }
  for (; j + 16 <= V; j += 16) a = max16(_mm512_loadu_ps(x + j), a);
  if (j < V) b = max16(_mm512_mask_loadu_ps(lowest, tail_mask(V - j), x + j), b);
  return reduce_max16(max16(a, b));
}

FRUGAL_AVX512 float row_sum_exp_avx512(const float* x, int64_t V, float shift) {
  const __m512 s = _mm512_set1_ps(shift);
  __m512 a = _mm512_setzero_ps(), b = _mm512_setzero_ps();
  int64_t j = 0;
  for (; j + 32 <= V; j += 32) {
    a = _mm512_add_ps(a, exp_nonpositive_avx512(_mm512_sub_ps(_mm512_loadu_ps(x + j), s)));
    b = _mm512_add_ps(b, exp_nonpositive_avx512(_mm512_sub_ps(_mm512_loadu_ps(x + j + 16), s)));
  }
  for (; j + 16 <= V; j += 16) a = _mm512_add_ps(a, exp_nonpositive_avx512(_mm512_sub_ps(_mm512_loadu_ps(x + j), s)));
  if (j < V) {
    const __mmask16 m = tail_mask(V - j);
    const __m512 e = exp_nonpositive_avx512(_mm512_sub_ps(_mm512_maskz_loadu_ps(m, x + j), s));
    b = _mm512_mask_add_ps(b, m, b, e);
  }
  return reduce_add16(_mm512_add_ps(a, b));
}

FRUGAL_AVX512 void row_exp_scale_avx512(const float* x, float* y, int64_t V, float shift, float scale) {
  const __m512 s = _mm512_set1_ps(shift), c = _mm512_set1_ps(scale);
  int64_t j = 0;
  for (; j + 16 <= V; j += 16) {
    _mm512_storeu_ps(y + j, _mm512_mul_ps(exp_nonpositive_avx512(_mm512_sub_ps(_mm512_loadu_ps(x + j), s)), c));
  }
  if (j < V) {
    const __mmask16 m = tail_mask(V - j);
    const __m512 e = exp_nonpositive_avx512(_mm512_sub_ps(_mm512_maskz_loadu_ps(m, x + j), s));
    _mm512_mask_storeu_ps(y + j, m, _mm512_mul_ps(e, c));
  }
}

bool cpu_supports(RowKernel kernel) {
  // the operating system must save the wide registers too; __builtin_cpu_supports checks that
  if (kernel == RowKernel::avx512) return __builtin_cpu_supports("avx512f");
  if (kernel == RowKernel::avx2) return __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma");
  return true;
}
#else
bool cpu_supports(RowKernel kernel) { return kernel == RowKernel::automatic || kernel == RowKernel::portable; }
#endif

struct RowFunctions {
  float (*max)(const float*, int64_t);
  float (*sum_exp)(const float*, int64_t, float);
  void (*exp_scale)(const float*, float*, int64_t, float, float);  // y = exp(x - shift) * scale
};

RowFunctions functions_for(RowKernel kernel) {
  switch (resolve_row_kernel(kernel)) {
#if FRUGAL_X86_KERNELS
    case RowKernel::avx512: return {row_max_avx512, row_sum_exp_avx512, row_exp_scale_avx512};
    case RowKernel::avx2: return {row_max_avx2, row_sum_exp_avx2, row_exp_scale_avx2};
#endif
    default: return {row_max_portable, row_sum_exp_portable, row_exp_scale_portable};
  }
}

// Rows per task: enough that a thread's share outweighs waking it.
int64_t grain_rows(int64_t V) { return std::max<int64_t>(1, 32768 / std::max<int64_t>(V, 1)); }

}  // namespace

bool row_kernel_available(RowKernel kernel) { return cpu_supports(kernel); }

RowKernel resolve_row_kernel(RowKernel kernel) {
  if (kernel != RowKernel::automatic) return kernel;
  static const RowKernel chosen = [] {
    const char* choice = std::getenv("FRUGAL_CPU_KERNELS");
    if (choice && std::string(choice) == "portable") return RowKernel::portable;
    if (cpu_supports(RowKernel::avx512)) return RowKernel::avx512;
    if (cpu_supports(RowKernel::avx2)) return RowKernel::avx2;
    return RowKernel::portable;
  }();
  return chosen;
}

double cross_entropy_rows_forward(const float* logits, int64_t n, int64_t V, int64_t stride, const int64_t* targets, int64_t ignore_index,
                                  float* lse, RowKernel kernel) {
  TORCH_CHECK(row_kernel_available(kernel), "cross_entropy_rows_forward: this processor cannot run the kernel asked for");
  const RowFunctions f = functions_for(kernel);
  std::vector<double> row_loss(static_cast<size_t>(n));
  at::parallel_for(0, n, grain_rows(V), [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      const int64_t t = targets[r];
      if (t == ignore_index) {
        lse[r] = 0.0f;
        row_loss[r] = 0.0;
        continue;
      }
      const float* x = logits + r * stride;
      const float m = f.max(x, V);
      const double l = static_cast<double>(m) + std::log(static_cast<double>(f.sum_exp(x, V, m)));
      lse[r] = static_cast<float>(l);
      row_loss[r] = l - static_cast<double>(x[t]);
    }
  });
  double total = 0;  // summed in row order: the same for any number of threads
  for (const double l : row_loss) total += l;
  return total;
}

void cross_entropy_rows_backward(const float* logits, float* grad, int64_t n, int64_t V, int64_t stride, const int64_t* targets,
                                 int64_t ignore_index, const float* lse, float scale, RowKernel kernel) {
  TORCH_CHECK(row_kernel_available(kernel), "cross_entropy_rows_backward: this processor cannot run the kernel asked for");
  const RowFunctions f = functions_for(kernel);
  at::parallel_for(0, n, grain_rows(V), [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      float* y = grad + r * stride;
      const int64_t t = targets[r];
      if (t == ignore_index) {
        std::fill(y, y + V, 0.0f);
        continue;
      }
      f.exp_scale(logits + r * stride, y, V, lse[r], scale);
      y[t] -= scale;
    }
  });
}

}  // namespace loss
}  // namespace frugal
