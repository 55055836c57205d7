#include "frugal/checkpoint/sequential.h"

namespace frugal {
namespace checkpoint {

at::Tensor checkpoint_sequential(torch::nn::Sequential sequential, int64_t segments, const at::Tensor& input,
                                 const CheckpointOptions& options) {
  const int64_t n = static_cast<int64_t>(sequential->size());
  TORCH_CHECK(segments >= 1 && segments <= n, "checkpoint_sequential: segments must be between 1 and the number of ", "modules (", n,
              "), got ", segments);
  std::vector<torch::nn::AnyModule> modules(sequential->begin(), sequential->end());
  const int64_t segment_size = n / segments;
  // Runs modules [begin, end) one after the other.
  auto run = [modules](int64_t begin, int64_t end) {
    return [modules, begin, end](const at::Tensor& x) mutable {
      at::Tensor y = x;
      for (int64_t i = begin; i < end; ++i) y = modules[static_cast<size_t>(i)].forward(y);
      return y;
    };
  };
  at::Tensor x = input;
  int64_t begin = 0;
  for (int64_t s = 0; s + 1 < segments; ++s, begin += segment_size) {
    std::vector<at::Tensor> params, buffers;
    for (int64_t i = begin; i < begin + segment_size; ++i) {
      const auto module = modules[static_cast<size_t>(i)].ptr();
      for (const auto& p : module->parameters()) params.push_back(p);
      for (const auto& b : module->buffers()) buffers.push_back(b);
    }
    CheckpointOptions opt = options;
    opt.name("segment " + std::to_string(s) + " (modules " + std::to_string(begin) + "-" + std::to_string(begin + segment_size - 1) + ")");
    opt.buffers(buffers);
    x = checkpoint(run(begin, begin + segment_size), x, params, opt);
  }
  return run(begin, n)(x);
}

}  // namespace checkpoint
}  // namespace frugal
