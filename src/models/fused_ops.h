// src/models/fused_ops.h — the decoder's elementwise layers as one pass per row, forward and
// backward: RMSNorm, the rotary embedding and SwiGLU's silu(gate) * up. Written with ATen's
// whole-tensor operations they take five to ten passes each, with a temporary per pass (RMSNorm's
// backward alone: x * r, g * x̂, the column sum, g * w, their product, its mean, the difference,
// the scaling). Here a row (one token's d values) is read once or twice and written once, in fp32
// whatever the tensors' dtype, each result rounded once to its dtype (to nearest even, as ATen's
// casts round).
//
// Tensors: on the CPU, fp32 or bf16, as `takes` says (the decoder keeps ATen's operations for the
// rest). Three paths, the same loops compiled for AVX-512, for AVX2 with FMA, and for the build's
// baseline, chosen once per process (FRUGAL_CPU_KERNELS=portable or =avx2 stop there, as for
// optim's and loss's kernels); they round differently only where a multiply-add is fused, and each
// is tested against the plain computation in double.
#pragma once

#include <ATen/ATen.h>

#include <utility>

namespace frugal {
namespace models {
namespace fused {

enum class Path { automatic, portable, avx2, avx512 };
const char* path_name(Path path);
bool path_available(Path path);  // whether this processor runs it (automatic and portable: always)

// RMSNorm over the last dimension: y = x / sqrt(mean(x^2) + eps) * w, in dtype `out`; r = 1/rms
// per row, fp32, shaped (..., 1). x contiguous, w (d) of x's dtype.
bool rms_norm_takes(const at::Tensor& x, const at::Tensor& w, at::ScalarType out);
std::pair<at::Tensor, at::Tensor> rms_norm_forward(const at::Tensor& x, const at::Tensor& w, double eps, at::ScalarType out,
                                                   Path path = Path::automatic);
// The gradients of x (x's dtype; undefined unless need_x) and of w (w's dtype, summed over rows in
// fp32; undefined unless need_w) from g, the gradient of y (any layout, fp32 or bf16).
std::pair<at::Tensor, at::Tensor> rms_norm_backward(const at::Tensor& x, const at::Tensor& w, const at::Tensor& r, const at::Tensor& g,
                                                    bool need_x, bool need_w, Path path = Path::automatic);

// The rotary embedding y = x cos + rotate_half(x) sin, rotate_half(x) = (-x2, x1), on x (B, T, H,
// hd) with fp32 tables (T, hd) or (B, T, hd); y is (B, T, H, hd), contiguous, in x's dtype.
// x's and g's last dimension must be contiguous; the other dimensions may be strided (g is
// usually the transpose of a (B, H, T, hd) gradient).
bool rotary_takes(const at::Tensor& x, const at::Tensor& cos);
at::Tensor rotary_forward(const at::Tensor& x, const at::Tensor& cos, const at::Tensor& sin, Path path = Path::automatic);
// The gradient of x from g, the gradient of y: g cos - rotate_half(g sin).
at::Tensor rotary_backward(const at::Tensor& g, const at::Tensor& cos, const at::Tensor& sin, Path path = Path::automatic);

// silu(gate) * up, elementwise, and its gradients (undefined unless asked for); gate, up and g of
// one dtype and shape.
bool swiglu_takes(const at::Tensor& gate, const at::Tensor& up);
at::Tensor swiglu_forward(const at::Tensor& gate, const at::Tensor& up, Path path = Path::automatic);
std::pair<at::Tensor, at::Tensor> swiglu_backward(const at::Tensor& gate, const at::Tensor& up, const at::Tensor& g, bool need_gate,
                                                  bool need_up, Path path = Path::automatic);

}  // namespace fused
}  // namespace models
}  // namespace frugal
