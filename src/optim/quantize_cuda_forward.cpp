// The fused quantized Adam(W) step on CUDA, from frugal's CUDA module (quantize_cuda.cu) when it is
// loaded (memory/cuda_runtime.h).
#include "frugal/memory/cuda_runtime.h"
#include "frugal/optim/quantize.h"

namespace frugal {
namespace optim {

bool cuda_kernels_built() { return memory::load_cuda().loaded; }

double adam_step_quantized_cuda(const AdamStep& h, const at::Tensor& p, const at::Tensor& g, QuantizedBuffer& m, QuantizedBuffer& v,
                                int64_t begin, int64_t end, const Bf16Rounding& rounding) {
  using Entry = double (*)(const AdamStep&, const at::Tensor&, const at::Tensor&, QuantizedBuffer&, QuantizedBuffer&, int64_t, int64_t,
                           const Bf16Rounding&, const CodeTables&, const CodeTables&);
  static const auto entry = reinterpret_cast<Entry>(memory::cuda_module_symbol("frugal_cuda_adam_step_quantized"));
  TORCH_CHECK(entry, "adam_step_quantized_cuda: frugal's CUDA kernels are not loaded: ", memory::load_cuda().reason);
  TORCH_CHECK(p.is_cuda(), "adam_step_quantized_cuda: the parameter must be a CUDA tensor");
  const auto mt = code_tables(true, m.bits(), p.device()), vt = code_tables(false, v.bits(), p.device());
  return entry(h, p, g, m, v, begin, end, rounding, *mt, *vt);
}

}  // namespace optim
}  // namespace frugal
