// Optimizer state through its checkpoint file: read back one parameter at a time, it gives exactly
// the state and the steps that an in-memory state dict gives (every precision and placement), and
// restoring it needs the final state plus one parameter's saved entries, not the whole file.
#include <gtest/gtest.h>

#include <unistd.h>

#include <algorithm>
#include <cstdio>

#include "frugal/io/safetensors.h"
#include "frugal/memory/tracker.h"
#include "frugal/optim/optimizer.h"
#include "frugal/train/run_state.h"

using namespace frugal;
using namespace frugal::optim;

namespace {

std::string temp_path(const std::string& name) {
  return ::testing::TempDir() + "/frugal_run_state_" + std::to_string(::getpid()) + "_" + name;
}

// Two matrices (quantized state) and a bias (small: fp32 state) fitting y = flip(x).
struct Regression {
  std::vector<std::string> names = {"w1", "w2", "bias"};
  std::vector<at::Tensor> params;
  explicit Regression(uint64_t seed) {
    torch::manual_seed(seed);
    params = {(at::randn({64, 96}) * 0.1).requires_grad_(), (at::randn({96, 64}) * 0.1).requires_grad_(),
              at::zeros({64}).requires_grad_()};
  }
  Regression(const Regression& other) : names(other.names) {
    for (const auto& p : other.params) params.push_back(p.detach().clone().requires_grad_());
  }
  std::vector<ParamGroup> groups() const { return {ParamGroup{names, params, std::nullopt, std::nullopt}}; }
  // x: (B, 64) -> tanh(x w1): (B, 96) -> (B, 64)
  at::Tensor loss(const at::Tensor& x) const {
    return (at::tanh(x.mm(params[0])).mm(params[1]) + params[2] - x.flip(1)).pow(2).mean();
  }
  void train(Optimizer& opt, int64_t first, int64_t steps) const {
    for (int64_t i = first; i < first + steps; ++i) {
      torch::manual_seed(100 + static_cast<uint64_t>(i));
      opt.backward(loss(at::randn({16, 64})));
      opt.step();
      opt.zero_grad();
    }
  }
};

void expect_same_state(const TensorDict& a, const TensorDict& b) {
  ASSERT_EQ(a.size(), b.size());
  for (const auto& [k, v] : a) {
    ASSERT_TRUE(b.count(k)) << k;
    EXPECT_EQ(v.scalar_type(), b.at(k).scalar_type()) << k;
    EXPECT_TRUE(at::equal(v, b.at(k))) << k;  // bit for bit
  }
}

}  // namespace

TEST(RunState, OptimizerStateFromItsFileEqualsTheStateDictInEveryPrecisionAndPlacement) {
  for (StatePrecision precision : kAllStatePrecisions) {
    for (StatePlacement placement : kAllStatePlacements) {
      SCOPED_TRACE(std::string(precision_name(precision)) + " " + placement_name(placement));
      const auto opts = OptimizerOptions().lr(3e-3).weight_decay(0.01).state(StateOptions().precision(precision).placement(placement));
      Regression straight(1);
      Optimizer o_straight(straight.groups(), opts);
      straight.train(o_straight, 0, 4);
      const std::string path = temp_path(std::string(precision_name(precision)) + placement_name(placement));
      train::save_optimizer_state(path, o_straight);
      TensorDict saved;
      for (const auto& [k, v] : o_straight.state_dict()) saved[k] = v.clone();

      Regression from_dict(straight), from_file(straight);
      Optimizer o_dict(from_dict.groups(), opts), o_file(from_file.groups(), opts);
      o_dict.load_state_dict(saved);
      train::load_optimizer_state(path, o_file);
      ::unlink(path.c_str());
      expect_same_state(o_file.state_dict(), o_dict.state_dict());
      expect_same_state(o_file.state_dict(), saved);

      straight.train(o_straight, 4, 4);
      from_dict.train(o_dict, 4, 4);
      from_file.train(o_file, 4, 4);
      for (size_t i = 0; i < straight.params.size(); ++i) {
        EXPECT_TRUE(at::equal(from_file.params[i], from_dict.params[i])) << straight.names[i];
        EXPECT_TRUE(at::equal(from_file.params[i], straight.params[i])) << straight.names[i];
      }
      expect_same_state(o_file.state_dict(), o_dict.state_dict());
    }
  }
}

TEST(RunState, RestoringOptimizerStatePeaksAtTheStatePlusOneParametersEntries) {
  // int8 state of four large matrices, the largest (1.5M values) restored last, when the rest of
  // the state already exists: the peak is then the whole state plus its entries.
  const std::vector<std::string> names = {"w0", "w1", "w2", "w3"};
  const std::vector<std::vector<int64_t>> shapes = {{256, 1024}, {512, 1024}, {1024, 1024}, {1536, 1024}};
  std::vector<at::Tensor> params;
  for (const auto& s : shapes) params.push_back(at::zeros(s).requires_grad_());
  const std::vector<ParamGroup> groups = {ParamGroup{names, params, std::nullopt, std::nullopt}};
  const auto opts = OptimizerOptions().state(StateOptions().precision(StatePrecision::int8));
  const std::string path = temp_path("peak");
  {
    Optimizer trained(groups, opts);
    torch::manual_seed(3);
    for (auto& p : params) p.mutable_grad() = at::randn_like(p);
    trained.step();
    trained.zero_grad();
    train::save_optimizer_state(path, trained);
  }
  int64_t largest_entries = 0;  // bytes of one parameter's saved entries, the most of any
  {
    io::SafetensorsReader file(path);
    for (const auto& name : names) {
      int64_t bytes = 0;
      for (const auto& t : file.tensors()) {
        if (t.name.rfind(name + ".", 0) == 0) bytes += static_cast<int64_t>(t.end - t.begin);
      }
      largest_entries = std::max(largest_entries, bytes);
    }
  }

  Optimizer streamed(groups, opts);  // made first: its shared code tables are not what is measured
  auto tracker = memory::Tracker::create();
  {
    memory::TrackingGuard on(tracker);
    train::load_optimizer_state(path, streamed);
  }
  const int64_t state = streamed.state_bytes();
  ASSERT_GT(state, 6 << 20);  // 3.25M values, two moments of a byte each
  EXPECT_LE(static_cast<double>(tracker->peak_bytes()), 1.05 * static_cast<double>(state + largest_entries))
      << "state " << state << ", largest parameter's entries " << largest_entries;

  // Reading the whole file first, as resuming used to, needs about twice the state.
  Optimizer whole(groups, opts);
  auto whole_tracker = memory::Tracker::create();
  {
    memory::TrackingGuard on(whole_tracker);
    TensorDict all;
    io::SafetensorsReader file(path);
    for (const auto& t : file.tensors()) all[t.name] = file.load(t.name);
    whole.load_state_dict(all);
  }
  EXPECT_GE(static_cast<double>(whole_tracker->peak_bytes()), 1.9 * static_cast<double>(state));
  expect_same_state(streamed.state_dict(), whole.state_dict());
  std::printf("[ peak ] state %lld bytes, largest parameter's entries %lld: restored one parameter at a time %.3fx "
              "the state, from the whole file read first %.3fx\n",
              static_cast<long long>(state), static_cast<long long>(largest_entries),
              static_cast<double>(tracker->peak_bytes()) / static_cast<double>(state),
              static_cast<double>(whole_tracker->peak_bytes()) / static_cast<double>(state));
  ::unlink(path.c_str());
}
