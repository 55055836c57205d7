// frugal/memory/cuda_runtime.h — CUDA brought into the process only where it can run.
//
// A CUDA build of LibTorch (PyPI's torch wheel) loads libtorch_cuda and the CUDA libraries (cuBLAS,
// cuDNN, NCCL...) with the program: about 250 MiB of resident memory, paid even on a machine without
// a GPU. frugal keeps its own CUDA code (the quantized AdamW kernel, the caching allocator's
// counters, the NCCL backend) in a module of its own, libfrugal_cuda.so, linked against the whole
// of LibTorch; the library itself and the CLI link only LibTorch's CPU part. load_cuda() loads the
// module, and with it LibTorch's CUDA half, where an NVIDIA driver is installed; elsewhere CUDA is
// simply unavailable, as it would be anyway (torch::cuda::is_available() is false).
//
//   const frugal::memory::CudaRuntime& cuda = frugal::memory::load_cuda();  // once, before any CUDA tensor
//   if (!cuda.loaded) std::cerr << "CPU only: " << cuda.reason << "\n";
//
// $FRUGAL_CUDA: auto (the default: load where libcuda.so.1, the driver's library, loads), on (load
// even without a driver, e.g. to test the module's loading) or off (never). The module is looked
// for at $FRUGAL_CUDA_MODULE, then next to the running executable, then in frugal's build folder
// (io::helper_candidates); an installed package's frugal_copy_helpers() puts it next to a program.
// The CLI calls load_cuda() first thing; a program linking LibTorch's CUDA half itself gets it
// loaded on first use by frugal's CUDA entry points.
#pragma once

#include <string>

namespace frugal {
namespace memory {

// What load_cuda() did: whether the CUDA module is loaded, and from where or why not.
struct CudaRuntime {
  bool loaded = false;  // libfrugal_cuda.so (and LibTorch's CUDA libraries) are in the process
  std::string reason;   // why not, when not: one sentence
  std::string module;   // the module's path, when loaded
};

// Loads the module the first time it is called (thread-safe; later calls return the same answer).
// Throws std::invalid_argument for a $FRUGAL_CUDA that is not auto, on or off, or that is on in a
// build without CUDA, and std::runtime_error when $FRUGAL_CUDA=on and the module does not load.
const CudaRuntime& load_cuda();

// An entry point of the loaded module (load_cuda() first); nullptr when the module is not loaded.
void* cuda_module_symbol(const char* name);

}  // namespace memory
}  // namespace frugal
