// src/dist/backend.h (private) — the c10d type collectives are called on, in both LibTorch
// versions (1.13's backends are ProcessGroups; 2.x's derive from c10d::Backend), and the NCCL
// backend, which exists only in a CUDA build: nccl_module.cpp in libfrugal_cuda.so, reached through
// nccl.cpp (memory/cuda_runtime.h).
#pragma once

#include <torch/csrc/distributed/c10d/Store.hpp>
#include <torch/version.h>
#if TORCH_VERSION_MAJOR >= 2
#include <torch/csrc/distributed/c10d/Backend.hpp>
#else
#include <torch/csrc/distributed/c10d/ProcessGroup.hpp>
#endif

#include <chrono>

namespace frugal {
namespace dist {

#if TORCH_VERSION_MAJOR >= 2
using BackendBase = c10d::Backend;
#else
using BackendBase = c10d::ProcessGroup;
#endif

// NCCL over `store` for CUDA tensors on this rank's device; null when frugal's CUDA module is not
// loaded (a build without CUDA, or no NVIDIA driver).
c10::intrusive_ptr<BackendBase> make_nccl_backend(const c10::intrusive_ptr<c10d::Store>& store, int rank, int size,
                                                  std::chrono::milliseconds timeout);

}  // namespace dist
}  // namespace frugal
