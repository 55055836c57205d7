// What an optimizer's state and its update cost in bytes, per parameter, before anything is
// allocated: the formulas the memory estimate (train/estimate.cpp) and the benchmarks use, kept
// equal to what Optimizer and StateBuffer allocate (tests/optim/state_test.cpp holds them to it).
#include <algorithm>
#include <vector>

#include "frugal/optim/optimizer.h"
#include "frugal/optim/quantize.h"
#include "frugal/optim/update.h"

namespace frugal {
namespace optim {

StateBufferBytes state_bytes_for_parameter(int64_t numel, at::ScalarType dtype, const OptimizerOptions& o) {
  const int64_t e = static_cast<int64_t>(c10::elementSize(dtype));
  StateBufferBytes b;
  if (o.algorithm() == Algorithm::sgd) {
    b.total = o.momentum() > 0 ? numel * e : 0;  // the momentum buffer, a clone of the gradient
    return b;
  }
  const bool buffered = uses_buffered_state(dtype, o.state(), o.stochastic_rounding());
  if (!buffered) {
    b.total = 2 * numel * e;  // exp_avg and exp_avg_sq like the parameter, as torch::optim keeps them
    return b;
  }
  const StateBufferBytes one = state_buffer_bytes(numel, o.state());
  b.total = 2 * one.total;
  b.in_files = 2 * one.in_files;
  b.window = one.window;  // one moment's chunk: the size of a window buffer
  return b;
}

int64_t update_temporary_bytes(int64_t numel, at::ScalarType dtype, at::Device device, const OptimizerOptions& o) {
  const int64_t e = static_cast<int64_t>(c10::elementSize(dtype));
  if (o.algorithm() == Algorithm::sgd) return 0;
  const bool buffered = uses_buffered_state(dtype, o.state(), o.stochastic_rounding());
  const StatePrecision p = effective_precision(numel, o.state());
  // File placement: the fused CPU kernels update the chunk in the window's buffers (state memory,
  // state_window_bytes); every other path maps both moments' chunk in and out within the update
  // (the tracker's temporary memory: made and freed in the update's scope).
  const int64_t window = buffered ? 2 * state_buffer_bytes(numel, o.state()).window : 0;
  if (uses_dense_kernel(dtype, device, buffered, p)) return device.is_cpu() ? 0 : window;  // one fused pass in place
  if (!buffered) return 2 * numel * e;
  if (is_quantized(p) && uses_fused_kernel(dtype, device)) {
    // On a GPU with the state off it, the CUDA kernel holds one chunk's codes and scales of both
    // moments on the device; otherwise nothing.
    if (device.is_cpu()) return 0;
    if (o.state().placement() == StatePlacement::device) return window;
    StateOptions on_device = o.state();
    on_device.placement(StatePlacement::device);
    return window + 2 * state_buffer_bytes(std::min(numel, o.state().chunk_elements()), on_device).total;
  }
  // fp32 chunks: parameter, gradient, m, v, the update, and the noise of stochastic rounding (measured: 23 B a value)
  return window + std::min(numel, o.state().chunk_elements()) * 24;
}

int64_t shared_code_table_bytes(const std::vector<int64_t>& numels, const OptimizerOptions& o) {
  if (o.algorithm() == Algorithm::sgd) return 0;
  const StatePrecision p = o.state().precision();
  if (!is_quantized(p)) return 0;
  const bool any = std::any_of(numels.begin(), numels.end(), [&](int64_t n) { return effective_precision(n, o.state()) == p; });
  return any ? 2 * code_table_bytes(state_bits(p)) : 0;  // signed and unsigned maps
}

}  // namespace optim
}  // namespace frugal
