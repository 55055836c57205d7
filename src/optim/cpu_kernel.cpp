#include "frugal/optim/cpu_kernel.h"

#include <c10/util/Exception.h>

#include <cstdlib>
#include <string>

namespace frugal {
namespace optim {

const char* cpu_kernel_name(CpuKernel k) {
  switch (k) {
    case CpuKernel::automatic: return "automatic";
    case CpuKernel::portable: return "portable";
    case CpuKernel::avx2: return "avx2";
    case CpuKernel::avx512: return "avx512";
  }
  return "automatic";
}

CpuKernel choose_cpu_kernel(bool (*supports)(CpuKernel)) {
  const char* env = std::getenv("FRUGAL_CPU_KERNELS");
  const std::string choice = env ? env : "";
  if (choice == "portable") return CpuKernel::portable;
  if (choice != "avx2" && supports(CpuKernel::avx512)) return CpuKernel::avx512;
  return supports(CpuKernel::avx2) ? CpuKernel::avx2 : CpuKernel::portable;
}

CpuKernel resolve_cpu_kernel(CpuKernel k, bool (*supports)(CpuKernel), CpuKernel chosen, const char* what) {
  if (k == CpuKernel::automatic) return chosen;
  TORCH_CHECK(supports(k), "the ", cpu_kernel_name(k), " ", what, " needs a processor that has it");
  return k;
}

}  // namespace optim
}  // namespace frugal
