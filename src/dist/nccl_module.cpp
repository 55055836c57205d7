// In libfrugal_cuda.so (memory/cuda_runtime.h): c10d's NCCL backend, which lives in LibTorch's CUDA half.
#include <torch/csrc/distributed/c10d/ProcessGroupNCCL.hpp>

#include "backend.h"

extern "C" __attribute__((visibility("default"))) void frugal_cuda_make_nccl_backend(const c10::intrusive_ptr<c10d::Store>& store, int rank,
                                                                                     int size, int64_t timeout_ms,
                                                                                     c10::intrusive_ptr<frugal::dist::BackendBase>* out) {
  auto options = c10d::ProcessGroupNCCL::Options::create();
  options->timeout = std::chrono::milliseconds(timeout_ms);
  // Its own key space in the store, beside Gloo's.
  auto prefixed = c10::make_intrusive<c10d::PrefixStore>("nccl", store);
  *out = c10::make_intrusive<c10d::ProcessGroupNCCL>(prefixed, rank, size, options);
}
