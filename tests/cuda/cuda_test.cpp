// The CUDA paths, on a machine with a GPU (each test is skipped, saying why, where there is none;
// they compile in every build): the 8- and 4-bit AdamW kernel against the CPU kernel, optimizer
// state in host memory or mapped files streamed through the GPU against state on the GPU, the
// tracker on the CUDA caching allocator, the CUDA generator restored for a checkpoint's recompute,
// the caching allocator's own counters, and the loss (ATen's operations on the GPU) against the
// CPU's fused kernel. `ctest -R Cuda` or `--gtest_filter='Cuda*'`.
#include <gtest/gtest.h>
#include <torch/csrc/autograd/autograd.h>
#include <torch/cuda.h>
#include <torch/nn/modules/linear.h>

#include <algorithm>
#include <cmath>
#include <limits>
#include <string>
#include <vector>

#include "frugal/checkpoint/checkpoint.h"
#include "frugal/loss/chunked_cross_entropy.h"
#include "frugal/memory/cuda_stats.h"
#include "frugal/memory/tracker.h"
#include "frugal/optim/optimizer.h"
#include "frugal/optim/quantize.h"

using namespace frugal;
using namespace frugal::optim;

namespace {

#define FRUGAL_NEED_CUDA()                                                                                        \
  if (!torch::cuda::is_available()) GTEST_SKIP() << "no CUDA device here (torch::cuda::is_available() is false)"; \
  ASSERT_TRUE(cuda_kernels_built()) << "a CUDA device, but this build of frugal has no CUDA kernels"

const at::Device kGpu(at::kCUDA, 0);

// p equal to q bit for bit, NaNs in the same places.
void expect_same(const at::Tensor& p, const at::Tensor& q, const char* what) {
  const at::Tensor a = p.cpu(), b = q.cpu();
  EXPECT_TRUE(at::equal(a.isnan(), b.isnan())) << what;
  EXPECT_TRUE(at::equal(a.nan_to_num(0), b.nan_to_num(0)))
      << what << ": " << (a.nan_to_num(0) != b.nan_to_num(0)).sum().item<int64_t>() << " of " << a.numel() << " differ";
}

// A CPU buffer's state copied into a new buffer on `device` (the same codes and scales).
QuantizedBuffer copy_to(const QuantizedBuffer& q, at::Device device) {
  QuantizedBuffer out(q.numel(), q.bits(), q.block(), q.is_signed(), device);
  out.assign(q.codes().to(device), q.absmax().to(device));
  return out;
}

struct Mlp : torch::nn::Module {
  torch::nn::Linear a{nullptr}, b{nullptr};
  explicit Mlp(uint64_t seed, int64_t d = 128) {
    torch::manual_seed(seed);
    a = register_module("a", torch::nn::Linear(d, 2 * d));
    b = register_module("b", torch::nn::Linear(2 * d, d));
    to(kGpu);
  }
  at::Tensor loss(const at::Tensor& x) { return (b(at::gelu(a(x))) - x.flip(1)).pow(2).mean(); }
};

}  // namespace

TEST(CudaQuantizedAdam, GivesTheCpuKernelsBitsForFp32AndBf16) {
  FRUGAL_NEED_CUDA();
  torch::manual_seed(5);
  for (int bits : {8, 4}) {
    const int64_t block = bits == 8 ? 256 : 128, n = 37 * block + 46;  // a short last block
    // moments spanning several decades, one block all zero, and a non-finite gradient value
    at::Tensor m0 = at::randn({n}) * at::pow(10.0, -at::randint(0, 6, {n}).to(at::kFloat));
    at::Tensor v0 = at::rand({n}) * at::pow(10.0, -at::randint(0, 8, {n}).to(at::kFloat));
    m0.narrow(0, 2 * block, block).zero_();
    v0.narrow(0, 2 * block, block).zero_();
    at::Tensor g0 = at::randn({n}) * 0.1;
    g0[7 * block + 3] = std::numeric_limits<float>::quiet_NaN();
    const at::Tensor p0 = at::randn({n});
    for (bool decoupled : {true, false}) {
      for (at::ScalarType pt : {at::kFloat, at::kBFloat16}) {
        for (at::ScalarType gt : {at::kFloat, at::kBFloat16}) {
          for (bool stochastic : {false, true}) {
            if (stochastic && pt != at::kBFloat16) continue;
            SCOPED_TRACE(std::to_string(bits) + (decoupled ? " adamw p " : " adam p ") + c10::toString(pt) + " g " + c10::toString(gt) +
                         (stochastic ? " stochastic" : " nearest"));
            QuantizedBuffer mc(n, bits, block, true), vc(n, bits, block, false);
            mc.store(0, n, m0);
            vc.store(0, n, v0);
            QuantizedBuffer mg = copy_to(mc, kGpu), vg = copy_to(vc, kGpu);
            at::Tensor pc = p0.to(pt), g = g0.to(gt);
            at::Tensor pg = pc.to(kGpu), gg = g.to(kGpu);
            const AdamStep h{1e-2, 0.9, 0.999, 1e-8, 0.01, 1 - std::pow(0.9, 4), 1 - std::pow(0.999, 4), decoupled};
            const Bf16Rounding rounding{stochastic, 0x9e3779b97f4a7c15ull};
            // two ranges, as the optimizer's chunks call it
            for (auto [b, e] : {std::pair<int64_t, int64_t>{0, 5 * block}, {5 * block, n}}) {
              adam_step_quantized_cpu(h, pc.narrow(0, b, e - b), g.narrow(0, b, e - b), mc, vc, b, e, rounding);
              EXPECT_EQ(adam_step_quantized_cuda(h, pg.narrow(0, b, e - b), gg.narrow(0, b, e - b), mg, vg, b, e, rounding), 0.0);
            }
            expect_same(pg, pc, "parameters");
            EXPECT_GT((pc != p0.to(pt)).sum().item<int64_t>(), n / 2);  // the step moved most of them
            expect_same(mg.codes(), mc.codes(), "m codes");
            expect_same(vg.codes(), vc.codes(), "v codes");
            expect_same(mg.absmax(), mc.absmax(), "m scales");
            expect_same(vg.absmax(), vc.absmax(), "v scales");
          }
        }
      }
    }
  }
}

TEST(CudaQuantizedAdam, StateInHostMemoryIsUpdatedAsStateOnTheDevice) {
  FRUGAL_NEED_CUDA();
  torch::manual_seed(8);
  for (int bits : {8, 4}) {
    SCOPED_TRACE(bits);
    const int64_t block = bits == 8 ? 256 : 128, n = 19 * block + 10;
    QuantizedBuffer mh(n, bits, block, true), vh(n, bits, block, false);
    mh.store(0, n, at::randn({n}) * 0.01);
    vh.store(0, n, at::rand({n}) * 1e-4);
    QuantizedBuffer md = copy_to(mh, kGpu), vd = copy_to(vh, kGpu);
    const at::Tensor p0 = at::randn({n}, kGpu), g = at::randn({n}, kGpu) * 0.1;
    at::Tensor ph = p0.clone(), pd = p0.clone();
    const AdamStep h{1e-3, 0.9, 0.999, 1e-8, 0.01, 1 - 0.9 * 0.9, 1 - 0.999 * 0.999, true};
    EXPECT_GE(adam_step_quantized_cuda(h, ph, g, mh, vh, 0, n, Bf16Rounding{}), 0.0);
    adam_step_quantized_cuda(h, pd, g, md, vd, 0, n, Bf16Rounding{});
    EXPECT_TRUE(mh.codes().device().is_cpu());  // the state stayed where it lives
    expect_same(ph, pd, "parameters");
    expect_same(mh.codes(), md.codes(), "m codes");
    expect_same(vh.codes(), vd.codes(), "v codes");
    expect_same(mh.absmax(), md.absmax(), "m scales");
  }
}

TEST(CudaOptimizer, HostAndMappedStateEqualStateOnTheGpu) {
  FRUGAL_NEED_CUDA();
  torch::manual_seed(99);
  std::vector<at::Tensor> xs;
  for (int i = 0; i < 10; ++i) xs.push_back(at::randn({32, 128}, kGpu));
  auto run = [&](StatePrecision precision, StatePlacement placement, bool in_backward) {
    Mlp m(2);
    Optimizer opt(m.named_parameters(), OptimizerOptions()
                                            .lr(3e-3)
                                            .weight_decay(0.01)
                                            .mode(in_backward ? Mode::in_backward : Mode::standard)
                                            .state(StateOptions().precision(precision).placement(placement)));
    for (const at::Tensor& x : xs) {
      opt.backward(m.loss(x));
      opt.step();
      opt.zero_grad();
    }
    std::vector<at::Tensor> out;
    for (const at::Tensor& p : m.parameters()) out.push_back(p.detach().cpu());
    return out;
  };
  for (StatePrecision precision : {StatePrecision::fp32, StatePrecision::int8, StatePrecision::int4}) {
    for (bool in_backward : {false, true}) {
      SCOPED_TRACE(std::string(precision_name(precision)) + (in_backward ? " in backward" : " standard"));
      const auto on_gpu = run(precision, StatePlacement::device, in_backward);
      for (StatePlacement placement : {StatePlacement::host, StatePlacement::mmap}) {
        const auto streamed = run(precision, placement, in_backward);
        for (size_t i = 0; i < on_gpu.size(); ++i) expect_same(streamed[i], on_gpu[i], placement_name(placement));
      }
    }
  }
}

TEST(CudaTracker, CachingAllocatorAllocationsGetTheirCategories) {
  FRUGAL_NEED_CUDA();
  // cuBLAS takes its workspace from the caching allocator on the first product and keeps it: made
  // before tracking, it is not one of the bytes counted below.
  at::matmul(at::ones({8, 8}, kGpu), at::ones({8, 8}, kGpu));
  auto tracker = memory::Tracker::create();
  at::Tensor w, x;
  {
    memory::TrackingGuard on(tracker);
    {
      memory::CategoryScope scope(memory::Category::parameter);
      w = at::randn({1024, 1024}, kGpu);  // 4 MiB
    }
    {
      memory::CategoryScope scope(memory::Category::input);
      x = at::randn({256, 1024}, kGpu);  // 1 MiB
    }
    {
      memory::PhaseScope forward(memory::Phase::forward);
      at::Tensor y = at::matmul(x, w);
      const memory::CategoryBytes live = tracker->live_by_category();
      EXPECT_GE(live[static_cast<int>(memory::Category::activation)], y.numel() * 4);
    }
  }
  const memory::CategoryBytes live = tracker->live_by_category();
  EXPECT_EQ(live[static_cast<int>(memory::Category::parameter)], w.numel() * 4);
  EXPECT_EQ(live[static_cast<int>(memory::Category::input)], x.numel() * 4);
  EXPECT_EQ(live[static_cast<int>(memory::Category::activation)], 0);  // y was freed
  EXPECT_EQ(tracker->live_bytes(kGpu), (w.numel() + x.numel()) * 4);
  EXPECT_EQ(tracker->live_bytes(at::Device(at::kCPU)), 0);
  EXPECT_GE(tracker->peak_bytes(), (w.numel() + x.numel() + 256 * 1024) * 4);
}

TEST(CudaCheckpoint, DropoutOnTheGpuGivesThePlainRunsGradients) {
  FRUGAL_NEED_CUDA();
  torch::manual_seed(0);
  torch::nn::Linear a(16, 32), b(32, 16);
  a->to(kGpu);
  b->to(kGpu);
  std::vector<at::Tensor> params = a->parameters();
  for (const auto& t : b->parameters()) params.push_back(t);
  auto block = [&](const at::Tensor& in) { return b(at::dropout(at::relu(a(in)), 0.5, /*train=*/true)); };
  const at::Tensor x = at::randn({64, 16}, kGpu).requires_grad_();
  auto grads = [&] {
    std::vector<at::Tensor> g;
    for (const auto& p : params) g.push_back(p.grad().clone());
    for (auto p : params) p.mutable_grad().reset();
    g.push_back(x.grad().clone());
    x.mutable_grad().reset();
    return g;
  };
  torch::manual_seed(42);  // seeds the CUDA generators too
  const at::Tensor y_plain = block(x);
  y_plain.pow(2).sum().backward();
  const auto plain = grads();

  torch::manual_seed(42);
  const at::Tensor y = checkpoint::checkpoint(block, x, params);
  EXPECT_TRUE(at::equal(y, y_plain));
  // The recompute runs in backward, after other CUDA draws: the restored generator gives the masks.
  at::rand({1000}, kGpu);
  y.pow(2).sum().backward();
  const auto checkpointed = grads();
  for (size_t i = 0; i < plain.size(); ++i) EXPECT_TRUE(at::equal(checkpointed[i], plain[i])) << "gradient " << i;
  // Dropout on the GPU draws a new mask each call, so the equality above needs the restore.
  torch::manual_seed(42);
  const at::Tensor y2 = block(x);
  const at::Tensor y3 = block(x);
  EXPECT_FALSE(at::equal(y2, y3));
}

TEST(CudaMemoryStats, PeaksOfTheCachingAllocatorFollowAnAllocation) {
  if (!torch::cuda::is_available()) {
    const memory::CudaMemoryStats s = memory::cuda_memory_stats(0);
    EXPECT_FALSE(s.available);
    EXPECT_FALSE(s.unavailable_reason.empty());
    GTEST_SKIP() << "no CUDA device here: " << s.unavailable_reason;
  }
  memory::reset_cuda_peak_stats(0);
  const memory::CudaMemoryStats before = memory::cuda_memory_stats(0);
  ASSERT_TRUE(before.available);
  const int64_t bytes = int64_t{64} << 20;
  {
    at::Tensor t = at::empty({bytes}, at::TensorOptions().dtype(at::kByte).device(kGpu));
    const memory::CudaMemoryStats during = memory::cuda_memory_stats(0);
    EXPECT_EQ(during.allocated_bytes, before.allocated_bytes + bytes);  // 64 MiB: a multiple of every rounding
    EXPECT_GE(during.reserved_bytes, during.allocated_bytes);
  }
  const memory::CudaMemoryStats after = memory::cuda_memory_stats(0);
  EXPECT_EQ(after.allocated_bytes, before.allocated_bytes);
  EXPECT_EQ(after.peak_allocated_bytes, before.allocated_bytes + bytes);
  EXPECT_GE(after.reserved_bytes, before.allocated_bytes + bytes);  // the block stays reserved for reuse
  EXPECT_GE(after.peak_reserved_bytes, after.peak_allocated_bytes);
  EXPECT_FALSE(memory::cuda_memory_stats(1000).available);
}

// The loss on the GPU, made of ATen's operations, against the CPU's fused kernel: loss and
// gradients within 1e-5 (relative to the largest entry), chunked and plain, with a fifth of the
// targets ignored; with all of them ignored, the mean is NaN and every gradient 0 on both.
TEST(CudaLoss, MatchesTheCpuKernel) {
  if (!torch::cuda::is_available()) GTEST_SKIP() << "no CUDA device here (torch::cuda::is_available() is false)";
  torch::manual_seed(6);
  const int64_t N = 70, H = 32, V = 333;
  const at::Tensor hidden = at::randn({N, H}), weight = at::randn({V, H}) * 0.3, bias = at::randn({V});
  for (bool all_ignored : {false, true}) {
    at::Tensor targets = at::randint(0, V, {N}, at::kLong);
    targets.index_put_({all_ignored ? at::ones({N}, at::kBool) : at::rand({N}) < 0.2}, -100);
    for (int64_t chunk : {16, 0}) {
      SCOPED_TRACE(std::string(all_ignored ? "all ignored, " : "") + (chunk == 0 ? "plain" : "chunks of 16"));
      auto run = [&](at::Device device) {
        const at::Tensor h = hidden.to(device).requires_grad_(), w = weight.to(device).requires_grad_();
        const at::Tensor b = bias.to(device).requires_grad_(), t = targets.to(device);
        const auto options = loss::ChunkedCrossEntropyOptions().chunk_size(chunk == 0 ? 1 : chunk);
        const at::Tensor l =
            chunk == 0 ? loss::linear_cross_entropy(h, w, b, t, options) : loss::chunked_cross_entropy(h, w, b, t, options);
        std::vector<at::Tensor> out = {l.detach().cpu()};
        for (const at::Tensor& g : torch::autograd::grad({l * 3.0}, {h, w, b})) out.push_back(g.cpu());
        return out;
      };
      const auto gpu = run(kGpu), cpu = run(at::kCPU);
      if (all_ignored) {
        EXPECT_TRUE(std::isnan(gpu[0].item<double>()));
        EXPECT_TRUE(std::isnan(cpu[0].item<double>()));
      } else {
        EXPECT_NEAR(gpu[0].item<double>(), cpu[0].item<double>(), 1e-5 * std::abs(cpu[0].item<double>()));
      }
      for (size_t i = 1; i < gpu.size(); ++i) {
        const double scale = std::max(cpu[i].abs().max().item<double>(), 1e-12);
        EXPECT_LE((gpu[i] - cpu[i]).abs().max().item<double>() / scale, 1e-5) << "gradient " << i;
        if (all_ignored) {
          EXPECT_EQ(gpu[i].abs().max().item<double>(), 0.0) << "gradient " << i;
        }
      }
    }
  }
}
