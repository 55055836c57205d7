// The NCCL backend from frugal's CUDA module (nccl_module.cpp), when it is loaded.
#include "backend.h"

#include "frugal/memory/cuda_runtime.h"

namespace frugal {
namespace dist {

c10::intrusive_ptr<BackendBase> make_nccl_backend(const c10::intrusive_ptr<c10d::Store>& store, int rank, int size,
                                                  std::chrono::milliseconds timeout) {
  using Entry = void (*)(const c10::intrusive_ptr<c10d::Store>&, int, int, int64_t, c10::intrusive_ptr<BackendBase>*);
  static const auto entry = reinterpret_cast<Entry>(memory::cuda_module_symbol("frugal_cuda_make_nccl_backend"));
  c10::intrusive_ptr<BackendBase> backend;
  if (entry) entry(store, rank, size, static_cast<int64_t>(timeout.count()), &backend);
  return backend;
}

}  // namespace dist
}  // namespace frugal
