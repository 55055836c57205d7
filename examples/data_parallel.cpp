// Data parallel with your own training loop, launched torchrun-style: started without WORLD_SIZE,
// the program launches --nproc copies of itself (frugal::dist::launch_local sets RANK, WORLD_SIZE,
// MASTER_ADDR, MASTER_PORT...) and waits; each copy joins the group, takes its share of every
// batch, and trains with gradients averaged over the ranks and the AdamW state sharded among them
// (each rank keeps and updates 1/N of it, then sends its parameters to the others).
//
//   ./data_parallel --nproc 2
//
// Needs frugal::frugal (dist).
#include <torch/torch.h>

#include <chrono>
#include <cstdio>
#include <cstring>
#include <string>

#include "frugal/dist/group.h"
#include "frugal/dist/launch.h"
#include "frugal/dist/sharded_exchange.h"
#include "frugal/optim/optimizer.h"

struct NetImpl : torch::nn::Module {
  NetImpl() : l1(register_module("l1", torch::nn::Linear(64, 256))), l2(register_module("l2", torch::nn::Linear(256, 8))) {}
  torch::Tensor forward(const torch::Tensor& x) { return l2(torch::relu(l1(x))); }
  torch::nn::Linear l1, l2;
};
TORCH_MODULE(Net);

int train(const frugal::dist::Environment& env) {
  frugal::dist::use_launcher_threads();  // this rank's share of the cores
  auto group = frugal::dist::Group::create(env, std::chrono::seconds(60));
  torch::manual_seed(0);  // the same initial weights on every rank
  Net net;
  frugal::optim::Optimizer optimizer(net->named_parameters(), frugal::optim::AdamWOptions(1e-2));
  const auto owners = frugal::dist::assign_owners(optimizer.parameter_numels(), group->size());
  optimizer.set_exchange(std::make_shared<frugal::dist::ShardedExchange>(group, owners, optimizer.parameter_names()));

  const int64_t batch = 64, share = batch / group->size();
  torch::manual_seed(1);
  const torch::Tensor target_map = torch::randn({64, 8});
  double loss_value = 0;
  for (int step = 0; step < 30; ++step) {
    const torch::Tensor x = torch::randn({batch, 64}), y = x.matmul(target_map);  // the same batch everywhere
    const torch::Tensor mine = x.narrow(0, group->rank() * share, share), my_y = y.narrow(0, group->rank() * share, share);
    const torch::Tensor loss = torch::mse_loss(net->forward(mine), my_y);
    optimizer.backward(loss);
    optimizer.step();  // averages the gradients, updates the owned parameters, shares them
    optimizer.zero_grad();
    torch::Tensor total = loss.detach().reshape({1}).to(torch::kDouble);
    group->allreduce_sum(total, "the step's loss");
    loss_value = total.item<double>() / static_cast<double>(group->size());
    if (group->rank() == 0 && step % 10 == 0) std::printf("step %d loss %.4f\n", step, loss_value);
  }
  // Every rank holds the same parameters: compare a checksum.
  double checksum = 0;
  for (const auto& p : net->parameters()) checksum += p.detach().to(torch::kDouble).sum().item<double>();
  torch::Tensor sums = torch::zeros({group->size()}, torch::kDouble);
  sums[group->rank()] = checksum;
  group->allreduce_sum(sums, "the parameter checksums");
  const bool same = (sums - checksum).abs().max().item<double>() == 0.0;
  if (group->rank() == 0) {
    std::printf("final loss %.4f; %lld ranks, %s parameters; state kept here: %lld bytes\n", loss_value,
                static_cast<long long>(group->size()), same ? "identical" : "DIFFERENT", static_cast<long long>(optimizer.state_bytes()));
  }
  return same ? 0 : 1;
}

int main(int argc, char** argv) {
  try {
    if (auto env = frugal::dist::environment_from_variables()) return train(*env);  // a launched rank
    int64_t nproc = 2;
    for (int i = 1; i + 1 < argc; ++i) {
      if (std::strcmp(argv[i], "--nproc") == 0) nproc = std::stoll(argv[i + 1]);
    }
    frugal::dist::LaunchOptions launch;
    launch.nproc = nproc;
    launch.argv = {"/proc/self/exe"};
    launch.log_dir = "data_parallel_logs";
    const auto result = frugal::dist::launch_local(launch, [](const std::string& line) { std::printf("%s\n", line.c_str()); });
    if (result.exit_code != 0) std::fprintf(stderr, "%s\n", result.failure.c_str());
    return result.exit_code;
  } catch (const std::exception& e) {
    std::fprintf(stderr, "data_parallel: %s\n", e.what());
    return 2;
  }
}
