// src/optim/adam_scalars.h — the fp32 constants of one Adam(W) step, shared by the fused CPU kernel
// (quantize.cpp) and the CUDA kernel (quantize_cuda.cu): computed by one piece of code, so the two
// kernels start from the same bits. Internal; not installed.
#pragma once

#include <cmath>

#include "frugal/optim/quantize.h"

namespace frugal {
namespace optim {

// S: any struct with the float fields b1, b2, one_b1, one_b2, eps, wd, decay, sqrt_bc2, step and
// the bool decoupled (the kernels' own parameter blocks).
template <class S>
inline void set_adam_scalars(const AdamStep& h, S& s) {
  s.b1 = static_cast<float>(h.beta1);
  s.b2 = static_cast<float>(h.beta2);
  s.one_b1 = static_cast<float>(1 - h.beta1);
  s.one_b2 = static_cast<float>(1 - h.beta2);
  s.eps = static_cast<float>(h.eps);
  s.wd = static_cast<float>(h.weight_decay);
  s.decay = static_cast<float>(1 - h.lr * h.weight_decay);
  s.sqrt_bc2 = static_cast<float>(std::sqrt(h.bias_correction2));
  s.step = static_cast<float>(-h.lr / h.bias_correction1);
  s.decoupled = h.decoupled;
}

}  // namespace optim
}  // namespace frugal
