// Every checkpointing policy on a stack of Transformer blocks gives the plain run's output, input
// gradient and parameter gradients.
#include <gtest/gtest.h>

#include "frugal/checkpoint/policy.h"
#include "frugal/models/transformer_block.h"

using namespace frugal;
using checkpoint::CheckpointPolicy;

TEST(Policy, ParseAndName) {
  for (const char* name : {"none", "full", "every_1", "every_3", "selective"}) {
    EXPECT_EQ(CheckpointPolicy::parse(name).name(), name);
  }
  for (const char* bad : {"", "all", "every_", "every_0", "every_x", "every_-2", "Full"}) {
    EXPECT_THROW(CheckpointPolicy::parse(bad), std::invalid_argument) << bad;
  }
  const auto every3 = CheckpointPolicy::parse("every_3");
  EXPECT_TRUE(every3.checkpoints(0));
  EXPECT_FALSE(every3.checkpoints(1));
  EXPECT_FALSE(every3.checkpoints(2));
  EXPECT_TRUE(every3.checkpoints(3));
  EXPECT_FALSE(CheckpointPolicy::none().checkpoints(0));
  EXPECT_TRUE(CheckpointPolicy::selective().options().keep_linear_outputs());
  EXPECT_FALSE(CheckpointPolicy::full().options().keep_linear_outputs());
}

TEST(Policy, EveryPolicyMatchesThePlainStack) {
  torch::manual_seed(0);
  std::vector<models::PreLNBlock> blocks;
  for (int i = 0; i < 4; ++i) blocks.emplace_back(32, 4);
  const auto chain = checkpoint::make_chain(blocks);
  std::vector<at::Tensor> params;
  for (auto& b : blocks) {
    for (auto& p : b->parameters()) params.push_back(p);
  }
  at::Tensor x = at::randn({3, 10, 32}).requires_grad_();

  auto run = [&](const CheckpointPolicy& policy, at::Tensor* out, std::vector<at::Tensor>* grads) {
    x.mutable_grad().reset();
    for (auto& p : params) p.mutable_grad().reset();
    *out = checkpoint::run_chain(chain, x, policy);
    out->pow(2).mean().backward();
    grads->clear();
    grads->push_back(x.grad().clone());
    for (auto& p : params) grads->push_back(p.grad().clone());
  };
  at::Tensor ref_out;
  std::vector<at::Tensor> ref_grads;
  run(CheckpointPolicy::none(), &ref_out, &ref_grads);
  for (const char* name : {"full", "every_2", "every_3", "selective"}) {
    SCOPED_TRACE(name);
    at::Tensor out;
    std::vector<at::Tensor> grads;
    run(CheckpointPolicy::parse(name), &out, &grads);
    EXPECT_LE((out - ref_out).abs().max().item<double>(), 1e-6);
    ASSERT_EQ(grads.size(), ref_grads.size());
    for (size_t i = 0; i < grads.size(); ++i) {
      ASSERT_TRUE(grads[i].defined());
      EXPECT_LE((grads[i] - ref_grads[i]).abs().max().item<double>(), 1e-6) << "gradient " << i;
    }
  }
}
