#include "frugal/bench/optim_benchmark.h"

#include <torch/cuda.h>

#include <algorithm>
#include <chrono>

#include "block_stack.h"
#include "frugal/checkpoint/policy.h"
#include "frugal/memory/trace.h"
#include "frugal/memory/tracker.h"
#include "frugal/models/transformer_block.h"
#include "frugal/optim/optimizer.h"

namespace frugal {
namespace bench {
namespace {

using memory::Category;
using memory::Phase;

int64_t bytes_of(const at::Tensor& t) { return t.numel() * static_cast<int64_t>(t.element_size()); }

// The most gradient bytes one backward node hands over: a checkpointed block's parameters all at
// once, otherwise the parameters of one leaf module (a Linear's weight and bias).
int64_t largest_node_grad_bytes(BlockStack& stack, const checkpoint::CheckpointPolicy& policy) {
  int64_t largest = 0;
  for (size_t i = 0; i < stack.blocks.size(); ++i) {
    if (policy.checkpoints(static_cast<int64_t>(i))) {
      int64_t region = 0;
      for (const auto& p : stack.blocks[i]->parameters()) region += bytes_of(p);
      largest = std::max(largest, region);
      continue;
    }
    for (const auto& module : stack.blocks[i]->modules(/*include_self=*/false)) {
      int64_t own = 0;
      for (const auto& p : module->parameters(/*recurse=*/false)) own += bytes_of(p);
      largest = std::max(largest, own);
    }
  }
  return largest;
}

struct Trainer {
  BlockStack stack;
  optim::Optimizer opt;
  checkpoint::CheckpointPolicy policy;
  Trainer(const OptimInBackwardConfig& c, optim::Mode mode)
      : stack(c.layers, c.width, c.heads, c.seed, c.device),
        opt(stack.named_parameters(), optim::OptimizerOptions().algorithm(optim::Algorithm::adamw).lr(1e-4).weight_decay(0.01).mode(mode)),
        policy(checkpoint::CheckpointPolicy::parse(c.policy)) {}

  // One training step; returns the bytes kept between forward and backward when tracked.
  int64_t step(const at::Tensor& x, memory::Tracker* tracker) {
    const int64_t before = tracker ? tracker->live_bytes() : 0;
    at::Tensor loss;
    {
      memory::PhaseScope fw(Phase::forward);
      loss = checkpoint::run_chain(stack.chain, x, policy).pow(2).mean();
    }
    const int64_t kept = tracker ? tracker->live_bytes() - before : 0;
    {
      memory::PhaseScope bw(Phase::backward);
      opt.backward(loss);
    }
    loss.reset();
    {
      memory::PhaseScope op(Phase::optimizer);
      opt.step();
    }
    opt.zero_grad();
    return kept;
  }
};

struct MemoryMeasure {
  int64_t peak = 0, max_live_grads = 0, kept = 0;
};

MemoryMeasure measure(Trainer& t, const std::vector<at::Tensor>& batches) {
  auto tracker = memory::Tracker::create();
  MemoryMeasure m;
  memory::TrackingGuard on(tracker);
  size_t steady_from = 0;  // the first event of the second step: the first also creates the optimizer state
  for (size_t i = 0; i < batches.size(); ++i) {
    memory::mark_step(static_cast<int64_t>(i));
    if (i == 1) steady_from = tracker->events().size();
    m.kept = t.step(batches[i], tracker.get());
  }
  const auto steady = memory::peak_over_steps(tracker->step_summaries(), 1);
  m.peak = steady.peak_bytes;
  m.max_live_grads = memory::max_by_category(tracker->events(), steady_from)[static_cast<int>(Category::gradient)];
  return m;
}

}  // namespace

OptimInBackwardResult run_optim_in_backward_benchmark(const OptimInBackwardConfig& c) {
  TORCH_CHECK(c.memory_steps >= 2, "the optimizer benchmark needs at least 2 tracked steps");
  Trainer standard(c, optim::Mode::standard), in_backward(c, optim::Mode::in_backward);
  torch::manual_seed(c.seed + 1);
  std::vector<at::Tensor> batches;
  for (int i = 0; i < c.memory_steps + c.timing_runs + 1; ++i) {
    batches.push_back(at::randn({c.batch, c.seq, c.width}, at::TensorOptions().device(c.device)));  // (B, T, d)
  }
  const std::vector<at::Tensor> memory_batches(batches.begin(), batches.begin() + c.memory_steps);
  OptimInBackwardResult r;
  for (const auto& p : standard.stack.parameters()) r.param_bytes += bytes_of(p);
  r.grad_bytes = r.param_bytes;
  r.largest_grad_bytes = largest_node_grad_bytes(standard.stack, standard.policy);

  const MemoryMeasure ms = measure(standard, memory_batches);
  const MemoryMeasure mb = measure(in_backward, memory_batches);
  r.peak_bytes_standard = ms.peak;
  r.peak_bytes_in_backward = mb.peak;
  r.max_live_grad_bytes_standard = ms.max_live_grads;
  r.max_live_grad_bytes_in_backward = mb.max_live_grads;
  r.activation_bytes = ms.kept;
  r.state_bytes = standard.opt.state_bytes();

  if (c.timing_runs > 0) {
    std::vector<double> ts, tb;
    auto timed = [&](Trainer& t, const at::Tensor& x) {
      const auto t0 = std::chrono::steady_clock::now();
      t.step(x, nullptr);
      if (c.device.is_cuda()) torch::cuda::synchronize(c.device.index());
      return std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
    };
    for (int i = 0; i <= c.timing_runs; ++i) {  // interleaved, so drift hits both modes alike
      const at::Tensor& x = batches[static_cast<size_t>(c.memory_steps + i)];
      const double a = timed(standard, x), b = timed(in_backward, x);
      if (i > 0) {
        ts.push_back(a);
        tb.push_back(b);
      }
    }
    std::sort(ts.begin(), ts.end());
    std::sort(tb.begin(), tb.end());
    r.time_s_standard = ts[ts.size() / 2];
    r.time_s_in_backward = tb[tb.size() / 2];
  }
  auto pa = standard.stack.parameters(), pb = in_backward.stack.parameters();
  for (size_t i = 0; i < pa.size(); ++i) r.max_param_diff = std::max(r.max_param_diff, (pa[i] - pb[i]).abs().max().item<double>());
  return r;
}

}  // namespace bench
}  // namespace frugal
