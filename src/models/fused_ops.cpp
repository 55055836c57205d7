#include "fused_ops.h"

#include <ATen/Parallel.h>
#include <c10/util/Exception.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <string>

#include "../precision/exp_nonpositive.h"
#include "../precision/x86_kernels.h"

namespace frugal {
namespace models {
namespace fused {
namespace {

#define FRUGAL_INLINE inline __attribute__((always_inline))

// bf16 is held as its 16 bits: widening is a shift; narrowing rounds to nearest even and turns a
// NaN into the quiet NaN 0x7FC0, as c10::BFloat16's conversion does.
using bf16 = uint16_t;
FRUGAL_INLINE float load(float v) { return v; }
FRUGAL_INLINE float load(bf16 v) {
  const uint32_t bits = static_cast<uint32_t>(v) << 16;
  float f;
  std::memcpy(&f, &bits, 4);
  return f;
}
FRUGAL_INLINE void store(float& out, float v) { out = v; }
FRUGAL_INLINE void store(bf16& out, float v) {
  uint32_t bits;
  std::memcpy(&bits, &v, 4);
  const uint32_t rounded = (bits + 0x7FFFu + ((bits >> 16) & 1u)) >> 16;
  out = v != v ? bf16{0x7FC0} : static_cast<bf16>(rounded);
}

// The sum of a row's f(j) in 16 independent lanes (no order the compiler must keep, so it
// vectorises), then across the lanes.
template <typename F>
FRUGAL_INLINE float lane_sum(int64_t n, F f) {
  float lanes[16] = {};
  int64_t j = 0;
  for (; j + 16 <= n; j += 16) {
    for (int k = 0; k < 16; ++k) lanes[k] += f(j + k);
  }
  for (; j < n; ++j) lanes[j % 16] += f(j);
  float s = 0;
  for (float l : lanes) s += l;
  return s;
}

// ---- the row loops: compiled once per path below ----

template <typename X, typename Y>
FRUGAL_INLINE void rms_forward_rows(const X* __restrict x, const X* __restrict w, Y* __restrict y, float* __restrict r, int64_t first,
                                    int64_t last, int64_t d, float eps) {
  for (int64_t i = first; i < last; ++i) {
    const X* xi = x + i * d;
    Y* yi = y + i * d;
    const float sq = lane_sum(d, [&](int64_t j) {
      const float v = load(xi[j]);
      return v * v;
    });
    const float ri = 1.0f / std::sqrt(sq / static_cast<float>(d) + eps);
    r[i] = ri;
    for (int64_t j = 0; j < d; ++j) store(yi[j], load(xi[j]) * ri * load(w[j]));
  }
}

// gx = r (g w - x̂ mean(g w x̂)) with x̂ = x r; gw_acc += g x̂ (this thread's partial column sums).
template <typename X, typename G>
FRUGAL_INLINE void rms_backward_rows(const X* __restrict x, const X* __restrict w, const float* __restrict r, const G* __restrict g,
                                     X* __restrict gx, float* __restrict gw_acc, int64_t first, int64_t last, int64_t d) {
  for (int64_t i = first; i < last; ++i) {
    const X* xi = x + i * d;
    const G* gi = g + i * d;
    const float ri = r[i];
    if (gx) {
      const float dot = lane_sum(d, [&](int64_t j) { return load(gi[j]) * load(w[j]) * (load(xi[j]) * ri); });
      const float mean = dot / static_cast<float>(d);
      X* gxi = gx + i * d;
      for (int64_t j = 0; j < d; ++j) {
        const float xhat = load(xi[j]) * ri;
        store(gxi[j], ri * (load(gi[j]) * load(w[j]) - xhat * mean));
      }
    }
    if (gw_acc) {
      for (int64_t j = 0; j < d; ++j) gw_acc[j] += load(gi[j]) * (load(xi[j]) * ri);
    }
  }
}

// One rotary row: y1 = x1 c1 - x2 s1, y2 = x2 c2 + x1 s2 (halves of hd).
template <typename X>
FRUGAL_INLINE void rotary_forward_row(const X* __restrict x, const float* __restrict c, const float* __restrict s, X* __restrict y,
                                      int64_t h) {
  for (int64_t k = 0; k < h; ++k) store(y[k], load(x[k]) * c[k] - load(x[k + h]) * s[k]);
  for (int64_t k = 0; k < h; ++k) store(y[k + h], load(x[k + h]) * c[k + h] + load(x[k]) * s[k + h]);
}

// Its gradient: g c - rotate_half(g s): gx1 = g1 c1 + g2 s2, gx2 = g2 c2 - g1 s1.
template <typename X>
FRUGAL_INLINE void rotary_backward_row(const X* __restrict g, const float* __restrict c, const float* __restrict s, X* __restrict gx,
                                       int64_t h) {
  for (int64_t k = 0; k < h; ++k) store(gx[k], load(g[k]) * c[k] + load(g[k + h]) * s[k + h]);
  for (int64_t k = 0; k < h; ++k) store(gx[k + h], load(g[k + h]) * c[k + h] - load(g[k]) * s[k]);
}

// sigmoid(x) from exp(-|x|), whose argument is never positive (no overflow): 1 / (1 + e) for
// x >= 0, e / (1 + e) below.
FRUGAL_INLINE float sigmoid(float x) {
  const float e = precision::exp_nonpositive(x < 0 ? x : -x);
  return (x < 0 ? e : 1.0f) / (1.0f + e);
}

template <typename T>
FRUGAL_INLINE void swiglu_forward_range(const T* __restrict gate, const T* __restrict up, T* __restrict out, int64_t first, int64_t last) {
  for (int64_t j = first; j < last; ++j) {
    const float x = load(gate[j]);
    store(out[j], x * sigmoid(x) * load(up[j]));
  }
}

// d gate = g up silu'(x), silu'(x) = s (1 + x (1 - s)); d up = g silu(x).
template <typename T>
FRUGAL_INLINE void swiglu_backward_range(const T* __restrict gate, const T* __restrict up, const T* __restrict g, T* __restrict dgate,
                                         T* __restrict dup, int64_t first, int64_t last) {
  for (int64_t j = first; j < last; ++j) {
    const float x = load(gate[j]), s = sigmoid(x), gj = load(g[j]);
    if (dgate) store(dgate[j], gj * load(up[j]) * (s * (1.0f + x * (1.0f - s))));
    if (dup) store(dup[j], gj * (x * s));
  }
}

// ---- the paths: each loop above compiled for a target ----

// A kernel set for one target: the loops, not inlined further, so each is vectorised for it.
#define FRUGAL_FUSED_KERNELS(NS, TARGET)                                                                                                   \
  namespace NS {                                                                                                                           \
  template <typename X, typename Y>                                                                                                        \
  TARGET void rms_forward(const X* x, const X* w, Y* y, float* r, int64_t first, int64_t last, int64_t d, float eps) {                     \
    rms_forward_rows(x, w, y, r, first, last, d, eps);                                                                                     \
  }                                                                                                                                        \
  template <typename X, typename G>                                                                                                        \
  TARGET void rms_backward(const X* x, const X* w, const float* r, const G* g, X* gx, float* gw, int64_t first, int64_t last, int64_t d) { \
    rms_backward_rows(x, w, r, g, gx, gw, first, last, d);                                                                                 \
  }                                                                                                                                        \
  template <typename X>                                                                                                                    \
  TARGET void rotary(bool backward, const X* x, const float* c, const float* s, X* y, int64_t h) {                                         \
    if (backward) {                                                                                                                        \
      rotary_backward_row(x, c, s, y, h);                                                                                                  \
    } else {                                                                                                                               \
      rotary_forward_row(x, c, s, y, h);                                                                                                   \
    }                                                                                                                                      \
  }                                                                                                                                        \
  template <typename T>                                                                                                                    \
  TARGET void swiglu_forward(const T* gate, const T* up, T* out, int64_t first, int64_t last) {                                            \
    swiglu_forward_range(gate, up, out, first, last);                                                                                      \
  }                                                                                                                                        \
  template <typename T>                                                                                                                    \
  TARGET void swiglu_backward(const T* gate, const T* up, const T* g, T* dgate, T* dup, int64_t first, int64_t last) {                     \
    swiglu_backward_range(gate, up, g, dgate, dup, first, last);                                                                           \
  }                                                                                                                                        \
  }

FRUGAL_FUSED_KERNELS(portable, )
#if FRUGAL_X86_KERNELS
FRUGAL_FUSED_KERNELS(avx2, __attribute__((target("avx2,fma"))))
FRUGAL_FUSED_KERNELS(avx512, __attribute__((target("avx512f,avx512bw,avx512dq,avx512vl,avx2,fma"))))
#endif
#undef FRUGAL_FUSED_KERNELS

// Calls NS::NAME<TYPES...>(args...) for the resolved path.
#if FRUGAL_X86_KERNELS
#define FRUGAL_ON_PATH(PATH, NAME, ...)                             \
  [&](auto&&... args) {                                             \
    switch (PATH) {                                                 \
      case Path::avx512: return avx512::NAME<__VA_ARGS__>(args...); \
      case Path::avx2: return avx2::NAME<__VA_ARGS__>(args...);     \
      default: return portable::NAME<__VA_ARGS__>(args...);         \
    }                                                               \
  }
#else
#define FRUGAL_ON_PATH(PATH, NAME, ...) [&](auto&&... args) { return portable::NAME<__VA_ARGS__>(args...); }
#endif

bool cpu_supports(Path path) {
#if FRUGAL_X86_KERNELS
  if (path == Path::avx512) {
    return __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") && __builtin_cpu_supports("avx512dq") &&
           __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma");
  }
  if (path == Path::avx2) return __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma");
#endif
  return path == Path::automatic || path == Path::portable;
}

Path resolve(Path path) {
  if (path != Path::automatic) {
    TORCH_CHECK(cpu_supports(path), "the ", path_name(path), " fused layer kernels need a processor that has it");
    return path;
  }
  static const Path chosen = [] {
    const char* env = std::getenv("FRUGAL_CPU_KERNELS");
    const std::string choice = env ? env : "";
    if (choice == "portable") return Path::portable;
    if (choice != "avx2" && cpu_supports(Path::avx512)) return Path::avx512;
    return cpu_supports(Path::avx2) ? Path::avx2 : Path::portable;
  }();
  return chosen;
}

bool float_or_bf16(const at::Tensor& t) {
  return t.defined() && t.device().is_cpu() && (t.scalar_type() == at::kFloat || t.scalar_type() == at::kBFloat16);
}

// Calls f(X{}) with X the C++ type of dtype (float or bf16).
template <typename F>
auto with_type(at::ScalarType dtype, F f) {
  if (dtype == at::kFloat) return f(float{});
  return f(bf16{});
}

template <typename T>
T* data(const at::Tensor& t) {
  return reinterpret_cast<T*>(t.data_ptr());
}

// Rows (or elements) per task: enough that a thread's share outweighs waking it.
int64_t grain_for(int64_t width) { return std::max<int64_t>(1, 16384 / std::max<int64_t>(width, 1)); }

}  // namespace

const char* path_name(Path path) {
  switch (path) {
    case Path::automatic: return "automatic";
    case Path::portable: return "portable";
    case Path::avx2: return "avx2";
    case Path::avx512: return "avx512";
  }
  return "automatic";
}

bool path_available(Path path) { return cpu_supports(path); }

bool rms_norm_takes(const at::Tensor& x, const at::Tensor& w, at::ScalarType out) {
  return float_or_bf16(x) && float_or_bf16(w) && w.scalar_type() == x.scalar_type() && w.dim() == 1 && x.dim() >= 1 &&
         w.size(0) == x.size(-1) && (out == at::kFloat || out == at::kBFloat16);
}

std::pair<at::Tensor, at::Tensor> rms_norm_forward(const at::Tensor& x_in, const at::Tensor& w_in, double eps, at::ScalarType out,
                                                   Path path) {
  TORCH_CHECK(rms_norm_takes(x_in, w_in, out), "fused::rms_norm_forward: unsupported tensors");
  const Path p = resolve(path);
  const at::Tensor x = x_in.contiguous(), w = w_in.contiguous();
  const int64_t d = x.size(-1), rows = d == 0 ? 0 : x.numel() / d;
  at::Tensor y = at::empty(x.sizes(), x.options().dtype(out));
  std::vector<int64_t> r_shape = x.sizes().vec();
  r_shape.back() = 1;
  at::Tensor r = at::empty(r_shape, x.options().dtype(at::kFloat));
  with_type(x.scalar_type(), [&](auto xt) {
    using X = decltype(xt);
    with_type(out, [&](auto yt) {
      using Y = decltype(yt);
      auto kernel = FRUGAL_ON_PATH(p, rms_forward, X, Y);
      at::parallel_for(0, rows, grain_for(d), [&](int64_t first, int64_t last) {
        kernel(data<const X>(x), data<const X>(w), data<Y>(y), data<float>(r), first, last, d, static_cast<float>(eps));
      });
      return 0;
    });
    return 0;
  });
  return {y, r};
}

std::pair<at::Tensor, at::Tensor> rms_norm_backward(const at::Tensor& x_in, const at::Tensor& w_in, const at::Tensor& r_in,
                                                    const at::Tensor& g_in, bool need_x, bool need_w, Path path) {
  TORCH_CHECK(rms_norm_takes(x_in, w_in, at::kFloat) && float_or_bf16(g_in) && g_in.sizes() == x_in.sizes() &&
                  r_in.scalar_type() == at::kFloat && r_in.numel() * std::max<int64_t>(x_in.size(-1), 1) == x_in.numel(),
              "fused::rms_norm_backward: unsupported tensors");
  const Path p = resolve(path);
  const at::Tensor x = x_in.contiguous(), w = w_in.contiguous(), r = r_in.contiguous(), g = g_in.contiguous();
  const int64_t d = x.size(-1), rows = d == 0 ? 0 : x.numel() / d;
  at::Tensor gx = need_x ? at::empty_like(x) : at::Tensor();
  at::Tensor gw;
  // The weight's gradient: each part of the rows sums its own columns, then the parts are added.
  const int64_t parts = need_w ? std::max<int64_t>(1, std::min<int64_t>(at::get_num_threads(), rows)) : 0;
  at::Tensor partial = need_w ? at::zeros({parts, d}, x.options().dtype(at::kFloat)) : at::Tensor();
  with_type(x.scalar_type(), [&](auto xt) {
    using X = decltype(xt);
    with_type(g.scalar_type(), [&](auto gt) {
      using G = decltype(gt);
      auto kernel = FRUGAL_ON_PATH(p, rms_backward, X, G);
      X* gxp = need_x ? data<X>(gx) : nullptr;
      if (need_w) {
        at::parallel_for(0, parts, 1, [&](int64_t first_part, int64_t last_part) {
          for (int64_t part = first_part; part < last_part; ++part) {
            kernel(data<const X>(x), data<const X>(w), data<const float>(r), data<const G>(g), gxp, data<float>(partial) + part * d,
                   rows * part / parts, rows * (part + 1) / parts, d);
          }
        });
      } else if (need_x) {
        at::parallel_for(0, rows, grain_for(d), [&](int64_t first, int64_t last) {
          kernel(data<const X>(x), data<const X>(w), data<const float>(r), data<const G>(g), gxp, nullptr, first, last, d);
        });
      }
      return 0;
    });
    return 0;
  });
  if (need_w) gw = partial.sum(0).to(w.scalar_type());
  return {gx, gw};
}

bool rotary_takes(const at::Tensor& x, const at::Tensor& cos) {
  return float_or_bf16(x) && x.dim() == 4 && x.size(3) % 2 == 0 && cos.defined() && cos.device().is_cpu() &&
         cos.scalar_type() == at::kFloat && (cos.dim() == 2 || cos.dim() == 3) && cos.size(-1) == x.size(3) && cos.size(-2) == x.size(1) &&
         (cos.dim() == 2 || cos.size(0) == x.size(0));
}

namespace {

// y (B, T, H, hd) contiguous from x's rows through the forward or backward row.
at::Tensor rotary_apply(bool backward, const at::Tensor& x_in, const at::Tensor& cos_in, const at::Tensor& sin_in, Path path) {
  TORCH_CHECK(rotary_takes(x_in, cos_in) && sin_in.sizes() == cos_in.sizes() && sin_in.scalar_type() == at::kFloat,
              "fused::rotary: unsupported tensors");
  const Path p = resolve(path);
  const at::Tensor x = x_in.stride(3) == 1 ? x_in : x_in.contiguous();
  const at::Tensor c = cos_in.contiguous(), s = sin_in.contiguous();
  const int64_t B = x.size(0), T = x.size(1), H = x.size(2), hd = x.size(3), h = hd / 2;
  const int64_t sb = x.stride(0), st = x.stride(1), sh = x.stride(2);
  const bool per_batch = c.dim() == 3;
  at::Tensor y = at::empty({B, T, H, hd}, x.options());
  with_type(x.scalar_type(), [&](auto xt) {
    using X = decltype(xt);
    auto kernel = FRUGAL_ON_PATH(p, rotary, X);
    const X* xp = data<const X>(x);
    X* yp = data<X>(y);
    const float *cp = data<const float>(c), *spp = data<const float>(s);
    at::parallel_for(0, B * T * H, grain_for(hd), [&](int64_t first, int64_t last) {
      for (int64_t n = first; n < last; ++n) {
        const int64_t b = n / (T * H), t = n / H % T, head = n % H;
        const int64_t table = (per_batch ? b * T + t : t) * hd;
        kernel(backward, xp + b * sb + t * st + head * sh, cp + table, spp + table, yp + n * hd, h);
      }
    });
    return 0;
  });
  return y;
}

}  // namespace

at::Tensor rotary_forward(const at::Tensor& x, const at::Tensor& cos, const at::Tensor& sin, Path path) {
  return rotary_apply(false, x, cos, sin, path);
}

at::Tensor rotary_backward(const at::Tensor& g, const at::Tensor& cos, const at::Tensor& sin, Path path) {
  return rotary_apply(true, g, cos, sin, path);
}

bool swiglu_takes(const at::Tensor& gate, const at::Tensor& up) {
  return float_or_bf16(gate) && float_or_bf16(up) && up.scalar_type() == gate.scalar_type() && up.sizes() == gate.sizes();
}

at::Tensor swiglu_forward(const at::Tensor& gate_in, const at::Tensor& up_in, Path path) {
  TORCH_CHECK(swiglu_takes(gate_in, up_in), "fused::swiglu_forward: unsupported tensors");
  const Path p = resolve(path);
  const at::Tensor gate = gate_in.contiguous(), up = up_in.contiguous();
  at::Tensor out = at::empty_like(gate);
  with_type(gate.scalar_type(), [&](auto tt) {
    using T = decltype(tt);
    auto kernel = FRUGAL_ON_PATH(p, swiglu_forward, T);
    at::parallel_for(0, gate.numel(), 16384,
                     [&](int64_t first, int64_t last) { kernel(data<const T>(gate), data<const T>(up), data<T>(out), first, last); });
    return 0;
  });
  return out;
}

std::pair<at::Tensor, at::Tensor> swiglu_backward(const at::Tensor& gate_in, const at::Tensor& up_in, const at::Tensor& g_in,
                                                  bool need_gate, bool need_up, Path path) {
  TORCH_CHECK(swiglu_takes(gate_in, up_in) && swiglu_takes(gate_in, g_in), "fused::swiglu_backward: unsupported tensors");
  const Path p = resolve(path);
  const at::Tensor gate = gate_in.contiguous(), up = up_in.contiguous(), g = g_in.contiguous();
  at::Tensor dgate = need_gate ? at::empty_like(gate) : at::Tensor(), dup = need_up ? at::empty_like(up) : at::Tensor();
  with_type(gate.scalar_type(), [&](auto tt) {
    using T = decltype(tt);
    auto kernel = FRUGAL_ON_PATH(p, swiglu_backward, T);
    at::parallel_for(0, gate.numel(), 16384, [&](int64_t first, int64_t last) {
      kernel(data<const T>(gate), data<const T>(up), data<const T>(g), need_gate ? data<T>(dgate) : nullptr,
             need_up ? data<T>(dup) : nullptr, first, last);
    });
    return 0;
  });
  return {dgate, dup};
}

}  // namespace fused
}  // namespace models
}  // namespace frugal
