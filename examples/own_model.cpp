// Your own torch::nn model, trained the LibTorch way, then with frugal's cuts: checkpointed blocks,
// 8-bit AdamW state stepped inside backward, and the memory tracker's breakdown of both runs.
//
//   ./own_model            # prints each run's peak by category and the ratio
//
// Needs frugal::core only (LibTorch and nothing else).
#include <torch/torch.h>

#include <cstdio>
#include <iostream>

#include "frugal/checkpoint/checkpoint.h"
#include "frugal/memory/tracker.h"
#include "frugal/optim/optimizer.h"

// A residual MLP block: x + W2 gelu(W1 norm(x)).
struct BlockImpl : torch::nn::Module {
  explicit BlockImpl(int64_t d)
      : norm(register_module("norm", torch::nn::LayerNorm(torch::nn::LayerNormOptions({d})))),
        up(register_module("up", torch::nn::Linear(d, 4 * d))),
        down(register_module("down", torch::nn::Linear(4 * d, d))) {}
  torch::Tensor forward(const torch::Tensor& x) { return x + down(torch::gelu(up(norm(x)))); }
  torch::nn::LayerNorm norm;
  torch::nn::Linear up, down;
};
TORCH_MODULE(Block);

struct NetImpl : torch::nn::Module {
  NetImpl(int64_t d, int64_t layers, int64_t classes) {
    for (int64_t i = 0; i < layers; ++i) blocks.push_back(register_module("block" + std::to_string(i), Block(d)));
    head = register_module("head", torch::nn::Linear(d, classes));
  }
  torch::Tensor forward(torch::Tensor x, bool checkpointed) {
    // A checkpointed block keeps only its input; its insides are recomputed in backward.
    for (auto& b : blocks) x = checkpointed ? frugal::checkpoint::checkpoint(b, x) : b(x);
    return head(x);
  }
  std::vector<Block> blocks;
  torch::nn::Linear head{nullptr};
};
TORCH_MODULE(Net);

struct Run {
  frugal::memory::MemoryReport report;
  double last_loss = 0;
};

Run train(bool frugal_cuts) {
  torch::manual_seed(0);
  Net net(256, 8, 16);  // built first, as LibTorch code does; the tracker adopts it
  auto tracker = frugal::memory::Tracker::create(/*keep_events=*/false);
  tracker->watch(*net);
  frugal::memory::TrackingGuard tracking(tracker);

  auto options = frugal::optim::AdamWOptions(1e-3);  // torch::optim's defaults (weight decay 1e-2)
  if (frugal_cuts) {
    options.state_precision(frugal::optim::StatePrecision::int8).mode(frugal::optim::Mode::in_backward);
  }
  frugal::optim::Optimizer optimizer(net->parameters(), options);

  Run run;
  torch::manual_seed(1);
  for (int step = 0; step < 6; ++step) {
    const torch::Tensor x = torch::randn({16, 64, 256}), y = torch::randint(16, {16, 64});
    const torch::Tensor loss = torch::nn::functional::cross_entropy(net->forward(x, frugal_cuts).flatten(0, 1), y.flatten());
    optimizer.backward(loss);  // in-backward mode updates each parameter as its gradient completes
    optimizer.step();
    optimizer.zero_grad();
    run.last_loss = loss.item<double>();
  }
  run.report = tracker->report();  // the steady-state peak (from the second step on)
  return run;
}

int main() {
  const Run plain = train(false), cut = train(true);
  std::cout << "plain  AdamW:                          " << plain.report << "\n"
            << "frugal checkpointed, int8 in backward: " << cut.report << "\n";
  std::printf("peak %.2fx of plain; last loss %.4f (plain) %.4f (frugal)\n",
              static_cast<double>(cut.report.peak_bytes) / static_cast<double>(plain.report.peak_bytes), plain.last_loss, cut.last_loss);
  return 0;
}
