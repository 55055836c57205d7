// Checkpointing planned for a memory budget on your own blocks: measure what each block keeps for
// backward, let the planner choose the blocks to recompute (the least recompute that fits), run
// the plan, and check the activation peak the tracker measures against the budget.
//
//   ./plan_budget [budget_MiB]      # default: half of what the plain chain keeps
//
// Needs frugal::core only.
#include <torch/torch.h>

#include <cstdio>
#include <cstdlib>

#include "frugal/checkpoint/planner.h"
#include "frugal/memory/tracker.h"

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

// The activation bytes at the peak of one forward and backward of the chain under `plan`.
int64_t measured_activation_peak(const std::vector<frugal::checkpoint::ChainBlock>& chain, const torch::Tensor& x,
                                 const frugal::checkpoint::ActivationPlan& plan) {
  using frugal::memory::Phase;
  auto tracker = frugal::memory::Tracker::create();
  frugal::memory::TrackingGuard tracking(tracker);
  torch::Tensor loss;
  {
    frugal::memory::PhaseScope forward(Phase::forward);
    loss = frugal::checkpoint::run_plan(chain, x, plan).pow(2).mean();
  }
  {
    frugal::memory::PhaseScope backward(Phase::backward);
    loss.backward();
  }
  return tracker->report().activation;
}

int main(int argc, char** argv) {
  torch::manual_seed(0);
  std::vector<Block> blocks;
  for (int i = 0; i < 12; ++i) blocks.emplace_back(128);
  const auto chain = frugal::checkpoint::make_chain(blocks);
  const torch::Tensor x = torch::randn({8, 64, 128});

  const auto costs = frugal::checkpoint::measure_chain(chain, x);
  const auto plain = frugal::checkpoint::no_checkpoint_plan(costs);
  const int64_t budget = argc > 1 ? static_cast<int64_t>(std::atof(argv[1]) * (1 << 20)) : plain.predicted_bytes / 2;
  const auto plan = frugal::checkpoint::plan_for_budget(costs, budget);
  if (!plan) {
    std::fprintf(stderr, "no plan fits %.1f MiB; the least any plan needs is %.1f MiB\n", budget / 1048576.0,
                 frugal::checkpoint::min_achievable_bytes(costs) / 1048576.0);
    return 2;
  }
  const int64_t measured_plain = measured_activation_peak(chain, x, plain);
  const int64_t measured = measured_activation_peak(chain, x, *plan);
  std::printf("plain:  predicted %.2f MiB, measured %.2f MiB\n", plain.predicted_bytes / 1048576.0, measured_plain / 1048576.0);
  std::printf("budget %.2f MiB: plan %s (%lld of %zu blocks recomputed, %.1f ms more a step)\n", budget / 1048576.0,
              plan->describe().c_str(), static_cast<long long>(plan->checkpointed_blocks()), chain.size(), plan->recompute_s * 1e3);
  std::printf("        predicted %.2f MiB, measured %.2f MiB: %s\n", plan->predicted_bytes / 1048576.0, measured / 1048576.0,
              measured <= budget * 1.05 ? "within the budget" : "OVER the budget");
  return measured <= budget * 1.05 ? 0 : 1;
}
