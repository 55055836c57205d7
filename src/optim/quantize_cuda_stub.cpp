// A build against a CPU-only LibTorch: CMake compiles this instead of quantize_cuda.cu, and the
// update takes the fused CPU kernel or ATen operations (a CUDA tensor cannot exist here).
#include "frugal/optim/quantize.h"

namespace frugal {
namespace optim {

bool cuda_kernels_built() { return false; }

double adam_step_quantized_cuda(const AdamStep&, const at::Tensor&, const at::Tensor&, QuantizedBuffer&, QuantizedBuffer&,
                                int64_t, int64_t, const Bf16Rounding&) {
  TORCH_CHECK(false, "adam_step_quantized_cuda: this build of frugal has no CUDA kernels (LibTorch without CUDA)");
  return 0;
}

}  // namespace optim
}  // namespace frugal
