// The fused dense CPU steps of Adam(W) and SGD (adam_kernel.h). The arithmetic is written once
// (adam_kernel_lanes.inc) over three lane types: 16 fp32 lanes of AVX-512F, 8 of AVX2 (+FMA), and
// one float for the portable loop. This file is compiled with -ffp-contract=off (CMakeLists.txt),
// so the compiler fuses no multiply and add on its own: the fused multiply-adds are exactly the
// ones written (V::fma), where LibTorch's add and addcmul end in one (measured on Debian's 1.13:
// its a + alpha*b and a + (s*b)*c come out as fma(b, alpha, a) and fma(s*b, c, a), bit for bit,
// the compiler having contracted them), and the three paths agree bit for bit.
#include "adam_kernel.h"

#include "adam_scalars.h"
#include "bf16_avx2.h"
#include "rounding_noise.h"

#include <ATen/Parallel.h>
#ifdef _OPENMP
#include <omp.h>
#endif

#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <string>
#include <type_traits>
#include <vector>

#include "../precision/x86_kernels.h"

namespace frugal {
namespace optim {
namespace {

// One Adam(W) step's constants in fp32 (set_adam_scalars fills the first ten) and its bf16 rounding.
struct AdamScalars {
  float b1, b2, one_b1, one_b2, eps, wd, decay, sqrt_bc2, step;
  bool decoupled;
  bool l2 = false;           // Adam with weight decay: g += wd*p
  bool decay_param = false;  // AdamW with weight decay: p *= 1 - lr*wd
  bool stochastic = false;   // a bf16 parameter rounded stochastically with `seed`
  uint64_t seed = 0;
  int64_t first_index = 0;  // of p's first element in its parameter, for the noise
};

// One SGD step's constants as ATen casts them (alpha and multipliers to fp32).
struct SgdScalars {
  float wd, momentum, one_damp, neg_lr;
  bool nesterov, first;
};

// Element 0 of each tensor (bf16 as its bits), and which are bf16. SGD: m is the momentum buffer.
struct DenseRefs {
  void* p;
  const void* g;
  void* m;
  void* v;
  bool p16, g16, s16;
};

// bf16 is the top half of an fp32's bits.
inline float widen_bf16(uint16_t b) {
  const uint32_t bits = static_cast<uint32_t>(b) << 16;
  float x;
  std::memcpy(&x, &bits, 4);
  return x;
}

// The 16 bits of noise of element `index` under `seed` (rounding_noise.h: every kernel's).
inline uint32_t bf16_noise(uint64_t seed, uint64_t index) {
  return rounding_noise(static_cast<uint32_t>(seed), static_cast<uint32_t>(seed >> 32), index);
}

// fp32 bits to bf16: (bits + noise) >> 16; infinities stay, a NaN stays a quiet NaN of its sign.
// noise 0x7FFF + the kept lowest bit rounds to nearest even.
inline uint16_t narrow_bits(uint32_t bits, uint32_t noise) {
  if ((bits & 0x7F800000u) == 0x7F800000u) return static_cast<uint16_t>((bits >> 16) | ((bits & 0x007FFFFFu) != 0 ? 0x40u : 0u));
  return static_cast<uint16_t>((bits + noise) >> 16);
}

struct PortableLanes {
  using F = float;
  static constexpr int64_t W = 1;
  static F set1(float x) { return x; }
  static F load(const float* x) { return *x; }
  static F load(const uint16_t* x) { return widen_bf16(*x); }
  static void store(float* x, F v) { *x = v; }
  static void store(uint16_t* x, F v) {
    uint32_t bits;
    std::memcpy(&bits, &v, 4);
    *x = narrow_bits(bits, 0x7FFFu + ((bits >> 16) & 1u));
  }
  static void store_stochastic(uint16_t* x, F v, uint64_t seed, int64_t index) {
    uint32_t bits;
    std::memcpy(&bits, &v, 4);
    *x = narrow_bits(bits, bf16_noise(seed, static_cast<uint64_t>(index)));
  }
  static F add(F a, F b) { return a + b; }
  static F mul(F a, F b) { return a * b; }
  static F div(F a, F b) { return a / b; }
  static F sqrt(F a) { return std::sqrt(a); }
  static F fma(F a, F b, F c) { return std::fma(a, b, c); }
};

namespace portable {
using V = PortableLanes;
#define FRUGAL_KERNEL_TARGET
#include "adam_kernel_lanes.inc"
#undef FRUGAL_KERNEL_TARGET
}  // namespace portable

#if FRUGAL_X86_KERNELS
#define FRUGAL_AVX2 __attribute__((target("avx2,fma")))

struct Avx2Lanes {
  using F = __m256;
  static constexpr int64_t W = 8;
  FRUGAL_AVX2 static F set1(float x) { return _mm256_set1_ps(x); }
  FRUGAL_AVX2 static F load(const float* x) { return _mm256_loadu_ps(x); }
  FRUGAL_AVX2 static F load(const uint16_t* x) { return bf16_avx2::load(x); }
  FRUGAL_AVX2 static void store(float* x, F v) { _mm256_storeu_ps(x, v); }
  FRUGAL_AVX2 static void store(uint16_t* x, F v) { bf16_avx2::store_nearest(x, v); }
  FRUGAL_AVX2 static void store_stochastic(uint16_t* x, F v, uint64_t seed, int64_t index) {
    bf16_avx2::store_stochastic(x, v, seed, index);
  }
  FRUGAL_AVX2 static F add(F a, F b) { return _mm256_add_ps(a, b); }
  FRUGAL_AVX2 static F mul(F a, F b) { return _mm256_mul_ps(a, b); }
  FRUGAL_AVX2 static F div(F a, F b) { return _mm256_div_ps(a, b); }
  FRUGAL_AVX2 static F sqrt(F a) { return _mm256_sqrt_ps(a); }
  FRUGAL_AVX2 static F fma(F a, F b, F c) { return _mm256_fmadd_ps(a, b, c); }
};

namespace avx2 {
using V = Avx2Lanes;
#define FRUGAL_KERNEL_TARGET FRUGAL_AVX2
#include "adam_kernel_lanes.inc"
#undef FRUGAL_KERNEL_TARGET
}  // namespace avx2

#define FRUGAL_AVX512 __attribute__((target("avx512f,avx2,fma")))
// GCC 12.2's AVX-512 intrinsics start from _mm512_undefined_*(), which it then reports as maybe
// uninitialized wherever they are inlined (a false positive of GCC 12, gone in later releases).
#pragma GCC diagnostic push
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"

struct Avx512Lanes {
  using F = __m512;
  static constexpr int64_t W = 16;
  FRUGAL_AVX512 static F set1(float x) { return _mm512_set1_ps(x); }
  FRUGAL_AVX512 static F load(const float* x) { return _mm512_loadu_ps(x); }
  FRUGAL_AVX512 static F load(const uint16_t* x) {
    const __m512i wide = _mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(x)));
    return _mm512_castsi512_ps(_mm512_slli_epi32(wide, 16));
  }
  FRUGAL_AVX512 static void store(float* x, F v) { _mm512_storeu_ps(x, v); }
  FRUGAL_AVX512 static void store_bits(uint16_t* x, __m512i bits, __m512i noise) {
    const __m512i exponent = _mm512_set1_epi32(0x7F800000);
    const __mmask16 special = _mm512_cmpeq_epi32_mask(_mm512_and_si512(bits, exponent), exponent);
    const __mmask16 nan = _mm512_test_epi32_mask(bits, _mm512_set1_epi32(0x007FFFFF));
    const __m512i kept = _mm512_or_si512(_mm512_srli_epi32(bits, 16), _mm512_maskz_mov_epi32(nan, _mm512_set1_epi32(0x40)));
    const __m512i rounded = _mm512_srli_epi32(_mm512_add_epi32(bits, noise), 16);
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(x), _mm512_cvtepi32_epi16(_mm512_mask_blend_epi32(special, rounded, kept)));
  }
  FRUGAL_AVX512 static void store(uint16_t* x, F v) {
    const __m512i bits = _mm512_castps_si512(v);
    const __m512i lowest_kept = _mm512_and_si512(_mm512_srli_epi32(bits, 16), _mm512_set1_epi32(1));
    store_bits(x, bits, _mm512_add_epi32(_mm512_set1_epi32(0x7FFF), lowest_kept));
  }
  FRUGAL_AVX512 static __m512i mix(__m512i h) {
    h = _mm512_xor_si512(h, _mm512_srli_epi32(h, 16));
    h = _mm512_mullo_epi32(h, _mm512_set1_epi32(static_cast<int>(0x85ebca6bu)));
    h = _mm512_xor_si512(h, _mm512_srli_epi32(h, 13));
    h = _mm512_mullo_epi32(h, _mm512_set1_epi32(static_cast<int>(0xc2b2ae35u)));
    return _mm512_xor_si512(h, _mm512_srli_epi32(h, 16));
  }
  FRUGAL_AVX512 static void store_stochastic(uint16_t* x, F v, uint64_t seed, int64_t index) {
    const uint32_t lo0 = static_cast<uint32_t>(index), hi0 = static_cast<uint32_t>(static_cast<uint64_t>(index) >> 32);
    const __m512i base = _mm512_set1_epi32(static_cast<int>(lo0));
    const __m512i lo = _mm512_add_epi32(base, _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15));
    const __m512i hi0v = _mm512_set1_epi32(static_cast<int>(hi0));
    const __m512i hi = _mm512_mask_add_epi32(hi0v, _mm512_cmplt_epu32_mask(lo, base), hi0v, _mm512_set1_epi32(1));
    const __m512i s0 = _mm512_set1_epi32(static_cast<int>(static_cast<uint32_t>(seed)));
    const __m512i s1 = _mm512_set1_epi32(static_cast<int>(static_cast<uint32_t>(seed >> 32)));
    const __m512i h = mix(_mm512_xor_si512(_mm512_xor_si512(mix(_mm512_xor_si512(lo, s0)), s1), hi));
    store_bits(x, _mm512_castps_si512(v), _mm512_and_si512(h, _mm512_set1_epi32(0xFFFF)));
  }
  FRUGAL_AVX512 static F add(F a, F b) { return _mm512_add_ps(a, b); }
  FRUGAL_AVX512 static F mul(F a, F b) { return _mm512_mul_ps(a, b); }
  FRUGAL_AVX512 static F div(F a, F b) { return _mm512_div_ps(a, b); }
  FRUGAL_AVX512 static F sqrt(F a) { return _mm512_sqrt_ps(a); }
  FRUGAL_AVX512 static F fma(F a, F b, F c) { return _mm512_fmadd_ps(a, b, c); }
};

namespace avx512 {
using V = Avx512Lanes;
#define FRUGAL_KERNEL_TARGET FRUGAL_AVX512
#include "adam_kernel_lanes.inc"
#undef FRUGAL_KERNEL_TARGET
}  // namespace avx512
#pragma GCC diagnostic pop
#endif

bool cpu_supports(DenseKernel k) {
#if FRUGAL_X86_KERNELS
  static const bool avx2 = __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma");
  static const bool avx512 = avx2 && __builtin_cpu_supports("avx512f");
  return k == DenseKernel::portable || (k == DenseKernel::avx2 && avx2) || (k == DenseKernel::avx512 && avx512);
#else
  return k == DenseKernel::portable;
#endif
}

DenseKernel resolve(DenseKernel k) { return resolve_cpu_kernel(k, cpu_supports, dense_kernel_chosen(), "optimizer kernel"); }

}  // namespace

void use_intra_op_threads_on_this_thread(int threads) {
  // A thread's first parallel loop sets its OpenMP count to ATen's global one, once for LibTorch's
  // own loops and once for the inline ones compiled here: both happen first, so the count set last stays.
  (void)at::get_num_threads();
  at::parallel_for(0, 2, 1, [](int64_t, int64_t) {});
#ifdef _OPENMP
  omp_set_num_threads(threads);
#else
  (void)threads;
#endif
}

namespace {

// Threads over groups of 64 elements (a whole number of vectors per thread), at least 32K a thread.
template <class Scalars>
void run(void (*const fns[3])(const Scalars&, const DenseRefs&, int64_t, int64_t), DenseKernel kernel, const Scalars& s, const DenseRefs& r,
         int64_t n) {
  const DenseKernel k = resolve(kernel);
  auto fn = fns[k == DenseKernel::avx512 ? 2 : k == DenseKernel::avx2 ? 1 : 0];
  constexpr int64_t group = 64;
  at::parallel_for(0, (n + group - 1) / group, 32768 / group, [&](int64_t b, int64_t e) { fn(s, r, b * group, std::min(n, e * group)); });
}

#if FRUGAL_X86_KERNELS
void (*const kAdam[3])(const AdamScalars&, const DenseRefs&, int64_t, int64_t) = {portable::adam_dispatch, avx2::adam_dispatch,
                                                                                  avx512::adam_dispatch};
void (*const kSgd[3])(const SgdScalars&, const DenseRefs&, int64_t, int64_t) = {portable::sgd_dispatch, avx2::sgd_dispatch,
                                                                                avx512::sgd_dispatch};
#else
void (*const kAdam[3])(const AdamScalars&, const DenseRefs&, int64_t, int64_t) = {portable::adam_dispatch, portable::adam_dispatch,
                                                                                  portable::adam_dispatch};
void (*const kSgd[3])(const SgdScalars&, const DenseRefs&, int64_t, int64_t) = {portable::sgd_dispatch, portable::sgd_dispatch,
                                                                                portable::sgd_dispatch};
#endif

bool dense(const at::Tensor& t, int64_t n, bool bf16_allowed) {
  return t.defined() && t.device().is_cpu() && t.is_contiguous() && t.numel() == n &&
         (t.scalar_type() == at::kFloat || (bf16_allowed && t.scalar_type() == at::kBFloat16));
}

// Written through raw pointers: count it as ATen's in-place operations do, so autograd still sees
// that a tensor it saved (a parameter) changed.
void mark_written(const at::Tensor& t) {
  if (t.defined()) t.unsafeGetTensorImpl()->bump_version();
}

}  // namespace

const AtenRounding& aten_rounding() {
  static const AtenRounding rounding = [] {
    constexpr size_t n = 65536;
    std::vector<float> a(n), b(n), c(n), out(n);  // malloc's, not LibTorch's: no allocation the tracker sees
    uint32_t h = 0x2545F491u;
    auto next = [&h](uint32_t exponent) {  // hashed mantissa and sign, the given exponent
      h = mix32(h + 0x9E3779B9u);
      const uint32_t bits = (h & 0x807FFFFFu) | (exponent << 23);
      float x;
      std::memcpy(&x, &bits, 4);
      return x;
    };
    for (size_t i = 0; i < n; ++i) {
      a[i] = std::fabs(next(static_cast<uint32_t>(i % 254 + 1)));  // positive normals of every exponent
      b[i] = next(127 + static_cast<uint32_t>(i % 8));             // [1, 256) either sign
      c[i] = next(120 + static_cast<uint32_t>(i % 8));             // [2^-7, 2) either sign
    }
    const auto fp32 = at::TensorOptions().dtype(at::kFloat);
    const int64_t size = static_cast<int64_t>(n);
    auto tensor = [&](std::vector<float>& v) { return at::from_blob(v.data(), {size}, fp32); };
    at::Tensor y = tensor(out);
    AtenRounding r{true, true, true};
    at::sqrt_out(y, tensor(a));
    for (size_t i = 0; i < n; ++i) r.sqrt_exact = r.sqrt_exact && out[i] == std::sqrt(a[i]);
    const float alpha = 0.0999f, value = 0.0011f;  // ATen casts its double scalars to these
    at::add_out(y, tensor(b), tensor(c), alpha);
    for (size_t i = 0; i < n; ++i) r.add_fused = r.add_fused && out[i] == std::fma(c[i], alpha, b[i]);
    at::addcmul_out(y, tensor(b), tensor(c), tensor(a), value);
    for (size_t i = 0; i < n; ++i) r.addcmul_fused = r.addcmul_fused && out[i] == std::fma(value * c[i], a[i], b[i]);
    return r;
  }();
  return rounding;
}

bool dense_kernel_supported(DenseKernel k) { return k == DenseKernel::automatic || cpu_supports(k); }

DenseKernel dense_kernel_chosen() {
  static const DenseKernel chosen = choose_cpu_kernel(cpu_supports);
  return chosen;
}

bool adam_dense_kernel_applies(const at::Tensor& p, const at::Tensor& g, const at::Tensor& m, const at::Tensor& v) {
  const int64_t n = p.defined() ? p.numel() : 0;
  return dense(p, n, true) && dense(g, n, true) && dense(m, n, true) && dense(v, n, true) && m.scalar_type() == v.scalar_type();
}

void adam_step_dense_cpu(const AdamStep& h, const at::Tensor& p, const at::Tensor& g, const at::Tensor& m, const at::Tensor& v,
                         const Bf16Rounding& rounding, DenseKernel kernel) {
  TORCH_CHECK(adam_dense_kernel_applies(p, g, m, v),
              "adam_step_dense_cpu: parameter, gradient and moments must be contiguous "
              "CPU tensors of one size, fp32 or bf16 (the moments of one dtype)");
  AdamScalars s;
  set_adam_scalars(h, s);
  s.l2 = !h.decoupled && h.weight_decay != 0;
  s.decay_param = h.decoupled && h.weight_decay != 0;
  s.stochastic = rounding.stochastic;
  s.seed = rounding.seed;
  s.first_index = rounding.first_index;
  const DenseRefs r{p.data_ptr(),
                    g.data_ptr(),
                    m.data_ptr(),
                    v.data_ptr(),
                    p.scalar_type() == at::kBFloat16,
                    g.scalar_type() == at::kBFloat16,
                    m.scalar_type() == at::kBFloat16};
  run(kAdam, kernel, s, r, p.numel());
  for (const at::Tensor* t : {&p, &m, &v}) mark_written(*t);
}

bool sgd_dense_kernel_applies(const at::Tensor& p, const at::Tensor& g, const at::Tensor& buf) {
  const int64_t n = p.defined() ? p.numel() : 0;
  return dense(p, n, false) && dense(g, n, false) && (!buf.defined() || dense(buf, n, false));
}

void sgd_step_dense_cpu(const SgdStep& h, const at::Tensor& p, const at::Tensor& g, const at::Tensor& buf, bool first, DenseKernel kernel) {
  TORCH_CHECK(sgd_dense_kernel_applies(p, g, buf),
              "sgd_step_dense_cpu: parameter, gradient and buffer must be contiguous "
              "fp32 CPU tensors of one size");
  TORCH_CHECK(buf.defined() == (h.momentum != 0), "sgd_step_dense_cpu: a momentum buffer exactly when momentum is not 0");
  SgdScalars s{static_cast<float>(h.weight_decay),
               static_cast<float>(h.momentum),
               static_cast<float>(1 - h.dampening),
               static_cast<float>(-h.lr),
               h.nesterov,
               first};
  const DenseRefs r{p.data_ptr(), g.data_ptr(), buf.defined() ? buf.data_ptr() : nullptr, nullptr, false, false, false};
  run(kSgd, kernel, s, r, p.numel());
  mark_written(p);
  mark_written(buf);
}

}  // namespace optim
}  // namespace frugal
