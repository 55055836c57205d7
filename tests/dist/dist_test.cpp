// Data parallel (dist/): how parameters are split over ranks, torchrun's environment contract,
// sharded optimizer state that loads at any world size, and two ranks (threads of this process,
// over real Gloo) that train exactly as one process on the whole batch.
#include <gtest/gtest.h>

#include <cstdlib>
#include <thread>

#include "frugal/dist/group.h"
#include "frugal/dist/launch.h"
#include "frugal/dist/sharded_exchange.h"
#include "frugal/models/transformer_block.h"
#include "frugal/optim/optimizer.h"

using namespace frugal;

namespace {

struct Model : torch::nn::Module {
  models::PreLNBlock block{nullptr};
  explicit Model(int64_t d = 128, uint64_t seed = 0) {
    torch::manual_seed(seed);
    block = register_module("block", models::PreLNBlock(d, 4));
  }
  at::Tensor loss(const at::Tensor& x) { return block->forward(x).pow(2).mean(); }
};

// Ranges of a fixed ownership, no communication: for loading and saving state only.
struct FixedRanges : optim::Exchange {
  dist::Ownership owners;
  int64_t rank, world;
  FixedRanges(dist::Ownership o, int64_t r, int64_t w) : owners(std::move(o)), rank(r), world(w) {}
  int64_t world_size() const override { return world; }
  std::pair<int64_t, int64_t> owned_range(size_t i) const override { return dist::owned_range(owners.at(i), rank); }
  Wait average_gradient(size_t, const at::Tensor&) override {
    return [] {};
  }
  Wait share_parameter(size_t, const at::Tensor&) override {
    return [] {};
  }
  double sum(double x) override { return x; }
};

// Sets environment variables for one scope and puts the old values back.
struct ScopedEnv {
  std::vector<std::pair<std::string, std::optional<std::string>>> saved;
  ScopedEnv(std::initializer_list<std::pair<const char*, const char*>> vars) {
    for (const char* name : {"RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"}) {
      const char* v = std::getenv(name);
      saved.emplace_back(name, v ? std::optional<std::string>(v) : std::nullopt);
      ::unsetenv(name);
    }
    for (const auto& [k, v] : vars) ::setenv(k, v, 1);
  }
  ~ScopedEnv() {
    for (const auto& [k, v] : saved) {
      if (v)
        ::setenv(k.c_str(), v->c_str(), 1);
      else
        ::unsetenv(k.c_str());
    }
  }
};

optim::OptimizerOptions adamw(optim::StatePrecision p = optim::StatePrecision::fp32, optim::Mode mode = optim::Mode::standard) {
  return optim::OptimizerOptions().lr(1e-2).weight_decay(0.1).mode(mode).state(optim::StateOptions().precision(p));
}

}  // namespace

TEST(DataParallel, OwnersSplitLargeParametersAndBalanceTheRest) {
  const std::vector<int64_t> numels = {262144, 4096, 16384, 64, 64, 45056, 45056, 22528, 100000, 7};
  int64_t total = 0;
  for (int64_t n : numels) total += n;
  for (int64_t world : {1, 2, 3, 4}) {
    const dist::Ownership owners = dist::assign_owners(numels, world);
    std::vector<int64_t> load(static_cast<size_t>(world), 0);
    for (size_t i = 0; i < numels.size(); ++i) {
      const auto& slices = owners[i];
      const bool split = numels[i] >= world * dist::kMinSliceElements && world > 1;
      ASSERT_EQ(slices.size(), split ? static_cast<size_t>(world) : 1u) << "parameter " << i << ", world " << world;
      int64_t at = 0;
      for (const auto& s : slices) {
        EXPECT_EQ(s.begin, at);  // they tile the parameter
        if (split) {
          EXPECT_EQ(s.begin % dist::kSliceAlignment, 0);
          EXPECT_GE(s.end - s.begin, 4096) << "a slice too small to keep the parameter's state precision";
        }
        load[static_cast<size_t>(s.rank)] += s.end - s.begin;
        at = s.end;
      }
      EXPECT_EQ(at, numels[i]);
    }
    // About 1/N each: within the largest unsplit parameter of the even share.
    for (int64_t l : load) EXPECT_LE(std::abs(l - total / world), 16384) << "world " << world;
    // The per-rank totals do not depend on the parameters' order.
    std::vector<int64_t> reversed(numels.rbegin(), numels.rend());
    const dist::Ownership other = dist::assign_owners(reversed, world);
    std::vector<int64_t> load2(static_cast<size_t>(world), 0);
    for (const auto& slices : other) {
      for (const auto& s : slices) load2[static_cast<size_t>(s.rank)] += s.end - s.begin;
    }
    EXPECT_EQ(load, load2);
  }
}

TEST(DataParallel, EnvironmentFollowsTorchrunsContract) {
  {
    ScopedEnv env({});
    EXPECT_FALSE(dist::environment_from_variables().has_value());
  }
  {
    ScopedEnv env({{"RANK", "3"},
                   {"WORLD_SIZE", "4"},
                   {"LOCAL_RANK", "1"},
                   {"LOCAL_WORLD_SIZE", "2"},
                   {"MASTER_ADDR", "node0"},
                   {"MASTER_PORT", "29511"}});
    const auto e = dist::environment_from_variables();
    ASSERT_TRUE(e.has_value());
    EXPECT_EQ(e->rank, 3);
    EXPECT_EQ(e->world_size, 4);
    EXPECT_EQ(e->local_rank, 1);
    EXPECT_EQ(e->local_world_size, 2);
    EXPECT_EQ(e->master_addr, "node0");
    EXPECT_EQ(e->master_port, 29511);
    // and back: a launcher sets exactly these
    std::map<std::string, std::string> vars;
    for (const auto& [k, v] : dist::environment_variables(*e)) vars[k] = v;
    EXPECT_EQ(vars, (std::map<std::string, std::string>{{"RANK", "3"},
                                                        {"WORLD_SIZE", "4"},
                                                        {"LOCAL_RANK", "1"},
                                                        {"LOCAL_WORLD_SIZE", "2"},
                                                        {"MASTER_ADDR", "node0"},
                                                        {"MASTER_PORT", "29511"}}));
  }
  auto refused = [](std::initializer_list<std::pair<const char*, const char*>> vars, const std::string& says) {
    ScopedEnv env(vars);
    try {
      dist::environment_from_variables();
      ADD_FAILURE() << "accepted; expected: " << says;
    } catch (const std::invalid_argument& e) {
      EXPECT_NE(std::string(e.what()).find(says), std::string::npos) << e.what();
    }
  };
  refused({{"WORLD_SIZE", "2"}, {"MASTER_ADDR", "h"}, {"MASTER_PORT", "1"}}, "RANK must be set");
  refused({{"WORLD_SIZE", "2"}, {"RANK", "2"}, {"MASTER_ADDR", "h"}, {"MASTER_PORT", "1"}}, "RANK must be an integer from 0 to 1, not '2'");
  refused({{"WORLD_SIZE", "two"}, {"RANK", "0"}}, "WORLD_SIZE must be an integer from 1 to 4096, not 'two'");
  refused({{"WORLD_SIZE", "2"}, {"RANK", "0"}, {"MASTER_PORT", "1"}}, "MASTER_ADDR must be set");
  refused({{"WORLD_SIZE", "2"}, {"RANK", "0"}, {"MASTER_ADDR", "h"}, {"MASTER_PORT", "70000"}},
          "MASTER_PORT must be an integer from 1 to 65535, not '70000'");
}

// One process's state, split over 2 ranks, then those slices over 3, then back to one process:
// the same state (bit for bit in fp32; int8 blocks decoded and re-encoded where slices are cut).
TEST(DataParallel, ShardedStateLoadsAtAnyWorldSize) {
  for (auto precision : {optim::StatePrecision::fp32, optim::StatePrecision::int8}) {
    Model model;
    optim::Optimizer single(model.named_parameters(), adamw(precision));
    torch::manual_seed(3);
    for (int i = 0; i < 2; ++i) {
      single.backward(model.loss(at::randn({2, 8, 128})));
      single.step();
      single.zero_grad();
    }
    const optim::TensorDict reference = single.state_dict();
    auto reshard = [&](const std::vector<optim::TensorDict>& from, int64_t world) {
      optim::TensorDict merged;
      for (const auto& d : from) merged.insert(d.begin(), d.end());
      std::vector<optim::TensorDict> out;
      for (int64_t rank = 0; rank < world; ++rank) {
        Model replica;
        optim::Optimizer opt(replica.named_parameters(), adamw(precision));
        if (world > 1) opt.set_exchange(std::make_shared<FixedRanges>(dist::assign_owners(opt.parameter_numels(), world), rank, world));
        opt.load_state_dict(merged);
        out.push_back(opt.state_dict());
        for (const auto& [k, v] : out.back()) out.back()[k] = v.clone();  // past the optimizer's life
      }
      return out;
    };
    const auto two = reshard({reference}, 2);
    bool any_split = false;
    for (const auto& d : two) {
      for (const auto& kv : d) any_split = any_split || kv.first.find('@') != std::string::npos;
    }
    EXPECT_TRUE(any_split) << "the model has parameters large enough to split";
    const auto back = reshard(reshard(two, 3), 1).front();
    ASSERT_EQ(back.size(), reference.size());
    for (const auto& [name, t] : reference) {
      ASSERT_TRUE(back.count(name)) << name;
      if (precision == optim::StatePrecision::fp32 || name.find(".codes") == std::string::npos) {
        if (name.find(".absmax") != std::string::npos) {
          EXPECT_TRUE(at::allclose(back.at(name), t, 1e-6, 0)) << name;
        } else {
          EXPECT_TRUE(at::equal(back.at(name), t)) << name;
        }
      } else {
        // int8 codes decoded and encoded again: the same code, or its neighbour at a tie
        EXPECT_LE((back.at(name).to(at::kInt) - t.to(at::kInt)).abs().max().item<int>(), 1) << name;
      }
    }
  }
}

// Two ranks in threads of this process, each with half of every batch, against one process on
// the whole batch: the same parameters after three steps, in both modes. SGD with momentum, whose
// update is linear in the gradient: Adam's division by sqrt(v) turns the last-bit differences of
// near-zero gradients (the two halves' sum is rounded differently) into lr-sized ones, so its
// equality is checked on the losses of real runs (tests/apps/dist_test.sh).
TEST(DataParallel, TwoRanksMatchOneProcessOnTheWholeBatch) {
  for (auto mode : {optim::Mode::standard, optim::Mode::in_backward}) {
    for (auto clip : {optim::Clip::none, optim::Clip::per_param_norm}) {
      torch::manual_seed(7);
      std::vector<at::Tensor> data;
      for (int i = 0; i < 3; ++i) data.push_back(at::randn({4, 8, 128}));
      auto opts = optim::OptimizerOptions()
                      .algorithm(optim::Algorithm::sgd)
                      .lr(0.1)
                      .momentum(0.9)
                      .weight_decay(0.01)
                      .mode(mode)
                      .clip(clip)
                      .max_grad_norm(0.05);
      Model whole;
      optim::Optimizer single(whole.named_parameters(), opts);
      for (const auto& x : data) {
        single.backward(whole.loss(x));
        single.step();
        single.zero_grad();
      }
      const int64_t port = dist::free_port();
      // Made here: the models' initialisation draws from the global generator, which threads would race for.
      std::vector<std::shared_ptr<Model>> replicas = {std::make_shared<Model>(), std::make_shared<Model>()};
      std::vector<std::string> errors(2);
      std::vector<dist::Traffic> traffic(2);
      auto rank_main = [&](int64_t rank) {
        try {
          dist::Environment env;
          env.rank = env.local_rank = rank;
          env.world_size = env.local_world_size = 2;
          env.master_port = port;
          auto group = dist::Group::create(env, std::chrono::seconds(60));
          auto model = replicas[static_cast<size_t>(rank)];
          optim::Optimizer opt(model->named_parameters(), opts);
          opt.set_exchange(
              std::make_shared<dist::ShardedExchange>(group, dist::assign_owners(opt.parameter_numels(), 2), opt.parameter_names()));
          for (const auto& x : data) {
            opt.backward(model->loss(x.narrow(0, rank * 2, 2)));
            opt.step();
            opt.zero_grad();
          }
          traffic[static_cast<size_t>(rank)] = group->traffic();
        } catch (const std::exception& e) {
          errors[static_cast<size_t>(rank)] = e.what();
        }
      };
      std::thread r0(rank_main, 0), r1(rank_main, 1);
      r0.join();
      r1.join();
      ASSERT_EQ(errors[0], "");
      ASSERT_EQ(errors[1], "");
      const auto expected = whole.parameters();
      for (const auto& replica : replicas) {
        const auto got = replica->parameters();
        for (size_t i = 0; i < got.size(); ++i) {
          EXPECT_LE((got[i] - expected[i]).abs().max().item<double>(), 2e-6) << optim::mode_name(mode) << " " << optim::clip_name(clip);
        }
      }
      // Every gradient once to its owners and every parameter once from them, per step.
      int64_t param_bytes = 0;
      for (const auto& p : expected) param_bytes += p.numel() * 4;
      EXPECT_EQ(traffic[0].reduce_bytes, 3 * param_bytes);
      EXPECT_EQ(traffic[0].broadcast_bytes, 3 * param_bytes);
    }
  }
}

// The update thread uses each gradient as it comes; data parallel averages it first in the hook:
// the two together are refused when the exchange is set, with the option named.
TEST(DataParallel, UpdateThreadsAreRefusedWithAnExchange) {
  Model m(32, 0);
  optim::Optimizer opt(m.named_parameters(), optim::OptimizerOptions().mode(optim::Mode::in_backward).update_threads(1));
  try {
    opt.set_exchange(std::make_shared<FixedRanges>(dist::assign_owners(opt.parameter_numels(), 2), 0, 2));
    FAIL() << "update_threads with data parallel was accepted";
  } catch (const std::invalid_argument& e) {
    EXPECT_NE(std::string(e.what()).find("update_threads cannot be used with data parallel"), std::string::npos) << e.what();
  }
}
