// src/optim/adam_kernel.h — the fused CPU steps of Adam(W) and SGD on dense state: one pass over
// parameter, gradient and state, vectorised (AVX-512F or AVX2 with FMA, chosen at run time, or a
// portable loop) and threaded with at::parallel_for. update.cpp uses them for contiguous CPU
// tensors; everything else takes its ATen operations. Internal; not installed.
//
//   frugal::optim::AdamStep h{lr, 0.9, 0.999, 1e-8, wd, 1 - std::pow(0.9, t), 1 - std::pow(0.999, t), true};
//   if (adam_dense_kernel_applies(p, g, m, v)) adam_step_dense_cpu(h, p, g, m, v, Bf16Rounding{});
#pragma once

#include <ATen/ATen.h>

#include "frugal/optim/cpu_kernel.h"
#include "frugal/optim/quantize.h"  // AdamStep, Bf16Rounding

namespace frugal {
namespace optim {

// Which code runs the dense steps. automatic: AVX-512F where the processor has it, else AVX2 with
// FMA, else the portable loop; the environment variable FRUGAL_CPU_KERNELS=portable forces the
// portable loop and FRUGAL_CPU_KERNELS=avx2 stops at AVX2. The three do the same IEEE fp32
// operations in the same order, with a fused multiply-add exactly where LibTorch's own add
// (a + alpha*b) and addcmul (a + (s*b)*c) kernels end in one as its CPU build compiles them
// (std::fma in the portable loop), so they give identical bits, and torch::optim's where LibTorch
// rounds the same way (aten_rounding; tested). Tests force each path.
using DenseKernel = CpuKernel;  // cpu_kernel.h: the paths and FRUGAL_CPU_KERNELS
inline const char* dense_kernel_name(DenseKernel k) { return cpu_kernel_name(k); }
bool dense_kernel_supported(DenseKernel k);  // whether this processor can run that path
DenseKernel dense_kernel_chosen();           // what automatic runs here

// Makes ATen's parallel loops started on the calling thread use `threads` threads (OpenMP keeps
// that count per thread; other threads keep theirs). For the optimizer's update thread.
void use_intra_op_threads_on_this_thread(int threads);

// How LibTorch's own fp32 CPU kernels round, checked once on 65536 values (from_blob buffers: no
// allocation of LibTorch's): whether its sqrt is correctly rounded, as the kernel's is (Debian's
// 1.13: the processor's instruction; PyPI's 2.x wheel: MKL's vector math, within an ulp but not the
// nearest for about a sixth of values), and whether its add (a + alpha*b) and addcmul (a + (s*b)*c)
// end in one fused multiply-add, as the kernel's do (both builds on processors with FMA; not ATen's
// portable kernels). Where all three hold, the kernel gives ATen's bits.
struct AtenRounding {
  bool sqrt_exact, add_fused, addcmul_fused;
};
const AtenRounding& aten_rounding();

// Whether adam_step_dense_cpu takes these: CPU tensors, contiguous, of one size; parameter and
// gradient fp32 or bf16; both moments fp32 or both bf16.
bool adam_dense_kernel_applies(const at::Tensor& p, const at::Tensor& g, const at::Tensor& m, const at::Tensor& v);

// One Adam(W) step in place on p, m and v, element by element as update.cpp's ATen operations (and
// torch::optim) do it:
//   AdamW: p *= 1 - lr*wd          Adam: g += wd*p
//   m = b1*m + (1-b1)*g            v = b2*v + (1-b2)*g*g
//   p += (-lr/bc1) * m / (sqrt(v)/sqrt(bc2) + eps)
// in fp32 with set_adam_scalars' constants. bf16 values are widened to fp32 and rounded back: the
// moments to nearest even, the parameter per `rounding` (stochastic noise hashed from the seed and
// the element's index in p, as the quantized kernel does it). p, g, m, v: (n) elements each.
void adam_step_dense_cpu(const AdamStep& h, const at::Tensor& p, const at::Tensor& g, const at::Tensor& m, const at::Tensor& v,
                         const Bf16Rounding& rounding, DenseKernel kernel = DenseKernel::automatic);

struct SgdStep {
  double lr, weight_decay, momentum, dampening;
  bool nesterov;
};

// Whether sgd_step_dense_cpu takes these: fp32 CPU tensors, contiguous, of one size (buf: the
// momentum buffer, or undefined when there is no momentum or it is not made yet).
bool sgd_dense_kernel_applies(const at::Tensor& p, const at::Tensor& g, const at::Tensor& buf);

// One SGD step in place on p (and buf), as torch::optim::SGD does it:
//   d = g + wd*p;  buf = first ? d : momentum*buf + (1-dampening)*d;
//   d = nesterov ? d + momentum*buf : buf;  p += -lr*d
// buf: defined exactly when momentum != 0; `first`: buf holds nothing yet and is set to d.
void sgd_step_dense_cpu(const SgdStep& h, const at::Tensor& p, const at::Tensor& g, const at::Tensor& buf, bool first,
                        DenseKernel kernel = DenseKernel::automatic);

}  // namespace optim
}  // namespace frugal
