#include "frugal/memory/cuda_runtime.h"

#include <dlfcn.h>

#include <cstdlib>
#include <mutex>
#include <stdexcept>

#include "frugal/io/files.h"

namespace frugal {
namespace memory {

namespace {

// The module's handle, set once by load_cuda().
void* module_handle = nullptr;

CudaRuntime load() {
  CudaRuntime r;
  const char* env = std::getenv("FRUGAL_CUDA");
  const std::string mode = env && *env ? env : "auto";
  if (mode != "auto" && mode != "on" && mode != "off") {
    throw std::invalid_argument("FRUGAL_CUDA=" + mode + ": expected auto, on or off");
  }
#ifndef FRUGAL_HAS_CUDA
  r.reason = "this build of frugal has no CUDA (LibTorch without CUDA)";
  if (mode == "on") throw std::invalid_argument("FRUGAL_CUDA=on: " + r.reason);
  return r;
#else
  if (mode == "off") {
    r.reason = "CUDA is off (FRUGAL_CUDA=off)";
    return r;
  }
  if (mode == "auto" && !::dlopen("libcuda.so.1", RTLD_LAZY | RTLD_LOCAL)) {  // kept open: LibTorch loads it too
    r.reason = "no NVIDIA driver on this machine (libcuda.so.1 does not load)";
    return r;
  }
  std::string errors;
  for (const auto& path : io::helper_candidates("FRUGAL_CUDA_MODULE", "libfrugal_cuda.so")) {
    if (void* h = ::dlopen(path.c_str(), RTLD_LAZY | RTLD_LOCAL)) {
      module_handle = h;
      r.loaded = true;
      r.module = path;
      return r;
    }
    const char* e = ::dlerror();
    errors += std::string(errors.empty() ? "" : "; ") + (e ? e : path);
  }
  r.reason = "frugal's CUDA module does not load (" + errors + ")";
  if (mode == "on") throw std::runtime_error("FRUGAL_CUDA=on: " + r.reason);
  return r;
#endif
}

}  // namespace

const CudaRuntime& load_cuda() {
  static std::once_flag once;
  static CudaRuntime runtime;
  std::call_once(once, [] { runtime = load(); });
  return runtime;
}

void* cuda_module_symbol(const char* name) {
  if (!load_cuda().loaded) return nullptr;
  return ::dlsym(module_handle, name);
}

}  // namespace memory
}  // namespace frugal
