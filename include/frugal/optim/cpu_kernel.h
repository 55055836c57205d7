// frugal/optim/cpu_kernel.h — which vector code a fused CPU kernel runs.
//
// The fused kernels (Adam(W) and SGD on dense state, adam_kernel.h; Adam(W) on 8- and 4-bit state,
// quantize.h) each have a portable loop, an AVX2 path and an AVX-512 path that give identical bits.
// automatic takes the widest the processor has; the environment variable FRUGAL_CPU_KERNELS=portable
// forces the portable loop and FRUGAL_CPU_KERNELS=avx2 stops at AVX2 (to measure or test them on a
// machine that has more).
//
//   frugal::optim::cpu_kernel_name(frugal::optim::quant_kernel_chosen());   // "avx2" on an AVX2 machine
#pragma once

namespace frugal {
namespace optim {

enum class CpuKernel { automatic, portable, avx2, avx512 };

// "automatic", "portable", "avx2", "avx512".
const char* cpu_kernel_name(CpuKernel k);

// The path automatic runs: the widest `supports` allows, narrowed by FRUGAL_CPU_KERNELS.
CpuKernel choose_cpu_kernel(bool (*supports)(CpuKernel));

// The path a call asked for runs: `chosen` for automatic, k itself where `supports` allows it;
// otherwise throws c10::Error, "the <k> <what> needs a processor that has it".
CpuKernel resolve_cpu_kernel(CpuKernel k, bool (*supports)(CpuKernel), CpuKernel chosen, const char* what);

}  // namespace optim
}  // namespace frugal
