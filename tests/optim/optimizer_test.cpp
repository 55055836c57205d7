// frugal's optimizer: its updates equal torch::optim's, in-backward mode equals standard mode on a
// real model (with and without checkpointing), param groups, clipping in both modes, accumulation,
// the refusals, state dicts that move between modes, and in-backward updates on a thread of their
// own (the hook's bits, failures, the tracker's view).
#include <gtest/gtest.h>
#include <torch/nn/modules/linear.h>
#include <torch/nn/utils/clip_grad.h>
#include <torch/optim/adam.h>
#include <torch/optim/adamw.h>
#include <torch/optim/sgd.h>
#include <torch/serialize.h>

#include <filesystem>

#include "frugal/checkpoint/policy.h"
#include "frugal/memory/tracker.h"
#include "frugal/models/transformer_block.h"
#include "frugal/optim/optimizer.h"
#include "frugal/optim/schedule.h"
#include "frugal/optim/update.h"
#include "../support/common.h"

using namespace frugal;
using optim::Algorithm;
using optim::Clip;
using optim::Mode;
using optim::OptimizerOptions;

namespace {

using frugal::testing::max_param_diff;

// A small Transformer stack with named parameters, deterministic from a seed.
struct Model : torch::nn::Module {
  std::vector<models::PreLNBlock> blocks;
  std::vector<checkpoint::ChainBlock> chain;
  explicit Model(int layers = 2, int64_t d = 32, uint64_t seed = 0) {
    torch::manual_seed(seed);
    for (int i = 0; i < layers; ++i) blocks.push_back(register_module("block" + std::to_string(i), models::PreLNBlock(d, 4)));
    chain = checkpoint::make_chain(blocks);
  }
  at::Tensor loss(const at::Tensor& x, const checkpoint::CheckpointPolicy& policy = checkpoint::CheckpointPolicy::none()) {
    return checkpoint::run_chain(chain, x, policy).pow(2).mean();
  }
};

std::vector<at::Tensor> batches(int n, uint64_t seed = 1) {
  torch::manual_seed(seed);
  std::vector<at::Tensor> out;
  for (int i = 0; i < n; ++i) out.push_back(at::randn({2, 8, 32}));
  return out;
}

void run_steps(Model& model, optim::Optimizer& opt, const std::vector<at::Tensor>& data,
               const checkpoint::CheckpointPolicy& policy = checkpoint::CheckpointPolicy::none(), optim::LRScheduler* sched = nullptr) {
  for (const auto& x : data) {
    opt.backward(model.loss(x, policy));
    opt.step();
    opt.zero_grad();
    if (sched) sched->step();
  }
}

std::vector<at::Tensor> in_dtype(const std::vector<at::Tensor>& data, at::ScalarType dtype) {
  std::vector<at::Tensor> out;
  for (const auto& x : data) out.push_back(x.to(dtype));
  return out;
}

// How far frugal's parameters may be from torch::optim's after a short training run. fp64 takes
// ATen's operations, and so does fp32 where the fused CPU kernel is not taken: the same bits (the
// bound only absorbs nothing). fp32 Adam(W) with the kernel gives torch::optim's bits where
// LibTorch's sqrt is correctly rounded (1.13); with 2.15's MKL sqrt each step may differ by an ulp,
// which Adam's sign-like step turns into lr-sized moves of near-zero-gradient values over a run, as
// PyTorch's own fused=True AdamW does against its for-loop one (3.6e-3 after 20 steps on a model of
// this kind). Measured here: 1.8e-3 (20 steps, lr 1e-2) and 6.5e-4 (param groups). Bound: 5e-3.
double torch_optim_tolerance(Algorithm algorithm, at::ScalarType dtype) {
  const bool kernel_ulps =
      dtype == at::kFloat && algorithm != Algorithm::sgd && optim::adam_takes_dense_kernel() && !optim::adam_kernel_gives_aten_bits();
  return kernel_ulps ? 5e-3 : 1e-6;
}

void train_reference(Model& model, torch::optim::Optimizer& opt, const std::vector<at::Tensor>& data) {
  for (const auto& x : data) {
    opt.zero_grad();
    model.loss(x).backward();
    opt.step();
  }
}

}  // namespace

TEST(Optimizer, UpdatesEqualTorchOptimAfter20Steps) {
  const auto data = batches(20);
  struct Case {
    const char* name;
    OptimizerOptions ours;
    std::function<std::unique_ptr<torch::optim::Optimizer>(std::vector<at::Tensor>)> reference;
  };
  std::vector<Case> cases = {
      {"sgd momentum wd", OptimizerOptions().algorithm(Algorithm::sgd).lr(0.05).momentum(0.9).weight_decay(0.01),
       [](std::vector<at::Tensor> p) {
         return std::make_unique<torch::optim::SGD>(p, torch::optim::SGDOptions(0.05).momentum(0.9).weight_decay(0.01));
       }},
      {"sgd nesterov", OptimizerOptions().algorithm(Algorithm::sgd).lr(0.05).momentum(0.9).nesterov(true),
       [](std::vector<at::Tensor> p) {
         return std::make_unique<torch::optim::SGD>(p, torch::optim::SGDOptions(0.05).momentum(0.9).nesterov(true));
       }},
      {"sgd plain", OptimizerOptions().algorithm(Algorithm::sgd).lr(0.1),
       [](std::vector<at::Tensor> p) { return std::make_unique<torch::optim::SGD>(p, torch::optim::SGDOptions(0.1)); }},
      {"adam wd", OptimizerOptions().algorithm(Algorithm::adam).lr(1e-2).weight_decay(0.01),
       [](std::vector<at::Tensor> p) {
         return std::make_unique<torch::optim::Adam>(p, torch::optim::AdamOptions(1e-2).weight_decay(0.01));
       }},
      {"adamw wd", OptimizerOptions().algorithm(Algorithm::adamw).lr(1e-2).weight_decay(0.1).beta2(0.95),
       [](std::vector<at::Tensor> p) {
         return std::make_unique<torch::optim::AdamW>(p,
                                                      torch::optim::AdamWOptions(1e-2).weight_decay(0.1).betas(std::make_tuple(0.9, 0.95)));
       }},
  };
  for (auto& c : cases) {
    for (Mode mode : {Mode::standard, Mode::in_backward}) {
      for (const at::ScalarType dtype : {at::kFloat, at::kDouble}) {
        SCOPED_TRACE(std::string(c.name) + " " + optim::mode_name(mode) + " " + c10::toString(dtype));
        Model ours(2, 32, 3), ref(2, 32, 3), start(2, 32, 3);
        for (Model* m : {&ours, &ref, &start}) m->to(dtype);
        optim::Optimizer opt(ours.named_parameters(), c.ours.mode(mode));
        auto reference = c.reference(ref.parameters());
        run_steps(ours, opt, in_dtype(data, dtype));
        train_reference(ref, *reference, in_dtype(data, dtype));
        EXPECT_LE(max_param_diff(ours, ref), torch_optim_tolerance(c.ours.algorithm(), dtype));
        EXPECT_GT(max_param_diff(ours, start), 1e-3);  // it did train
      }
    }
  }
}

TEST(Optimizer, InBackwardEqualsStandardOnARealModelWithAndWithoutCheckpointing) {
  const auto data = batches(20, 5);
  for (const char* policy : {"none", "full", "every_2", "selective"}) {
    SCOPED_TRACE(policy);
    const auto p = checkpoint::CheckpointPolicy::parse(policy);
    Model a(3, 32, 7), b(3, 32, 7);
    const auto opts = OptimizerOptions().lr(3e-3).weight_decay(0.05);
    optim::Optimizer standard(a.named_parameters(), opts);
    optim::Optimizer in_backward(b.named_parameters(), OptimizerOptions(opts).mode(Mode::in_backward));
    run_steps(a, standard, data, p);
    run_steps(b, in_backward, data, p);
    EXPECT_LE(max_param_diff(a, b), 1e-6);
    for (const auto& param : b.parameters()) EXPECT_FALSE(param.grad().defined());  // freed during backward
  }
}

TEST(Optimizer, ParamGroupsHaveTheirOwnLrAndWeightDecay) {
  const auto data = batches(10, 9);
  Model ours(2, 32, 4), ref(2, 32, 4);
  auto split = [](Model& m, bool names) {
    optim::ParamGroup decay, no_decay;
    for (const auto& item : m.named_parameters()) {
      auto& g = item.value().dim() >= 2 ? decay : no_decay;
      g.params.push_back(item.value());
      if (names) g.names.push_back(item.key());
    }
    return std::make_pair(decay, no_decay);
  };
  auto [decay, no_decay] = split(ours, true);
  decay.weight_decay = 0.1;
  no_decay.lr = 5e-3;
  no_decay.weight_decay = 0.0;
  for (Mode mode : {Mode::standard, Mode::in_backward}) {
    Model m(2, 32, 4);
    auto [d2, n2] = split(m, true);
    d2.weight_decay = 0.1;
    n2.lr = 5e-3;
    n2.weight_decay = 0.0;
    optim::Optimizer opt({d2, n2}, OptimizerOptions().lr(1e-2).mode(mode));
    EXPECT_DOUBLE_EQ(opt.lr(0), 1e-2);
    EXPECT_DOUBLE_EQ(opt.lr(1), 5e-3);
    run_steps(m, opt, data);
    Model r(2, 32, 4);
    auto [rd, rn] = split(r, false);
    std::vector<torch::optim::OptimizerParamGroup> groups;
    groups.emplace_back(rd.params, std::make_unique<torch::optim::AdamWOptions>(torch::optim::AdamWOptions(1e-2).weight_decay(0.1)));
    groups.emplace_back(rn.params, std::make_unique<torch::optim::AdamWOptions>(torch::optim::AdamWOptions(5e-3).weight_decay(0.0)));
    torch::optim::AdamW reference(groups);
    train_reference(r, reference, data);
    EXPECT_LE(max_param_diff(m, r), torch_optim_tolerance(Algorithm::adamw, at::kFloat)) << optim::mode_name(mode);
  }
}

TEST(Optimizer, SchedulesDriveBothModesTheSameWay) {
  const auto data = batches(12, 11);
  Model a(2, 32, 2), b(2, 32, 2);
  const auto opts = OptimizerOptions().lr(1e-2);
  const auto sched = optim::ScheduleOptions().kind(optim::ScheduleKind::cosine).warmup_steps(3).total_steps(12);
  optim::Optimizer oa(a.named_parameters(), opts), ob(b.named_parameters(), OptimizerOptions(opts).mode(Mode::in_backward));
  optim::LRScheduler sa(oa, sched), sb(ob, sched);
  EXPECT_DOUBLE_EQ(oa.lr(), 0.0);  // warm-up starts at 0
  run_steps(a, oa, data, checkpoint::CheckpointPolicy::none(), &sa);
  run_steps(b, ob, data, checkpoint::CheckpointPolicy::none(), &sb);
  EXPECT_LE(max_param_diff(a, b), 1e-6);
  EXPECT_EQ(sa.last_step(), 12);
  EXPECT_NEAR(oa.lr(), 0.0, 1e-12);  // the cosine reached its floor
}

TEST(Optimizer, TwoPassNormEqualsTheStandardGlobalNormAndClipsTheSame) {
  const auto data = batches(8, 13);
  // SGD: its update is linear in the gradient, so the reference's slightly different norm
  // arithmetic stays at rounding level (Adam would amplify it on near-zero gradients).
  Model a(2, 32, 6), b(2, 32, 6), r(2, 32, 6);
  const auto opts = OptimizerOptions().algorithm(Algorithm::sgd).momentum(0.9).lr(0.5).max_grad_norm(0.05);
  optim::Optimizer standard(a.named_parameters(), OptimizerOptions(opts).clip(Clip::global_norm));
  optim::Optimizer two_pass(b.named_parameters(), OptimizerOptions(opts).clip(Clip::global_norm_two_pass).mode(Mode::in_backward));
  torch::optim::SGD reference(r.parameters(), torch::optim::SGDOptions(0.5).momentum(0.9));
  for (const auto& x : data) {
    standard.backward(a.loss(x));
    standard.step();
    standard.zero_grad();
    two_pass.backward(b.loss(x));
    two_pass.step();
    reference.zero_grad();
    r.loss(x).backward();
    const double ref_norm = torch::nn::utils::clip_grad_norm_(r.parameters(), 0.05);
    reference.step();
    EXPECT_NEAR(standard.last_grad_norm(), ref_norm, 1e-5 * ref_norm);
    EXPECT_NEAR(two_pass.last_grad_norm(), standard.last_grad_norm(), 1e-9 * ref_norm);
    EXPECT_GT(ref_norm, 0.05);  // clipping is active
  }
  EXPECT_LE(max_param_diff(a, b), 1e-6);
  EXPECT_LE(max_param_diff(a, r), 1e-6);
}

TEST(Optimizer, TwoPassClippingWorksThroughCheckpointedRegions) {
  const auto data = batches(5, 17);
  for (const char* policy : {"full", "selective"}) {
    SCOPED_TRACE(policy);
    const auto p = checkpoint::CheckpointPolicy::parse(policy);
    Model a(2, 32, 8), b(2, 32, 8);
    const auto opts = OptimizerOptions().lr(1e-2).max_grad_norm(0.05);
    optim::Optimizer standard(a.named_parameters(), OptimizerOptions(opts).clip(Clip::global_norm));
    optim::Optimizer two_pass(b.named_parameters(), OptimizerOptions(opts).clip(Clip::global_norm_two_pass).mode(Mode::in_backward));
    run_steps(a, standard, data, p);
    run_steps(b, two_pass, data, p);
    EXPECT_LE(max_param_diff(a, b), 1e-6);
  }
}

TEST(Optimizer, PerParameterClippingIsTheSameInBothModes) {
  const auto data = batches(6, 19);
  Model a(2, 32, 1), b(2, 32, 1), unclipped(2, 32, 1);
  const auto opts = OptimizerOptions().algorithm(Algorithm::sgd).lr(0.5).clip(Clip::per_param_norm).max_grad_norm(0.01);
  optim::Optimizer oa(a.named_parameters(), opts), ob(b.named_parameters(), OptimizerOptions(opts).mode(Mode::in_backward));
  optim::Optimizer ou(unclipped.named_parameters(), OptimizerOptions(opts).clip(Clip::none));
  run_steps(a, oa, data);
  run_steps(b, ob, data);
  run_steps(unclipped, ou, data);
  EXPECT_LE(max_param_diff(a, b), 1e-6);
  EXPECT_GT(max_param_diff(a, unclipped), 1e-3);  // the clipping did something
}

TEST(Optimizer, RefusesWhatItCannotDo) {
  Model m(1, 32, 0);
  try {
    optim::Optimizer opt(m.named_parameters(), OptimizerOptions().mode(Mode::in_backward).clip(Clip::global_norm));
    FAIL() << "single-pass global-norm clipping in backward was accepted";
  } catch (const std::invalid_argument& e) {
    EXPECT_NE(std::string(e.what()).find("global_norm_two_pass"), std::string::npos) << e.what();
  }
  try {
    optim::Optimizer opt(m.named_parameters(), OptimizerOptions().mode(Mode::in_backward).accumulation_steps(4));
    FAIL() << "accumulation in backward was accepted";
  } catch (const std::invalid_argument& e) {
    EXPECT_NE(std::string(e.what()).find("cannot be accumulated over 4 micro-batches"), std::string::npos) << e.what();
  }
  EXPECT_THROW(optim::Optimizer(m.named_parameters(), OptimizerOptions().lr(-1)), std::invalid_argument);
  EXPECT_THROW(optim::Optimizer(m.named_parameters(), OptimizerOptions().algorithm(Algorithm::sgd).nesterov(true)), std::invalid_argument);
}

TEST(Optimizer, AccumulationInStandardModeEqualsTheFullBatch) {
  const auto data = batches(6, 23);
  // SGD: summing two half-batch gradients differs from the full batch only by rounding, which an
  // update linear in the gradient keeps at rounding level.
  Model a(2, 32, 5), b(2, 32, 5);
  const auto opts = OptimizerOptions().algorithm(Algorithm::sgd).momentum(0.9).lr(0.5);
  optim::Optimizer full(a.named_parameters(), opts);
  optim::Optimizer accum(b.named_parameters(), OptimizerOptions(opts).accumulation_steps(2));
  for (const auto& x : data) {
    full.backward(a.loss(x));
    EXPECT_TRUE(full.step());
    full.zero_grad();
    // (2, T, d) as two micro-batches of one; loss scaled by 1/2 so the sum is the batch mean
    for (int i = 0; i < 2; ++i) {
      accum.backward(b.loss(x.slice(0, i, i + 1)) / 2);
      EXPECT_EQ(accum.step(), i == 1);
      accum.zero_grad();
    }
  }
  EXPECT_LE(max_param_diff(a, b), 1e-6);
  EXPECT_EQ(accum.steps_taken(), 6);
}

TEST(Optimizer, StateDictMovesBetweenModesAndContinuesTheTrajectory) {
  const auto data = batches(20, 29);
  const std::vector<at::Tensor> first(data.begin(), data.begin() + 10), second(data.begin() + 10, data.end());
  const auto opts = OptimizerOptions().lr(5e-3).weight_decay(0.01);
  Model straight(2, 32, 12);
  optim::Optimizer o1(straight.named_parameters(), opts);
  run_steps(straight, o1, data);

  for (Mode resumed_mode : {Mode::standard, Mode::in_backward}) {
    Model before(2, 32, 12);
    optim::TensorDict saved_state;
    std::vector<at::Tensor> saved_params;
    {
      optim::Optimizer o(before.named_parameters(),
                         OptimizerOptions(opts).mode(resumed_mode == Mode::standard ? Mode::in_backward : Mode::standard));
      run_steps(before, o, first);
      for (const auto& [k, v] : o.state_dict()) saved_state[k] = v.clone();
      for (const auto& p : before.parameters()) saved_params.push_back(p.detach().clone());
    }
    Model after(2, 32, 99);  // other initial weights: everything comes from the saved state
    {
      at::NoGradGuard no_grad;
      auto ps = after.parameters();
      for (size_t i = 0; i < ps.size(); ++i) ps[i].copy_(saved_params[i]);
    }
    optim::Optimizer o(after.named_parameters(), OptimizerOptions(opts).mode(resumed_mode));
    o.load_state_dict(saved_state);
    run_steps(after, o, second);
    EXPECT_LE(max_param_diff(after, straight), 1e-6) << optim::mode_name(resumed_mode);
  }
}

TEST(Optimizer, MismatchedStateIsRefusedWithTheNames) {
  Model m(1, 32, 0);
  optim::Optimizer opt(m.named_parameters(), OptimizerOptions());
  opt.backward(m.loss(at::randn({1, 4, 32})));
  opt.step();
  auto state = opt.state_dict();
  ASSERT_EQ(state.size(), 3 * m.parameters().size());
  auto bad = state;
  bad["block0.qkv.weight.exp_avg"] = at::zeros({3, 3});
  bad["decoder.head.weight.exp_avg"] = at::zeros({3});
  bad.erase("block0.fc1.bias.step");
  bad.erase("block0.fc1.bias.exp_avg");
  bad.erase("block0.fc1.bias.exp_avg_sq");
  try {
    opt.load_state_dict(bad);
    FAIL();
  } catch (const std::invalid_argument& e) {
    const std::string msg = e.what();
    EXPECT_NE(msg.find("Unknown entries: decoder.head.weight.exp_avg"), std::string::npos) << msg;
    EXPECT_NE(msg.find("block0.qkv.weight.exp_avg [3, 3] vs parameter [96, 32]"), std::string::npos) << msg;
    EXPECT_NE(msg.find("Missing: block0.fc1.bias"), std::string::npos) << msg;
  }
  opt.load_state_dict(state);  // the real one loads
}

TEST(Optimizer, NameTablesReadBackEveryValue) {
  for (Algorithm a : optim::kAllAlgorithms) EXPECT_EQ(optim::parse_algorithm(optim::algorithm_name(a)), a);
  for (Clip c : optim::kAllClips) EXPECT_EQ(optim::parse_clip(optim::clip_name(c)), c);
  for (auto p : optim::kAllStatePrecisions) EXPECT_EQ(optim::parse_precision(optim::precision_name(p)), p);
  for (auto p : optim::kAllStatePlacements) EXPECT_EQ(optim::parse_placement(optim::placement_name(p)), p);
  for (auto k : optim::kAllScheduleKinds) EXPECT_EQ(optim::parse_schedule(optim::schedule_name(k)), k);
  EXPECT_FALSE(optim::parse_algorithm("lion").has_value());
  EXPECT_FALSE(optim::parse_clip("Global_Norm").has_value());
}

// The LibTorch habit: parameters(), per-algorithm options with torch::optim's defaults (AdamW's
// weight decay 1e-2 included, which OptimizerOptions' 0 would silently drop), betas as a tuple.
TEST(Optimizer, LibTorchStyleOptionsTrainAsTorchOptimWithItsDefaults) {
  const auto data = batches(10, 41);
  struct Case {
    const char* name;
    std::function<std::unique_ptr<optim::Optimizer>(std::vector<at::Tensor>, Mode)> ours;
    std::function<std::unique_ptr<torch::optim::Optimizer>(std::vector<at::Tensor>)> reference;
    Algorithm algorithm;
  };
  const std::vector<Case> cases = {
      {"AdamWOptions defaults",
       [](std::vector<at::Tensor> p, Mode m) { return std::make_unique<optim::Optimizer>(p, optim::AdamWOptions(1e-2).mode(m)); },
       [](std::vector<at::Tensor> p) { return std::make_unique<torch::optim::AdamW>(p, torch::optim::AdamWOptions(1e-2)); },
       Algorithm::adamw},
      {"AdamOptions betas",
       [](std::vector<at::Tensor> p, Mode m) {
         return std::make_unique<optim::Optimizer>(p, optim::AdamOptions(1e-2).betas({0.8, 0.99}).weight_decay(0.01).mode(m));
       },
       [](std::vector<at::Tensor> p) {
         return std::make_unique<torch::optim::Adam>(p, torch::optim::AdamOptions(1e-2).betas({0.8, 0.99}).weight_decay(0.01));
       },
       Algorithm::adam},
      {"SGDOptions momentum",
       [](std::vector<at::Tensor> p, Mode m) {
         return std::make_unique<optim::Optimizer>(p, optim::SGDOptions(0.05).momentum(0.9).mode(m));
       },
       [](std::vector<at::Tensor> p) { return std::make_unique<torch::optim::SGD>(p, torch::optim::SGDOptions(0.05).momentum(0.9)); },
       Algorithm::sgd},
  };
  for (const auto& c : cases) {
    for (Mode mode : {Mode::standard, Mode::in_backward}) {
      SCOPED_TRACE(std::string(c.name) + " " + optim::mode_name(mode));
      Model ours(2, 32, 7), ref(2, 32, 7);
      auto opt = c.ours(ours.parameters(), mode);
      auto reference = c.reference(ref.parameters());
      for (const auto& x : data) {  // loss.backward(), as a LibTorch loop does
        opt->zero_grad();
        ours.loss(x).backward();
        opt->step();
      }
      train_reference(ref, *reference, data);
      EXPECT_LE(max_param_diff(ours, ref), torch_optim_tolerance(c.algorithm, at::kFloat));
    }
  }
  EXPECT_DOUBLE_EQ(OptimizerOptions(optim::AdamWOptions()).weight_decay(), torch::optim::AdamWOptions().weight_decay());
  EXPECT_DOUBLE_EQ(OptimizerOptions(optim::AdamOptions()).weight_decay(), torch::optim::AdamOptions().weight_decay());
  const OptimizerOptions low = optim::AdamWOptions().state_precision(optim::StatePrecision::int8).mode(Mode::in_backward);
  EXPECT_EQ(low.state().precision(), optim::StatePrecision::int8);
  EXPECT_EQ(low.mode(), Mode::in_backward);
  Model m(1, 32, 0);
  try {
    optim::Optimizer opt(m.parameters(), optim::AdamWOptions().amsgrad(true));
    FAIL() << "amsgrad was accepted";
  } catch (const std::invalid_argument& e) {
    EXPECT_NE(std::string(e.what()).find("amsgrad"), std::string::npos) << e.what();
  }
}

// Groups as torch::optim makes them (tensors and what differs), named by position in the state dict.
TEST(Optimizer, UnnamedParamGroupsAreNamedByPosition) {
  Model m(1, 32, 0);
  auto ps = m.parameters();
  const std::vector<at::Tensor> first(ps.begin(), ps.begin() + 2), rest(ps.begin() + 2, ps.end());
  optim::Optimizer opt({optim::ParamGroup(first, 0.1), optim::ParamGroup(rest)}, optim::AdamWOptions(1e-3));
  EXPECT_DOUBLE_EQ(opt.lr(0), 0.1);
  EXPECT_DOUBLE_EQ(opt.lr(1), 1e-3);
  const auto names = opt.parameter_names();
  ASSERT_EQ(names.size(), ps.size());
  for (size_t i = 0; i < names.size(); ++i) EXPECT_EQ(names[i], std::to_string(i));
  opt.backward(m.loss(batches(1)[0]));
  opt.step();
  EXPECT_EQ(opt.state_dict().count(std::to_string(ps.size() - 1) + ".exp_avg_sq"), 1u);
}

// torch::save and torch::load carry the state: a run saved half-way and loaded into a new optimizer
// follows the uninterrupted run exactly; a file without frugal's entry is refused by name.
TEST(Optimizer, TorchSaveAndLoadContinueTheTrajectory) {
  const auto data = batches(8, 43);
  const std::vector<at::Tensor> first(data.begin(), data.begin() + 4), second(data.begin() + 4, data.end());
  const auto opts = optim::AdamWOptions(5e-3).state(optim::StateOptions().precision(optim::StatePrecision::int8).min_quantized_numel(256));
  Model straight(2, 32, 12);
  optim::Optimizer o1(straight.parameters(), opts);
  run_steps(straight, o1, data);

  const std::string path = ::testing::TempDir() + "/frugal_optimizer.pt";
  Model resumed(2, 32, 12);
  {
    optim::Optimizer o(resumed.parameters(), opts);
    run_steps(resumed, o, first);
    torch::save(o, path);
  }
  optim::Optimizer o(resumed.parameters(), opts);
  torch::load(o, path);
  run_steps(resumed, o, second);
  EXPECT_LE(max_param_diff(resumed, straight), 1e-6);

  const std::string other = ::testing::TempDir() + "/frugal_not_optimizer.pt";
  torch::save(at::ones({2}), other);
  try {
    torch::load(o, other);
    FAIL() << "a tensor file was loaded as optimizer state";
  } catch (const std::invalid_argument& e) {
    EXPECT_NE(std::string(e.what()).find("frugal_optimizer_state"), std::string::npos) << e.what();
  }
}

// loss.backward() under two-pass clipping in backward: one sentence (no backtrace), nothing changed.
TEST(Optimizer, LossBackwardWithTwoPassClippingFailsWithOneSentence) {
  Model m(1, 32, 0);
  std::vector<at::Tensor> before;
  for (const auto& p : m.parameters()) before.push_back(p.detach().clone());
  optim::Optimizer opt(m.parameters(), optim::AdamWOptions().mode(Mode::in_backward).clip(Clip::global_norm_two_pass));
  try {
    m.loss(batches(1)[0]).backward();
    FAIL() << "loss.backward() ran under two-pass clipping";
  } catch (const std::logic_error& e) {
    const std::string what = e.what();
    EXPECT_NE(what.find("call optimizer.backward(loss) instead of loss.backward()"), std::string::npos) << what;
    EXPECT_EQ(what.find('\n'), std::string::npos) << what;
  }
  const auto ps = m.parameters();
  for (size_t i = 0; i < ps.size(); ++i) EXPECT_TRUE(ps[i].equal(before[i]));
}

namespace {

// Parameters and state bit for bit: an update thread must compute what the hook computes.
void expect_same_bits(Model& a, optim::Optimizer& oa, Model& b, optim::Optimizer& ob) {
  EXPECT_EQ(max_param_diff(a, b), 0.0);
  const optim::TensorDict sa = oa.state_dict(), sb = ob.state_dict();
  ASSERT_EQ(sa.size(), sb.size());
  for (const auto& [name, t] : sa) {
    ASSERT_TRUE(sb.count(name)) << name;
    EXPECT_TRUE(t.equal(sb.at(name))) << name;
  }
}

std::string empty_state_dir(const std::string& name) {
  const std::string dir = ::testing::TempDir() + "/" + name;
  std::filesystem::remove_all(dir);
  std::filesystem::create_directories(dir);
  return dir;
}

}  // namespace

// update_threads: the updates run on a thread of their own while backward goes on, and give the
// hook's bits in every precision, placement (the window of a state file included), clipping and
// algorithm, whatever the bound on gradients in flight (0: at most one held while backward runs;
// 1 MiB: all of them) and the update thread's intra-op threads, through checkpointed blocks.
TEST(Optimizer, UpdateThreadGivesTheHooksBits) {
  const auto data = batches(4, 53);
  const std::string dir = empty_state_dir("frugal_update_thread_state");
  auto state = [&](optim::StatePrecision p, optim::StatePlacement where = optim::StatePlacement::device) {
    return optim::StateOptions().precision(p).placement(where).min_quantized_numel(256).mmap_dir(dir).window_bytes(64 << 10);
  };
  struct Case {
    const char* name;
    OptimizerOptions options;
    at::ScalarType dtype;
  };
  const auto adamw = OptimizerOptions().lr(3e-3).weight_decay(0.05).mode(Mode::in_backward);
  const std::vector<Case> cases = {
      {"adamw fp32", adamw, at::kFloat},
      {"adamw int8, per-parameter clipping",
       OptimizerOptions(adamw).state(state(optim::StatePrecision::int8)).clip(Clip::per_param_norm).max_grad_norm(0.05), at::kFloat},
      {"adamw int4, two-pass clipping",
       OptimizerOptions(adamw).state(state(optim::StatePrecision::int4)).clip(Clip::global_norm_two_pass).max_grad_norm(0.05), at::kFloat},
      {"sgd momentum", OptimizerOptions().algorithm(Algorithm::sgd).lr(0.05).momentum(0.9).mode(Mode::in_backward), at::kFloat},
      {"bf16 parameters, stochastic rounding, int8 in a file through a 64 KiB window",
       OptimizerOptions(adamw).state(state(optim::StatePrecision::int8, optim::StatePlacement::file)).stochastic_rounding(true),
       at::kBFloat16},
  };
  const auto full = checkpoint::CheckpointPolicy::parse("full");
  for (const Case& c : cases) {
    Model hooked(3, 32, 31);
    hooked.to(c.dtype);
    optim::Optimizer in_hook(hooked.named_parameters(), c.options);
    run_steps(hooked, in_hook, in_dtype(data, c.dtype), full);
    for (int64_t threads : {1, 2}) {
      for (int64_t in_flight : {int64_t{0}, int64_t{1} << 20}) {
        SCOPED_TRACE(std::string(c.name) + ", " + std::to_string(threads) + " threads, " + std::to_string(in_flight) + " bytes in flight");
        Model threaded(3, 32, 31);
        threaded.to(c.dtype);
        optim::Optimizer beside(threaded.named_parameters(),
                                OptimizerOptions(c.options).update_threads(threads).bytes_in_flight(in_flight));
        run_steps(threaded, beside, in_dtype(data, c.dtype), full);
        expect_same_bits(hooked, in_hook, threaded, beside);
        for (const auto& p : threaded.parameters()) EXPECT_FALSE(p.grad().defined());  // every gradient used and freed
        EXPECT_GT(beside.update_seconds(), 0.0);
      }
    }
  }
}

// An update that fails on the update thread fails the backward that handed it over (not a later,
// unrelated call), with its own message; nothing hangs, and once the cause is gone training goes on.
TEST(Optimizer, UpdateThreadFailureComesOutOfBackward) {
  const std::string dir = empty_state_dir("frugal_update_thread_gone");
  Model m(2, 32, 5);
  optim::Optimizer opt(
      m.named_parameters(),
      OptimizerOptions()
          .mode(Mode::in_backward)
          .update_threads(1)
          .bytes_in_flight(1 << 20)
          .state(optim::StateOptions().precision(optim::StatePrecision::int8).placement(optim::StatePlacement::file).mmap_dir(dir)));
  std::filesystem::remove_all(dir);  // the state files are made at the first update: there is nowhere to make them
  const auto x = batches(1, 3)[0];
  try {
    opt.backward(m.loss(x));
    FAIL() << "the update thread's failure did not come out of backward";
  } catch (const std::exception& e) {
    EXPECT_NE(std::string(e.what()).find("cannot create a file in " + dir), std::string::npos) << e.what();
  }
  opt.zero_grad();
  std::filesystem::create_directories(dir);
  Model before(2, 32, 5);
  opt.backward(m.loss(x));
  EXPECT_TRUE(opt.step());
  EXPECT_GT(max_param_diff(m, before), 1e-4);
}

// The memory tracker sees what the update thread allocates and frees as the hook's: after each step
// the same live bytes in every category (no gradient left, the same state), no free it missed.
TEST(Optimizer, UpdateThreadsMemoryIsTrackedAsTheHooks) {
  const auto data = batches(3, 61);
  std::vector<memory::CategoryBytes> live[2];
  int64_t untracked[2] = {0, 0};
  for (int threads : {0, 1}) {
    Model m(2, 32, 9);
    auto tracker = memory::Tracker::create();
    tracker->watch(m);
    memory::TrackingGuard on(tracker);
    optim::Optimizer opt(m.named_parameters(),
                         OptimizerOptions()
                             .mode(Mode::in_backward)
                             .update_threads(threads)
                             .bytes_in_flight(1 << 20)
                             .state(optim::StateOptions().precision(optim::StatePrecision::int8).min_quantized_numel(256)));
    for (const auto& x : data) {
      at::Tensor loss;
      {
        memory::PhaseScope fw(memory::Phase::forward);
        loss = m.loss(x);
      }
      {
        memory::PhaseScope bw(memory::Phase::backward);
        opt.backward(loss);
      }
      loss = at::Tensor();
      opt.step();
      live[threads].push_back(tracker->live_by_category());
    }
    untracked[threads] = tracker->untracked_frees();
  }
  EXPECT_EQ(untracked[1], untracked[0]);
  ASSERT_EQ(live[0].size(), live[1].size());
  for (size_t s = 0; s < live[0].size(); ++s) {
    for (auto c : memory::kAllCategories) {
      EXPECT_EQ(live[1][s][static_cast<int>(c)], live[0][s][static_cast<int>(c)]) << "step " << s << ", " << memory::category_name(c);
    }
    EXPECT_EQ(live[1][s][static_cast<int>(memory::Category::gradient)], 0);
    EXPECT_GT(live[1][s][static_cast<int>(memory::Category::optimizer_state)], 0);
  }
}

TEST(Optimizer, UpdateThreadsAreRefusedWhereTheyCannotRun) {
  Model m(1, 32, 0);
  try {
    optim::Optimizer opt(m.named_parameters(), OptimizerOptions().update_threads(1));
    FAIL() << "update_threads in standard mode was accepted";
  } catch (const std::invalid_argument& e) {
    EXPECT_NE(std::string(e.what()).find("needs mode in_backward"), std::string::npos) << e.what();
  }
  EXPECT_THROW(optim::Optimizer(m.named_parameters(), OptimizerOptions().mode(Mode::in_backward).update_threads(-1)),
               std::invalid_argument);
  EXPECT_THROW(optim::Optimizer(m.named_parameters(), OptimizerOptions().mode(Mode::in_backward).bytes_in_flight(-1)),
               std::invalid_argument);
}
