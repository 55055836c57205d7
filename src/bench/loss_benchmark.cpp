#include "frugal/bench/loss_benchmark.h"

#include <ATen/ATen.h>
#include <torch/cuda.h>
#include <torch/nn/functional/loss.h>

#include <algorithm>
#include <chrono>
#include <functional>

#include "frugal/loss/chunked_cross_entropy.h"
#include "frugal/memory/tracker.h"

namespace frugal {
namespace bench {
namespace {

struct StepResult {
  int64_t peak_above_start = 0;
  double loss = 0;
  at::Tensor grad_hidden, grad_weight;
};

}  // namespace

ChunkedLossResult run_chunked_loss_benchmark(const ChunkedLossConfig& c) {
  torch::manual_seed(c.seed);
  const auto options = at::TensorOptions().device(c.device);
  at::Tensor hidden = at::randn({c.tokens, c.hidden}, options).requires_grad_();             // (N, H)
  at::Tensor weight = (at::randn({c.vocab, c.hidden}, options) * 0.02).requires_grad_();     // (V, H)
  const at::Tensor targets = at::randint(0, c.vocab, {c.tokens}, options.dtype(at::kLong));  // (N)

  using LossFn = std::function<at::Tensor()>;
  const LossFn reference = [&] {
    return torch::nn::functional::cross_entropy(at::linear(hidden, weight), targets);  // logits: (N, V)
  };
  const LossFn plain = [&] {  // the (N, V) logits, kept for backward
    return loss::linear_cross_entropy(hidden, weight, at::Tensor(), targets);
  };
  const LossFn chunked = [&] {
    return loss::chunked_cross_entropy(hidden, weight, at::Tensor(), targets, loss::ChunkedCrossEntropyOptions().chunk_size(c.chunk));
  };
  auto clear = [&] {
    hidden.mutable_grad().reset();
    weight.mutable_grad().reset();
  };
  auto measure = [&](const LossFn& fn) {
    clear();
    StepResult r;
    auto tracker = memory::Tracker::create();
    {
      memory::TrackingGuard on(tracker);
      at::Tensor loss;
      {
        memory::PhaseScope fw(memory::Phase::forward);
        loss = fn();
      }
      {
        memory::PhaseScope bw(memory::Phase::backward);
        loss.backward();
      }
      r.loss = loss.item<double>();
      r.peak_above_start = tracker->peak_bytes();  // nothing was live in this tracker at the start
      r.grad_hidden = hidden.grad();
      r.grad_weight = weight.grad();
      clear();
    }
    return r;
  };
  auto time = [&](const LossFn& fn) {
    std::vector<double> s;
    for (int r = 0; r < c.timing_runs + 1; ++r) {  // the first run warms up
      clear();
      const auto t0 = std::chrono::steady_clock::now();
      fn().backward();
      if (c.device.is_cuda()) torch::cuda::synchronize(c.device.index());
      if (r > 0) s.push_back(std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count());
    }
    clear();
    std::sort(s.begin(), s.end());
    return s.empty() ? 0.0 : s[s.size() / 2];
  };

  ChunkedLossResult result;
  const StepResult p = measure(plain);
  const StepResult k = measure(chunked);
  result.peak_bytes_plain = p.peak_above_start;
  result.peak_bytes_chunked = k.peak_above_start;
  result.loss_plain = p.loss;
  result.loss_chunked = k.loss;
  auto rel = [](const at::Tensor& a, const at::Tensor& b) { return ((a - b).abs().max() / b.abs().max().clamp_min(1e-30)).item<double>(); };
  {
    const StepResult r = measure(reference);  // after the others: its gradients are not live while they run
    result.max_rel_grad_diff = std::max({rel(p.grad_hidden, r.grad_hidden), rel(p.grad_weight, r.grad_weight),
                                         rel(k.grad_hidden, r.grad_hidden), rel(k.grad_weight, r.grad_weight)});
  }
  if (c.timing_runs > 0) {
    result.time_s_plain = time(plain);
    result.time_s_chunked = time(chunked);
  }
  return result;
}

}  // namespace bench
}  // namespace frugal
