// frugal/precision/autocast.h — mixed precision: LibTorch's autocast state, captured and re-entered;
// whether a device multiplies bf16 in hardware; the CPU threads a precision wants.
//
// Under autocast, matrix products (linear, mm, matmul, bmm, addmm, conv) run in a lower precision
// (bf16 on the CPU, bf16 or fp16 on CUDA) while parameters, their gradients and everything else stay
// as they are. The state is thread-local: a region that is recomputed in backward (a checkpointed
// block, the chunked loss's second pass) must run under the forward's state, not whatever state
// the thread that calls backward() happens to have. checkpoint() and the chunked loss capture it in
// forward and re-enter it for their recompute.
//
//   frugal::precision::AutocastGuard on(frugal::precision::AutocastState::compute(at::kCPU, at::kBFloat16));
//   at::Tensor loss = model->loss(x, y);   // products in bf16, weights and loss in fp32
//   // leave the guard before loss.backward(), as with torch.autocast
//
// The same calls work on LibTorch 1.13 and 2.x (whose autocast API differs).
#pragma once

#include <ATen/core/Tensor.h>
#include <c10/core/DeviceType.h>
#include <c10/core/ScalarType.h>

#include <string>

namespace frugal {
namespace precision {

// A thread's autocast state: which devices autocast is on for, their dtypes, and the weight cache.
struct AutocastState {
  bool cpu = false;
  at::ScalarType cpu_dtype = at::kBFloat16;
  bool cuda = false;
  at::ScalarType cuda_dtype = at::kHalf;
  // Whether autocast may keep one low-precision copy of each weight for the rest of the outermost
  // autocast scope. compute() turns it off: with checkpointing the copies would outlive the block
  // that made them (half the fp32 parameters' bytes, held through the forward).
  bool cache = true;

  // The calling thread's state now.
  static AutocastState current();
  // Everything off (what a thread starts with).
  static AutocastState off();
  // Autocast on `device` to `dtype` (bf16 or fp16; fp32 means off), without the weight cache.
  static AutocastState compute(c10::DeviceType device, at::ScalarType dtype);

  // Whether autocast is on for the CPU or CUDA.
  bool enabled() const { return cpu || cuda; }
  bool operator==(const AutocastState& o) const;  // same devices, dtypes (of the enabled ones) and cache flag
  // The negation of operator==.
  bool operator!=(const AutocastState& o) const { return !(*this == o); }
  // "off", "cpu bf16", "cpu bf16, cuda fp16"
  std::string describe() const;
};

// Sets the thread's autocast state until destroyed, then puts the previous one back. Entering an
// enabled state counts as one autocast nesting level, so the weight cache (when on) is emptied when
// the outermost level closes, as torch.autocast does.
class AutocastGuard {
 public:
  explicit AutocastGuard(const AutocastState& state);  // enters `state`, keeping the thread's current one to restore
  ~AutocastGuard();
  AutocastGuard(const AutocastGuard&) = delete;
  AutocastGuard& operator=(const AutocastGuard&) = delete;

 private:
  AutocastState previous_;
  bool nested_ = false;
};

// The dtype a floating-point tensor's consumers compute in under the current state: autocast's
// dtype on its device for an fp32 tensor, otherwise its own. Norms that compute in fp32 use it to
// emit their output directly in the products' precision (one copy, not one per product).
at::ScalarType compute_dtype_for(const at::Tensor& x);

// Whether `device` multiplies bf16 matrices in hardware: on the CPU, AVX512-BF16 or AMX-BF16
// (oneDNN's bf16 kernels; without them bf16 products are emulated and slower than fp32); on CUDA,
// any device (its compute capability is not read here: bf16 tensor cores need 8.0 or later, which
// every GPU the current CUDA wheels build for by default has). `why` (optional) gets the reason.
bool fast_bf16(c10::DeviceType device, std::string* why = nullptr);

// The CPU threads a run computing in `compute` should use, set until destroyed (then put back).
// LibTorch's default intra-op pool can be smaller than the cores this process may run on (on the
// 2-core machines here it is 1), which suits fp32 products: they go through the BLAS library,
// whose own threads (OpenBLAS's) use every core and would fight an OpenMP pool of the same size
// (measured: a step 1.7x slower with both at 2). bf16 products go through oneDNN on LibTorch's
// pool instead, so with bf16 compute on the CPU the pool grows to the cores the process may use
// (FRUGAL_NUM_THREADS, the launcher's share, caps it) and the BLAS library keeps one thread for the
// few fp32 products left (measured: a bf16 step 1.7x faster). fp32, or a CUDA device: no change.
class ComputeThreadsGuard {
 public:
  // Changes the thread counts as above when `device` is the CPU and `compute` is not fp32 or fp64; otherwise does nothing.
  ComputeThreadsGuard(c10::DeviceType device, at::ScalarType compute);
  ~ComputeThreadsGuard();
  ComputeThreadsGuard(const ComputeThreadsGuard&) = delete;
  ComputeThreadsGuard& operator=(const ComputeThreadsGuard&) = delete;
  // What the guard did, for logs: "" when it changed nothing.
  const std::string& describe() const { return what_; }

 private:
  int previous_threads_ = 0;  // 0: unchanged
  int previous_blas_threads_ = 0;
  std::string what_;
};

}  // namespace precision
}  // namespace frugal
