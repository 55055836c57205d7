// frugal/optim/update.h — the per-parameter update rules (SGD, Adam, AdamW) on whole tensors.
//
// One function per step of one parameter, shared by the standard and the in-backward mode, written
// in the same order of operations as torch::optim so that the two agree to rounding.
//
//   frugal::optim::ParamState state;
//   frugal::optim::apply_update(hyper, state, param, grad);   // param updated in place
#pragma once

#include <ATen/ATen.h>

#include <array>
#include <memory>
#include <optional>
#include <string>

#include "frugal/optim/state_buffer.h"

namespace frugal {
namespace optim {

enum class Algorithm { sgd, adam, adamw };
constexpr std::array<Algorithm, 3> kAllAlgorithms = {Algorithm::sgd, Algorithm::adam, Algorithm::adamw};

// "sgd", "adam", "adamw"; parse_algorithm is the inverse (nullopt for any other text).
const char* algorithm_name(Algorithm a);
std::optional<Algorithm> parse_algorithm(const std::string& name);

// Whether Adam(W) keeps its moments in StateBuffers and updates chunk by chunk (another precision
// or place, or stochastic rounding of bf16 parameters) rather than in plain tensors like the parameter.
inline bool uses_buffered_state(at::ScalarType param_dtype, const StateOptions& state, bool stochastic_rounding) {
  return state.precision() != StatePrecision::fp32 || state.placement() != StatePlacement::device ||
         (stochastic_rounding && param_dtype == at::kBFloat16);
}

// Whether a parameter of this dtype and device, with 8- or 4-bit moments, takes a fused kernel
// (quantize.h: the CPU one, or the CUDA one in a CUDA build), which makes no fp32 temporaries;
// other buffered updates work a chunk in fp32 with ATen operations.
inline bool uses_fused_kernel(at::ScalarType param_dtype, at::Device device) {
  return (device.is_cpu() || (device.is_cuda() && cuda_kernels_built())) && (param_dtype == at::kFloat || param_dtype == at::kBFloat16);
}

// Whether Adam(W) takes the fused dense CPU step (one pass over parameter, gradient and moments, no
// temporaries) in this process: where LibTorch's own add and addcmul end in one fused multiply-add,
// as the kernel's do (processors with FMA, both builds here), so the kernel does ATen's arithmetic
// operation for operation. adam_kernel_gives_aten_bits: and where LibTorch's fp32 sqrt is also
// correctly rounded as the kernel's is (Debian's 1.13), the kernel gives torch::optim's bits.
// PyPI's 2.x wheel takes MKL's vector sqrt, an ulp off the nearest for about a sixth of values; there
// the kernel's step is within an ulp of torch::optim's, as PyTorch's own fused=True AdamW is of its
// for-loop AdamW (Adam's step, nearly the sign of m where gradients are small, carries such ulps into
// lr-sized differences over a run: 3.6e-3 between PyTorch 2.15's fused and for-loop AdamW on a
// two-block Transformer after 20 steps). sgd_takes_dense_kernel: SGD has no sqrt and needs the fused
// add only, so it gives torch::optim's bits wherever it is taken.
bool adam_takes_dense_kernel();
bool adam_kernel_gives_aten_bits();
bool sgd_takes_dense_kernel();

// Whether Adam(W) of a parameter of this dtype and device takes that step: fp32 parameters with
// plain fp32 moments, and fp32 or bf16 parameters whose buffered moments are fp32 or bf16
// (`effective`: the StateBuffers' precision), for contiguous CPU tensors.
inline bool uses_dense_kernel(at::ScalarType param_dtype, at::Device device, bool buffered, StatePrecision effective) {
  if (!device.is_cpu() || !adam_takes_dense_kernel()) return false;
  if (!buffered) return param_dtype == at::kFloat;
  return (effective == StatePrecision::fp32 || effective == StatePrecision::bf16) &&
         (param_dtype == at::kFloat || param_dtype == at::kBFloat16);
}

// The instruction set of the fused dense CPU steps of Adam(W) and SGD on this processor: "avx512",
// "avx2" or "portable" (FRUGAL_CPU_KERNELS=portable forces the last, =avx2 stops at AVX2).
const char* dense_cpu_kernel();

// One parameter group's algorithm and hyperparameters, and how its Adam(W) state is kept: the one
// home of these settings (OptimizerOptions sets and reads them through its hyper()).
struct Hyper {
  Algorithm algorithm = Algorithm::adamw;
  double lr = 1e-3;
  double weight_decay = 0;                        // L2 for sgd and adam, decoupled for adamw
  double momentum = 0;                            // sgd
  double dampening = 0;                           // sgd
  bool nesterov = false;                          // sgd
  double beta1 = 0.9, beta2 = 0.999, eps = 1e-8;  // adam, adamw
  // Adam(W) moments in another precision or place (see state_buffer.h); fp32 on the parameter's
  // device uses the plain tensors below.
  StateOptions state;
  // bf16 parameters: compute the update in fp32 and round to bf16 stochastically, so updates
  // smaller than bf16's resolution still move the parameter on average.
  bool stochastic_rounding = false;
  // The stochastic rounding's seed for this update of a bf16 parameter on the CPU; unset: drawn
  // from the default generator when the update runs (rounding_seed below, once per update).
  std::optional<uint64_t> rounding_seed;

  // Whether `param`'s Adam(W) moments live in StateBuffers (uses_buffered_state).
  bool buffered(const at::Tensor& param) const { return uses_buffered_state(param.scalar_type(), state, stochastic_rounding); }
};

// One parameter's optimizer state: its step count and the tensors its algorithm keeps.
struct ParamState {
  int64_t step = 0;                   // updates applied so far
  at::Tensor exp_avg;                 // adam(w): first moment
  at::Tensor exp_avg_sq;              // adam(w): second moment
  at::Tensor momentum_buffer;         // sgd with momentum
  std::shared_ptr<StateBuffer> m, v;  // adam(w) moments when Hyper::buffered()
};

// The seed an update of `param` under h rounds with: drawn now from the default generator (which run
// checkpoints save) when h rounds it stochastically and carries no seed, h.rounding_seed when it
// does; nullopt when the update rounds to nearest. What apply_update draws, for a caller that runs
// the update later on another thread and must draw in the order updates were asked for.
std::optional<uint64_t> rounding_seed(const Hyper& h, const at::Tensor& param);

// x (fp32) rounded to bf16 stochastically: up or down with probability given by the distance.
at::Tensor stochastic_round_bf16(const at::Tensor& x, const c10::optional<at::Generator>& gen = c10::nullopt);

// param -= update(grad); creates the state tensors on the first call. grad is not modified.
void apply_update(const Hyper& h, ParamState& state, at::Tensor& param, const at::Tensor& grad);

}  // namespace optim
}  // namespace frugal
