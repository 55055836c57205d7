#include <torch/csrc/distributed/c10d/ProcessGroupNCCL.hpp>

#include "backend.h"

namespace frugal {
namespace dist {

c10::intrusive_ptr<BackendBase> make_nccl_backend(const c10::intrusive_ptr<c10d::Store>& store, int rank, int size,
                                                  std::chrono::milliseconds timeout) {
  auto options = c10d::ProcessGroupNCCL::Options::create();
  options->timeout = timeout;
  // Its own key space in the store, beside Gloo's.
  auto prefixed = c10::make_intrusive<c10d::PrefixStore>("nccl", store);
  return c10::make_intrusive<c10d::ProcessGroupNCCL>(prefixed, rank, size, options);
}

}  // namespace dist
}  // namespace frugal
